"""Validate rule data against schemas/rules.schema.json and word the errors for people.

jsonschema's own messages ("Additional properties are not allowed ('x' was unexpected)")
say neither where nor what to do. Each error becomes ``FILE:LINE:COL: PATH: message``,
placed at the offending key or value, with a did-you-mean for unknown keys and one
message per failed one-of instead of one per branch.
"""

from __future__ import annotations

import copy
import difflib
import json
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from .._data import data_dir
from . import validity_cache
from .yaml_source import YamlDocument

if TYPE_CHECKING:  # jsonschema is imported only when a document must be checked
    import jsonschema
    from jsonschema.exceptions import ValidationError

_YAML_TYPES = {
    dict: "a mapping",
    list: "a list",
    str: "a string",
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    type(None): "null",
}
_SCHEMA_TYPES = {
    "object": "a mapping",
    "array": "a list",
    "string": "a string",
    "boolean": "a boolean",
    "integer": "an integer",
    "number": "a number",
    "null": "null",
}


@lru_cache(maxsize=1)
def _schema_text() -> str:
    return (data_dir("schemas") / "rules.schema.json").read_text("utf-8")


@lru_cache(maxsize=1)
def rules_schema() -> dict[str, Any]:
    """The rule-language schema shipped with the package."""
    schema: dict[str, Any] = json.loads(_schema_text())
    return schema


@lru_cache(maxsize=8)
def _validator(plugin_verbs: tuple[str, ...] = ()) -> jsonschema.Draft202012Validator:
    """The rules schema's validator; with the fragments of the plug-in ops ``plugin_verbs``
    among the verbs of ``ops:`` when a document uses some."""
    import jsonschema

    schema = rules_schema()
    if plugin_verbs:
        from ..ops import OPS, op_schema

        schema = copy.deepcopy(schema)
        schema["$defs"]["op"]["properties"].update({v: op_schema(OPS[v]) for v in plugin_verbs})
    return jsonschema.Draft202012Validator(schema)


def _plugin_verbs(data: Any) -> tuple[str, ...]:
    """The verbs of ``data``'s ``ops:`` chains that no built-in op has but an installed
    plug-in does (plug-ins are looked up only when such a verb is written)."""
    from ..ops import OPS

    rules = data.get("tensors") if isinstance(data, dict) else None
    written = {verb for rule in (rules if isinstance(rules, list) else ())
               if isinstance(rule, dict) and isinstance(rule.get("ops"), list)
               for item in rule["ops"] if isinstance(item, dict) for verb in item if isinstance(verb, str)}
    unknown = written - set(OPS.builtins)
    return tuple(sorted(unknown & set(OPS.plugins()))) if unknown else ()


def plain(name: str) -> str:
    """``name`` as written when it is a plain word, else quoted (so a message stays one line)."""
    return name if name and name.isprintable() and not any(c.isspace() for c in name) else repr(name)


def format_path(path: tuple[str | int, ...] | list[str | int]) -> str:
    """``('tensors', 2, 'permute_rows', 'from')`` -> ``tensors[2].permute_rows.from``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{plain(part)}" if out else plain(part))
    return out or "(top level)"


def schema_problems(doc: YamlDocument) -> list[tuple[tuple[int, int], str]]:
    """Every schema violation of ``doc`` as ``((line, col), message)``, in file order."""
    plugins = _plugin_verbs(doc.data)
    # a plug-in can change without the rule file: its documents are checked every time
    key = validity_cache.document_key(_schema_text(), doc.data) if not plugins else None
    if key is not None and validity_cache.known_valid(key):
        return []
    found: dict[str, tuple[int, int]] = {}
    errors = list(_validator(plugins).iter_errors(doc.data))
    if not errors:
        if key is not None:
            validity_cache.remember_valid(key)
        return []
    # An unknown key (a typo of 'source') also makes every one-of form fail; the
    # did-you-mean says it all, a second message listing the forms would be noise.
    unknown_at = {tuple(e.absolute_path) for e in errors if e.validator == "additionalProperties"}
    for error in errors:
        if error.validator in ("oneOf", "anyOf") and tuple(error.absolute_path) in unknown_at:
            continue
        for path, key, message in _explain(error, doc.data):
            where = doc.where(path, key=key)
            line = f"{where}: {format_path(path)}: {message}"
            found.setdefault(line, (where.line, where.col))
    return sorted(((pos, msg) for msg, pos in found.items()), key=lambda item: item[0])


def _type_name(value: Any) -> str:
    return _YAML_TYPES.get(type(value), type(value).__name__)


def _schema_at(schema_path: Any) -> Any:
    """The part of the rules schema at a jsonschema error's schema path (None if not found)."""

    def resolve(ref: str) -> Any:  # the schema has local refs only: "#/$defs/x"
        target: Any = rules_schema()
        for name in ref.removeprefix("#/").split("/"):
            target = target[name]
        return target

    node: Any = rules_schema()
    try:
        for part in schema_path:
            # jsonschema's schema paths step over a "$ref" without naming it
            while isinstance(node, dict) and part not in node and "$ref" in node:
                node = resolve(node["$ref"])
            node = resolve(node["$ref"]) if part == "$ref" else node[part]
    except (KeyError, IndexError, TypeError):
        return None
    return node


def _value_at(root: Any, path: tuple[str | int, ...]) -> Any:
    for part in path:
        root = root[part]
    return root


