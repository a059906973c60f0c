"""Validate rule data against schemas/rules.schema.json and word the errors for people.

jsonschema's own messages ("Additional properties are not allowed ('x' was unexpected)")
say neither where nor what to do. Each error becomes ``FILE:LINE:COL: PATH: message``,
placed at the offending key or value, with a did-you-mean for unknown keys and one
message per failed one-of instead of one per branch.
"""

from __future__ import annotations

import difflib
import json
from functools import lru_cache
from typing import Any

import jsonschema
from jsonschema.exceptions import ValidationError

from .._data import data_dir
from .yaml_source import YamlDocument

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
def rules_schema() -> dict[str, Any]:
    """The rule-language schema shipped with the package."""
    text = (data_dir("schemas") / "rules.schema.json").read_text("utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


@lru_cache(maxsize=1)
def _validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(rules_schema())


def format_path(path: tuple[str | int, ...] | list[str | int]) -> str:
    """``('tensors', 2, 'permute_rows', 'from')`` -> ``tensors[2].permute_rows.from``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def schema_problems(doc: YamlDocument) -> list[tuple[tuple[int, int], str]]:
    """Every schema violation of ``doc`` as ``((line, col), message)``, in file order."""
    found: dict[str, tuple[int, int]] = {}
    for error in _validator().iter_errors(doc.data):
        for path, key, message in _explain(error):
            where = doc.where(path, key=key)
            line = f"{where}: {format_path(path)}: {message}"
            found.setdefault(line, (where.line, where.col))
    return sorted(((pos, msg) for msg, pos in found.items()), key=lambda item: item[0])


def _type_name(value: Any) -> str:
    return _YAML_TYPES.get(type(value), type(value).__name__)


def _explain(error: ValidationError) -> list[tuple[tuple[str | int, ...], bool, str]]:
    """(path, points-at-key, message) for one jsonschema error."""
    path = tuple(error.absolute_path)
    value = error.instance
    kind = error.validator
    schema_path = list(error.relative_schema_path)

    if "dependentSchemas" in schema_path:
        trigger = schema_path[schema_path.index("dependentSchemas") + 1]
        if kind == "required":
            needed = error.validator_value
            return [(path + (trigger,), True, f"{trigger!r} needs {', '.join(map(repr, needed))}")]
        banned = error.schema.get("properties", {}) if isinstance(error.schema, dict) else {}
        conflicts = [k for k in value if banned.get(k) is False] if isinstance(value, dict) else []
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
        return [(path, False, f"expected {' or '.join(names)}, got {_type_name(value)} {_short(value)}")]
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
        return _explain_one_of(error, path, value)
    if kind == "propertyNames":
        return [(path, False, error.message)]
    return [(path, False, error.message)]


def _explain_one_of(
    error: ValidationError, path: tuple[str | int, ...], value: Any
) -> list[tuple[tuple[str | int, ...], bool, str]]:
    branches = error.validator_value
    # A branch that failed only below this node (a typo inside it) is the one the user meant.
    deeper = [e for e in error.context or [] if len(e.absolute_path) > len(path)]
    if deeper and isinstance(value, dict):
        best = max(deeper, key=lambda e: len(e.absolute_path))
        return _explain(best)
    # A branch whose type fits (a string that misses the pattern) explains itself best.
    by_branch: dict[int, list[ValidationError]] = {}
    for sub in error.context or []:
        by_branch.setdefault(int(sub.relative_schema_path[0]), []).append(sub)
    fitting = [errs for errs in by_branch.values() if not any(e.validator == "type" for e in errs)]
    if len(fitting) == 1 and not isinstance(value, dict):
        return [item for sub in fitting[0] for item in _explain(sub)]
    forms = []
    for branch in branches:
        if "required" in branch:
            forms.append("{" + ", ".join(branch["required"]) + "}")
        elif "type" in branch:
            forms.append(_SCHEMA_TYPES.get(branch["type"], branch["type"]))
    if not isinstance(value, dict) and all("required" in b for b in branches):
        return [(path, False, f"expected a mapping with keys {' or '.join(forms)}, got {_type_name(value)} {_short(value)}")]
    if error.validator == "oneOf" and isinstance(value, dict):
        matching = [b for b in branches if all(k in value for k in b.get("required", []))]
        if len(matching) > 1:
            return [(path, False, f"give exactly one of the forms {' or '.join(forms)}, not several")]
    return [(path, False, f"expected one of the forms {' or '.join(forms)}, got {_short(value)}")]


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
