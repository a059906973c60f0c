"""Does an inverse give every key back to the forward rule that wrote it?

The forward renames ``a\\.(w.*)`` -> ``x.\\1`` and keeps the rest: from a source holding
``x.wide`` it writes ``x.wide`` unchanged, and the inverse ``x\\.(w.*)`` -> ``a.\\1`` would
rename it to ``a.wide``. Such an inverse is not one-to-one over the keys the forward can
write, and ``invert`` refuses it naming the key. The keys tried are witnesses of every
pattern of both rule sets (each key pattern spelled out with short segments, every
alternative and optional part taken and left out), put through the forward and then the
inverse as the planner does: the first rule whose pattern matches claims a key.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from ..errors import UsageError, quote
from ..filenames import AUDIT_FILE
from .model import RuleSet, TensorRule
from .templates import Template, expand_from

try:  # Python >= 3.11
    import re._parser as _sre  # type: ignore[import-not-found]
    from re._constants import MAXREPEAT  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover
    import sre_parse as _sre  # type: ignore[no-redef]
    from sre_constants import MAXREPEAT  # type: ignore[no-redef]

#: witnesses kept per pattern: enough for every alternative of a shipped rule's pattern
_WITNESSES = 64
_FILLER = "wx0"  # tried in turn for "any character but ..."


def collisions(forward: RuleSet, inverse: RuleSet,
               written: Iterable[tuple[str, Sequence[str]]] | None = None) -> list[str]:
    """One message per forward rule whose output the inverse does not give back. ``written``:
    (source key, the output keys the forward wrote from it) of a real run (the forward's
    output); None: every witness key of both rule sets, put through the forward."""
    problems: dict[int, str] = {}
    pairs = written if written is not None else _written(forward, _candidates(forward, inverse))
    for key, outs in pairs:
        writer = _first(forward.tensors, key)
        if writer is None or writer.index in problems:
            continue
        for out in outs:
            claim = _first(inverse.tensors, out)
            if claim is None or claim.tie is not None or _gives_back(claim, out, key):
                continue  # not taken (the inverse's plan says so), dropped as a checked copy, or given back
            back = _outputs(claim, out)
            problems[writer.index] = (
                f"{writer.where.short}: tensors[{writer.index}] writes {out!r} from the source key {key!r}, but the inverse's "
                f"tensors[{claim.index}] would turn {out!r} into {', '.join(map(repr, back)) or 'nothing'}: the "
                f"forward's renames are not one-to-one (its output does not say which rule wrote {out!r}); make "
                f"the rules' patterns disjoint (rename or skip keys like {key!r} explicitly), or give the "
                "forward's output (invert --over OUT) to check the keys it holds")
    return [problems[i] for i in sorted(problems)]


def written_into(out: str, source: str | None) -> list[tuple[str, list[str]]]:
    """(source key, output keys) of every tensor of ``source`` a run wrote into ``out``, from its audit."""
    audit = Path(out) / AUDIT_FILE
    try:
        lines = audit.read_text("utf-8").splitlines()
    except OSError as err:
        raise UsageError(f"invert --over {quote(out)}: cannot read {quote(str(audit))} ({err.strerror}); give "
                         "the OUT an apply of these rules wrote") from None
    written = []
    for line in lines:
        event = json.loads(line) if line.startswith("{") else {}
        target = event.get("target")
        if event.get("event") == "tensor" and event.get("source") == source and target:
            written.append((str(event["key"]), [target] if isinstance(target, str) else list(target)))
    if not written:
        raise UsageError(f"invert --over {quote(out)}: its audit records no tensor written from source "
                         f"{source!r}; give the OUT an apply of these rules wrote")
    return written


def _written(forward: RuleSet, keys: Iterable[str]) -> Iterator[tuple[str, list[str]]]:
    for key in keys:
        writer = _first(forward.tensors, key)
        if writer is not None and writer.skip is None and writer.tie is None:
            yield key, _outputs(writer, key)


def _candidates(forward: RuleSet, inverse: RuleSet) -> list[str]:
    keys: dict[str, None] = {}
    for rule in (*forward.tensors, *inverse.tensors):
        for key in itertools.islice(witnesses(rule.pattern.pattern), _WITNESSES):
            keys.setdefault(key)
    return list(keys)


def _first(rules: Sequence[TensorRule], key: str) -> TensorRule | None:
    return next((r for r in rules if r.pattern.fullmatch(key)), None)


def _gives_back(rule: TensorRule, out: str, key: str) -> bool:
    """``rule`` writes ``key`` from ``out`` (with a stack, among others)."""
    if rule.template is None:
        return rule.output_key(out) == key
    binding = rule.template.match(out)
    if binding is None:
        return False
    return any(_written_from(rule, to, binding).fullmatch(key) for to in rule.to)


def _written_from(rule: TensorRule, to: Template, binding: dict[str, str]) -> re.Pattern[str]:
    """The keys ``to`` writes under ``binding``: its bound variables spelled out (an
    enumeration's value paired by position), the others (a stack's member) any segment."""
    assert rule.template is not None
    parts = []
    for part in to.parts:
        if isinstance(part, str):
            parts.append(re.escape(part))
        elif part.name in binding:
            mine, value = rule.template.variables.get(part.name), binding[part.name]
            if mine is not None and mine.values is not None and part.values is not None:
                value = part.values[mine.values.index(value)]
            parts.append(re.escape(value))
        else:
            parts.append("[^.]+")
    return re.compile("".join(parts))


def _outputs(rule: TensorRule, key: str) -> list[str]:
    """The output keys ``rule`` writes from source ``key`` (a split writes several)."""
    if rule.template is None:
        out = rule.output_key(key)
        return [] if out is None else [out]
    binding = rule.template.match(key)
    if binding is None:
        return []
    keys = []
    for to in rule.to:
        free = [v for name, v in to.variables.items() if name not in binding]
        for values in itertools.product(*(v.values or ("0",) for v in free)):  # a stack's member: 0
            keys.append(expand_from(to, rule.template, {**binding, **{v.name: x for v, x in zip(free, values)}}))
    return keys


def witnesses(pattern: str) -> Iterator[str]:
    """Short strings ``pattern`` fully matches: every alternative, optional parts taken and not."""
    try:
        parsed = _sre.parse(pattern)
    except re.error:
        return
    compiled = re.compile(pattern)
    seen: set[str] = set()
    for text in itertools.islice(_sequence(list(parsed)), _WITNESSES * 4):
        if text not in seen and compiled.fullmatch(text):
            seen.add(text)
            yield text


def _sequence(items: list[tuple[object, object]]) -> Iterator[str]:
    if not items:
        yield ""
        return
    head, rest = items[0], items[1:]
    for first in itertools.islice(_item(*head), 8):
        for tail in itertools.islice(_sequence(rest), _WITNESSES):
            yield first + tail


def _item(op: object, arg: object) -> Iterator[str]:
    name = str(op)
    if name == "LITERAL":
        yield chr(arg)  # type: ignore[arg-type]
    elif name == "NOT_LITERAL":
        yield next(c for c in _FILLER if ord(c) != arg)
    elif name == "ANY":
        yield _FILLER[0]
    elif name == "IN":
        yield from _in(arg)  # type: ignore[arg-type]
    elif name == "SUBPATTERN":
        yield from _sequence(list(arg[-1]))  # type: ignore[index]
    elif name == "BRANCH":
        for alternative in arg[1]:  # type: ignore[index]
            yield from itertools.islice(_sequence(list(alternative)), 8)
    elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
        low, high, body = arg  # type: ignore[misc]
        for count in dict.fromkeys((low, low + 1)):
            if high == MAXREPEAT or count <= high:
                for parts in itertools.islice(itertools.product(*[list(itertools.islice(_sequence(list(body)), 4))]
                                                               * count), 8):
                    yield "".join(parts)
    elif name in ("AT", "ASSERT", "ASSERT_NOT"):
        yield ""
    # GROUPREF and the rest: no witness (the pattern is then tried through the other patterns only)


def _in(items: list[tuple[object, object]]) -> Iterator[str]:
    negate = any(str(op) == "NEGATE" for op, _ in items)
    if negate:
        class_text = re.compile("[^" + "".join(_class_text(op, arg) for op, arg in items if str(op) != "NEGATE") + "]")
        yield next((c for c in _FILLER if class_text.fullmatch(c)), "")
        return
    for op, arg in items:
        text = _class_text(op, arg)
        if text:
            yield {"\\d": "0", "\\w": "w", "\\s": " "}.get(text, text[0] if not text.startswith("\\") else text[1])
            return


def _class_text(op: object, arg: object) -> str:
    name = str(op)
    if name == "LITERAL":
        return re.escape(chr(arg))  # type: ignore[arg-type]
    if name == "RANGE":
        low, high = arg  # type: ignore[misc]
        return f"{re.escape(chr(low))}-{re.escape(chr(high))}"
    if name == "CATEGORY":
        return {"CATEGORY_DIGIT": "\\d", "CATEGORY_WORD": "\\w", "CATEGORY_SPACE": "\\s"}.get(str(arg), "")
    return ""