def _explain(error: ValidationError, root: Any) -> list[tuple[tuple[str | int, ...], bool, str]]:
    """(path, points-at-key, message) for one jsonschema error; ``root`` is the whole document."""
    path = tuple(error.absolute_path)
    value = error.instance
    kind = error.validator
    schema_path = list(error.relative_schema_path)

    if "dependentSchemas" in schema_path:
        trigger = schema_path[schema_path.index("dependentSchemas") + 1]
        if kind == "required":
            needed = error.validator_value
            return [(path + (trigger,), True, f"{trigger!r} needs {', '.join(map(repr, needed))}")]
        # jsonschema reports a `false` property schema at the object, with the property's
        # value as instance and without its name; so the banned keys come from the schema
        # and the offending ones from the document.
        spot = _schema_at(error.absolute_schema_path)
        if spot is False and path:  # a jsonschema that does name the property
            return [(path, True, f"{path[-1]!r} cannot be combined with {trigger!r}")]
        banned = spot if isinstance(spot, dict) else {}
        obj = _value_at(root, path)
        conflicts = [k for k in obj if banned.get(k) is False] if isinstance(obj, dict) else []
        return [(path + (k,), True, f"{k!r} cannot be combined with {trigger!r}") for k in conflicts] or [
            (path, False, f"conflicts with {trigger!r}")
        ]
    if kind == "additionalProperties" and isinstance(value, dict):
        allowed = sorted(error.schema.get("properties", {}))
        extra = [k for k in value if k not in allowed]
        out = []
        for key in extra:
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f" (allowed: {', '.join(allowed)})"
            if not allowed:
                hint = ""
            out.append((path + (key,), True, f"unknown key {key!r}{hint}"))
        return out
    if kind == "required":
        missing = [k for k in error.validator_value if isinstance(value, dict) and k not in value]
        return [(path, False, f"missing required key {k!r}") for k in missing]
    if kind == "type":
        expected = error.validator_value
        names = [_SCHEMA_TYPES.get(t, t) for t in ([expected] if isinstance(expected, str) else expected)]
        return [(path, False, f"expected {' or '.join(names)}, got {_got(value)}")]
    if kind == "enum":
        options = ", ".join(repr(v) for v in error.validator_value)
        return [(path, False, f"{_short(value)} is not one of {options}")]
    if kind == "const":
        return [(path, False, f"expected {error.validator_value!r}, got {_short(value)}")]
    if kind == "pattern":
        return [(path, False, f"{_short(value)} is not of the form {error.validator_value}")]
    if kind == "minLength":
        return [(path, False, "must not be empty")]
    if kind in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        sign = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">", "exclusiveMaximum": "<"}[kind]
        return [(path, False, f"must be {sign} {error.validator_value}, got {_short(value)}")]
    if kind in ("oneOf", "anyOf"):
        return _explain_one_of(error, path, value, root)
    if kind == "propertyNames":
        return [(path, False, error.message)]
    return [(path, False, error.message)]


def _explain_one_of(
    error: ValidationError, path: tuple[str | int, ...], value: Any, root: Any
) -> list[tuple[tuple[str | int, ...], bool, str]]:
    branches = error.validator_value
    # A branch that failed only below this node (a typo inside it) is the one the user meant.
    deeper = [e for e in error.context or [] if len(e.absolute_path) > len(path)]
    if deeper and isinstance(value, dict):
        best = max(deeper, key=lambda e: len(e.absolute_path))
        return _explain(best, root)
    # A branch whose type fits (a string that misses the pattern) explains itself best.
    by_branch: dict[int, list[ValidationError]] = {}
    for sub in error.context or []:
        by_branch.setdefault(int(sub.relative_schema_path[0]), []).append(sub)
    fitting = [errs for errs in by_branch.values() if not any(e.validator == "type" for e in errs)]
    if len(fitting) == 1 and not isinstance(value, dict):
        return [item for sub in fitting[0] for item in _explain(sub, root)]
    # The one form that knows every key given is the one meant ({rows_of} lacks 'tensor').
    if isinstance(value, dict) and value:
        meant = [i for i, b in enumerate(branches) if set(value) <= set(b.get("properties", ()))]
        if len(meant) == 1 and by_branch.get(meant[0]):
            return [item for sub in by_branch[meant[0]] for item in _explain(sub, root)]
    forms = []
    for branch in branches:
        if "required" in branch:
            forms.append("{" + ", ".join(branch["required"]) + "}")
        elif "type" in branch:
            forms.append(_SCHEMA_TYPES.get(branch["type"], branch["type"]))
    if not isinstance(value, dict) and all("required" in b for b in branches):
        return [(path, False, f"expected a mapping with keys {' or '.join(forms)}, got {_got(value)}")]
    if error.validator == "oneOf" and isinstance(value, dict):
        matching = [b for b in branches if all(k in value for k in b.get("required", []))]
        if len(matching) > 1:
            return [(path, False, f"give exactly one of the forms {' or '.join(forms)}, not several")]
    return [(path, False, f"expected one of the forms {' or '.join(forms)}, got {_short(value)}")]


def _got(value: Any) -> str:
    """What was given: its type and value, or the value alone when that says its type
    (``null``, ``true``: not ``null null``)."""
    if value is None or isinstance(value, bool):
        return _short(value)
    return f"{_type_name(value)} {_short(value)}"


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
