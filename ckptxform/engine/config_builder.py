"""Build the output ``config.json`` from a rule file's ``config`` section.

Start from a source's config (``from``), keep/rename/delete fields, then ``set`` values,
where a string ``${...}`` is a reference resolved here, so no dimension is hard-coded
and the same rule serves real checkpoints and small stand-ins. ``${config.PATH ?? JSON}``
falls back to the JSON value when the source's config has no PATH (a flag whose default
differs between the tools that read the source and the output: write it explicitly).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from typing import Any

from ..errors import PlanError
from ..rules.model import RuleSet
from ..sources.base import Checkpoint
from ..sources.resolve import hub_location
from ..vocab import VocabMap

_REF = re.compile(r"^\$\{([^}]*)\}$")
_MISSING = object()


def build_config(rules: RuleSet, ckpts: Mapping[str, Checkpoint], vocab: Mapping[str, VocabMap]) -> dict[str, Any]:
    spec = rules.config
    assert spec is not None
    base: dict[str, Any] = {}
    if spec.from_source is not None:
        found = ckpts[spec.from_source].config()
        if found is None:
            raise PlanError(f"config.from ({spec.where.short}): source {spec.from_source!r} "
                            f"({ckpts[spec.from_source].location}) has no config.json; "
                            "add one to the source or drop config.from", source=spec.from_source)
        base = found
    if spec.keep is None:
        out = copy.deepcopy(base)
    else:
        out = {}
        for path in spec.keep:
            value = _get(base, path)
            if value is not _MISSING:
                _set(out, path, copy.deepcopy(value))
    for old, new in spec.rename:
        value = _get(out, old)
        if value is not _MISSING:
            _delete(out, old)
            _set(out, new, value)
    for path in spec.delete:
        _delete(out, path)

    def resolve(value: Any, where: str) -> Any:
        if isinstance(value, dict):
            return {k: resolve(v, f"{where}.{k}") for k, v in value.items()}
        if isinstance(value, list):
            return [resolve(v, f"{where}[{i}]") for i, v in enumerate(value)]
        match = _REF.match(value) if isinstance(value, str) else None
        return _reference(match.group(1), where, rules, ckpts, vocab, base) if match else value

    for path, value, where in spec.set:
        _set(out, path, resolve(value, f"config.set.{path} ({where.short})"))
    return out


def _reference(ref: str, where: str, rules: RuleSet, ckpts: Mapping[str, Checkpoint],
               vocab: Mapping[str, VocabMap], base: dict[str, Any]) -> Any:
    head, _, rest = ref.partition(".")
    if head == "config":
        rest, has_default, default = rest.partition(" ?? ")
        value = _get(base, rest)
        if value is _MISSING and has_default:
            return json.loads(default)  # the loader checked that it is JSON
        if value is _MISSING:
            raise PlanError(f"{where}: ${{{ref}}}: the config of source {rules.config.from_source!r} "  # type: ignore[union-attr]
                            f"has no field {rest!r}; set the value explicitly in the rule file")
        return copy.deepcopy(value)
    if head == "vocab":
        name, _, attr = rest.partition(".")
        return vocab[name].draft_size if attr == "draft_size" else vocab[name].vocab_size
    if head == "source":
        name, _, attr = rest.partition(".")
        spec = rules.sources[name]
        if attr == "repo":
            # A Hub override names the repo actually read; a local override (a mirror,
            # a stand-in) keeps the rule file's repo, which is what consumers resolve.
            hub = hub_location(spec.override) if spec.override is not None else None
            return hub[0] if hub is not None else (spec.repo or spec.location)
        if attr == "revision":
            ckpt = ckpts.get(name)
            return (ckpt.commit if ckpt else None) or spec.revision
        return spec.location
    if ref == "output.dtype":
        return rules.output.dtype
    raise PlanError(f"{where}: unknown reference ${{{ref}}}")


def _get(obj: dict[str, Any], path: str) -> Any:
    cur: Any = obj
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return _MISSING
        cur = cur[part]
    return cur


def _set(obj: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    cur = obj
    for part in parents:
        nxt = cur.get(part)
        if not isinstance(nxt, dict):
            nxt = cur[part] = {}
        cur = nxt
    cur[last] = value


def _delete(obj: dict[str, Any], path: str) -> None:
    *parents, last = path.split(".")
    cur: Any = obj
    for part in parents:
        cur = cur.get(part) if isinstance(cur, dict) else None
    if isinstance(cur, dict):
        cur.pop(last, None)
