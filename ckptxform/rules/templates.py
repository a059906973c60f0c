"""Key templates: ``model.layers.{L}.mlp.experts.{E}.{P:w1,w3}.weight``.

``{NAME}`` binds one dotted segment, ``{NAME*}`` one or more, ``{NAME:a,b}`` one of the
listed literals (their order is the listed order), ``{a,b}`` is an anonymous enumeration;
anonymous enumerations of a rule's ``key`` and ``to`` pair up by position (``_0``,
``_1``, ...). A template is a regex for matching and a format for expanding, so a rule
written with templates can be read backwards (``ckptxform invert``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from ..digits import is_ascii_digits

_PART = re.compile(r"\{([^{}]*)\}")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LITERAL = re.compile(r"^[^{}.,\s]+(?:\.[^{}.,\s]+)*$")


class TemplateError(ValueError):
    """A malformed template; ``col`` is the 0-based position of the bad part."""

    def __init__(self, message: str, col: int = 0) -> None:
        super().__init__(message)
        self.col = col


@dataclass(frozen=True)
class Var:
    """One ``{...}`` of a template. ``values`` is the enumeration (None: any segment)."""

    name: str
    values: tuple[str, ...] | None = None
    multi: bool = False  # {NAME*}: one or more dotted segments

    def spelled(self) -> str:
        if self.values is not None:
            body = ",".join(self.values)
            return "{" + (body if self.name.startswith("_") else f"{self.name}:{body}") + "}"
        return "{" + self.name + ("*" if self.multi else "") + "}"


@dataclass(frozen=True)
class Template:
    text: str
    #: literal text and variables, in order
    parts: tuple[str | Var, ...]

    @cached_property
    def variables(self) -> dict[str, Var]:
        return {p.name: p for p in self.parts if isinstance(p, Var)}

    @cached_property
    def regex(self) -> re.Pattern[str]:
        out = []
        for part in self.parts:
            if isinstance(part, str):
                out.append(re.escape(part))
            elif part.values is not None:
                out.append(f"(?P<{part.name}>" + "|".join(map(re.escape, part.values)) + ")")
            else:
                out.append(f"(?P<{part.name}>" + (r"[^.]+(?:\.[^.]+)*" if part.multi else r"[^.]+") + ")")
        return re.compile("".join(out))

    def match(self, key: str) -> dict[str, str] | None:
        m = self.regex.fullmatch(key)
        return None if m is None else m.groupdict()

    def expand(self, binding: dict[str, str]) -> str:
        return "".join(p if isinstance(p, str) else binding[p.name] for p in self.parts)

    def renamed(self, names: dict[str, str]) -> Template:
        """The template with variables renamed (the inverse pairs anonymous enumerations anew)."""
        parts = tuple(Var(names.get(p.name, p.name), p.values, p.multi) if isinstance(p, Var) else p
                      for p in self.parts)
        return Template("".join(p if isinstance(p, str) else p.spelled() for p in parts), parts)

    @property
    def literal(self) -> str | None:
        """The one key of a template without variables."""
        return None if self.variables else self.text


def parse_template(text: str, anonymous_start: int = 0) -> Template:
    """Parse a template; anonymous enumerations are named ``_0``, ``_1``... from ``anonymous_start``."""
    parts: list[str | Var] = []
    pos = 0
    seen: set[str] = set()
    anonymous = anonymous_start
    for m in _PART.finditer(text):
        if m.start() > pos:
            parts.append(text[pos:m.start()])
        body = m.group(1)
        var = _var(body, m.start(), text, anonymous)
        if var.name.startswith("_"):
            anonymous += 1
        if var.name in seen:
            raise TemplateError(f"variable {{{var.name}}} appears twice in {text!r}; name each part once",
                                m.start())
        seen.add(var.name)
        if parts and isinstance(parts[-1], Var):
            raise TemplateError(f"{m.group(0)!r} follows another variable directly in {text!r}; put literal "
                                "text between them so that a key splits one way only", m.start())
        parts.append(var)
        pos = m.end()
    rest = text[pos:]
    for bad in ("{", "}"):
        if bad in rest:
            raise TemplateError(f"unbalanced {bad!r} in {text!r}", pos + rest.index(bad))
    if rest:
        parts.append(rest)
    return Template(text, tuple(parts))


def _var(body: str, col: int, text: str, anonymous: int) -> Var:
    if "," in body and ":" not in body:
        return Var(f"_{anonymous}", _values(body, col, text))
    name, sep, values = body.partition(":")
    multi = name.endswith("*") and not sep
    name = name.removesuffix("*") if multi else name
    if not _NAME.match(name) or name.startswith("_"):
        raise TemplateError(f"{{{body}}} in {text!r}: a variable is named by a letter and letters, digits "
                            "or '_' ({L}, {E}, {X*}, {P:w1,w3})", col)
    return Var(name, _values(values, col, text) if sep else None, multi)


def _values(body: str, col: int, text: str) -> tuple[str, ...]:
    values = tuple(v.strip() for v in body.split(","))
    if any(not _LITERAL.match(v) for v in values) or len(set(values)) != len(values):
        raise TemplateError(f"{{{body}}} in {text!r}: list distinct literal names separated by commas "
                            "({q,k,v})", col)
    return values


def natural_key(value: str) -> tuple[int, int | str]:
    """Sort key putting '10' after '9' (experts, layers), names after numbers."""
    return (0, int(value)) if is_index(value) else (1, value)


def is_index(value: str) -> bool:
    """ASCII digits only (digits.py): '²' and '٣' name no index."""
    return is_ascii_digits(value)


def expand_from(target: Template, source: Template, binding: dict[str, str]) -> str:
    """``target`` expanded with a match of ``source``: a variable both enumerate takes the
    value at the same position (``{P:w1,w3}`` -> ``{P:gate,up}``: w3 becomes up)."""
    values = dict(binding)
    for name, var in target.variables.items():
        mine = source.variables.get(name)
        if var.values is not None and mine is not None and mine.values is not None and name in values:
            values[name] = var.values[mine.values.index(values[name])]
    return target.expand(values)
