"""Build the output ``config.json`` from a rule file's ``config`` section.

Start from a source's config (``from``), keep/rename/delete fields, then ``set`` values
(``delete`` applies to what ``set`` wrote as well: ``transformer_layer_config:
${source.model.config}`` less the fields a consumer does not want there), where a string ``${...}`` is a reference resolved here, so no dimension is hard-coded
and the same rule serves real checkpoints and small stand-ins. ``${config.PATH ?? JSON}``
falls back to the JSON value when the source's config has no PATH (a flag whose default
differs between the tools that read the source and the output: write it explicitly).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

from ...errors import PlanError
from ...rules.model import RuleSet
from ...sources.base import Checkpoint
from ...vocab.maps import VocabMap
from .references import MISSING as _MISSING
from .references import References
from .references import get_path as _get


def build_config(rules: RuleSet, ckpts: Mapping[str, Checkpoint], vocab: Mapping[str, VocabMap]) -> dict[str, Any]:
    spec = rules.config
    assert spec is not None
    base: dict[str, Any] = {}
    if spec.from_source is not None:
        found = ckpts[spec.from_source].config(rules.sources[spec.from_source].config_file)
        if found is None:
            raise PlanError(f"config.from ({spec.where.short}): source {spec.from_source!r} "
                            f"({ckpts[spec.from_source].location}) has no "
                            f"{rules.sources[spec.from_source].config_file}; "
                            "add one to the source or drop config.from", source=spec.from_source)
        base = found if spec.root is None else _subtree(found, spec, rules.sources[spec.from_source].config_file)
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

    label = (f"the config of source {spec.from_source!r}" + (f" at {spec.root!r}" if spec.root else "")
             if spec.from_source is not None
             else "the output config (config.from is not set)")
    refs = References(rules, ckpts, vocab, base, label)

    def resolve(value: Any, where: str) -> Any:
        if isinstance(value, dict):
            return {k: resolve(v, f"{where}.{k}") for k, v in value.items()}
        if isinstance(value, list):
            return [resolve(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return refs.evaluate(value, where)

    for path, value, where in spec.set:
        _set(out, path, resolve(value, f"config.set.{path} ({where.short})"))
    for path in spec.delete:  # again: from a whole config `set` under a key, too
        _delete(out, path)
    if rules.output.dtype is not None:
        _say_dtype(out, rules.output.dtype)
    _refuse_non_finite(out, spec.where.short, rules.output.config_file)
    return out


def _refuse_non_finite(config: dict[str, Any], where: str, name: str) -> None:
    """A NaN or infinity (a source's metadata, a pickled argument) is refused here, at plan
    time naming its field: json.dumps would fail at commit, after the weights are written."""
    stack: list[tuple[str, Any]] = [("", config)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise PlanError(f"config ({where}): the written {name} would hold {value} at {path!r}, which JSON "
                            "cannot hold; fix it in the source, or set the field in the rule's config section")
        if isinstance(value, dict):
            stack += [(f"{path}.{k}" if path else str(k), v) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(f"{path}[{i}]", v) for i, v in enumerate(value)]


def _subtree(found: dict[str, Any], spec: Any, config_file: str) -> dict[str, Any]:
    """``config.root``: the mapping at that dotted path of the source's config; absent or not
    a mapping is a plan error naming the fields there are (a rule for a VLM on a text model)."""
    value = _get(found, spec.root)
    if isinstance(value, dict):
        return value
    parent_path, _, _ = spec.root.rpartition(".")
    parent = _get(found, parent_path) if parent_path else found
    fields = sorted(k for k, v in parent.items() if isinstance(v, dict)) if isinstance(parent, dict) else []
    what = "is absent" if value is _MISSING else f"is {type(value).__name__}, not a mapping"
    hint = (f"; its mappings there: {', '.join(repr(f) for f in fields[:10])}" if fields
            else "; this source's config has no sub-configs: is it the model the rule is for?")
    raise PlanError(f"config.root ({(spec.root_where or spec.where).short}): {spec.root!r} of {config_file} of source "
                    f"{spec.from_source!r} {what}{hint}", source=spec.from_source)


#: the fields transformers reads a checkpoint's dtype from (``dtype`` since 5.0)
_DTYPE_FIELDS = ("torch_dtype", "dtype")


def _say_dtype(out: dict[str, Any], dtype: str) -> None:
    """``output.dtype`` is what the floating tensors are: the config's dtype fields say it,
    at the top and in every sub-config (``text_config``, ...) that has one, whatever the
    source's config or ``config.set`` held (a variant changing output.dtype changes them)."""
    for field in _DTYPE_FIELDS:
        out[field] = dtype
    for value in out.values():
        if isinstance(value, dict):
            for field in _DTYPE_FIELDS:
                if field in value:
                    value[field] = dtype


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
