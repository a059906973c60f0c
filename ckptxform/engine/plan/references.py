"""Resolve the references of ``${...}`` expressions (rules/expr.py) against opened sources.

One resolver serves the planner (op arguments: ``config`` is the converted source's
config) and the config builder (``config.set``: ``config`` is the config it starts from).
"""

from __future__ import annotations

import copy
import re
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...errors import PlanError
from ...ops.base import Context
from ...ops.shards import split_dim
from ...rules.expr import ExpressionError, Ref, parse_expression
from ...rules.model import RuleSet
from ...rules.templates import parse_template
from ...sources.base import Checkpoint
from ...sources.resolve import hub_location
from ...vocab.maps import VocabMap

MISSING = object()
_VARIABLE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
#: the keys whose whole shape is being worked out (concat_shards arguments reading their own)
_WHOLE_SHAPES_BEING_READ: set[str] = set()


class _AbsentField(PlanError):
    """A ``${config.PATH}`` whose field the config lacks (an expression's ``?? default`` catches it)."""


@dataclass(frozen=True)
class References:
    rules: RuleSet
    ckpts: Mapping[str, Checkpoint]
    vocab: Mapping[str, VocabMap]
    #: the config that ${config.PATH} reads, and how messages name it
    config: dict[str, Any] | None
    config_label: str
    #: template variables bound where the expression stands (``shape.model.layers.{L}.w[0]``)
    binding: Mapping[str, str] = field(default_factory=dict)

    def evaluate(self, value: Any, where: str) -> Any:
        """``value`` with a ``${...}`` evaluated (other values as they are)."""
        if not isinstance(value, str) or not value.startswith("${"):
            return value
        expression = parse_expression(value)

        def resolve(ref: Ref) -> Any:
            return self.resolve(ref, where, value)
        try:
            try:
                return expression.evaluate(resolve)
            except _AbsentField:
                if expression.has_default:
                    return expression.evaluate_default(resolve)
                raise
        except ExpressionError as err:
            raise PlanError(f"{where}: {err}") from None

    def integer(self, value: Any, where: str) -> int:
        result = self.evaluate(value, where)
        if isinstance(result, bool) or not isinstance(result, int):
            raise PlanError(f"{where}: {value!r} is {result!r}, not an integer")
        return result

    def number(self, value: Any, where: str) -> int | float:
        """``value`` (a number or a ``${...}``) as a finite number."""
        result = self.evaluate(value, where)
        if isinstance(result, bool) or not isinstance(result, (int, float)) or not math.isfinite(result):
            raise PlanError(f"{where}: {value!r} is {result!r}, not a finite number")
        return result

    def resolve(self, ref: Ref, where: str, text: str) -> Any:
        if ref.kind in ("config", "source") and any("{" in part for part in ref.path):
            ref = Ref(ref.kind, self._bound_path(ref.path, where, text), ref.dim)
        if ref.kind == "config":
            value = get_path(self.config or {}, ".".join(ref.path))
            if value is MISSING:
                raise _AbsentField(f"{where}: {text}: {self.config_label} has no field {'.'.join(ref.path)!r}; "
                                   "add it there, or write the value in the rule file")
            return copy.deepcopy(value)
        if ref.kind == "shape":
            return self._shape(ref, where, text)
        if ref.kind == "vocab":
            name, attr = ref.path
            return self.vocab[name].draft_size if attr == "draft_size" else self.vocab[name].vocab_size
        if ref.kind == "source" and ref.path[1] == "config":
            return self._source_config(ref.path[0], ".".join(ref.path[2:]), where, text)
        if ref.kind == "source":
            return self._source(*ref.path)
        return self.rules.output.dtype

    def _bound_path(self, path: tuple[str, ...], where: str, text: str) -> tuple[str, ...]:
        """A config path with its ``{VAR}`` parts replaced by the rule's binding (a variable
        binding dotted names, ``{X*}``, makes several parts): ``lora_scaling.{X}``."""
        out: list[str] = []
        for part in path:
            try:
                out.extend(_VARIABLE.sub(lambda m: self.binding[m.group(1)], part).split("."))
            except KeyError as err:
                raise PlanError(f"{where}: {text}: {{{err.args[0]}}} is not a variable this rule binds") from None
        return tuple(out)

    def _shape(self, ref: Ref, where: str, text: str) -> int:
        source = self.rules.convert
        assert source is not None and ref.dim is not None
        ckpt = self.ckpts[source]
        try:
            key = parse_template(ref.path[0]).expand(dict(self.binding))
        except (KeyError, ValueError):
            raise PlanError(f"{where}: {text}: {ref.path[0]!r} names a variable this rule does not bind") from None
        info = ckpt.tensors.get(key)
        if info is None:
            raise PlanError(f"{where}: {text}: source {source!r} ({ckpt.location}) has no tensor {key!r}", key=key)
        shape = self._whole_shape(ckpt, key, info.shape)
        if ref.dim >= len(shape):
            raise PlanError(f"{where}: {text}: {key!r} has shape {list(shape)}, no dim {ref.dim}", key=key)
        return shape[ref.dim]

    def _whole_shape(self, ckpt: Checkpoint, key: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of tensor ``key`` of the converted source: on a model-parallel source, of
        its pieces concatenated as the rule reading it concatenates them (concat_shards)."""
        count = len(ckpt.shard_tensors(key))
        rule = next((r for r in self.rules.tensors if r.pattern.fullmatch(key)), None)
        if count == 1 or rule is None or not rule.ops or rule.ops[0].verb != "concat_shards":
            return shape
        step = rule.ops[0]
        assert self.rules.convert is not None
        source = self.rules.convert
        own = References(self.rules, self.ckpts, self.vocab, ckpt.config(self.rules.sources[source].config_file),
                         f"the {self.rules.sources[source].config_file} of source {source!r} ({ckpt.location})")
        ctx = _OpContext(f"tensors[{rule.index}].ops[0] concat_shards ({step.where.short})", own)
        if key in _WHOLE_SHAPES_BEING_READ:
            raise ctx.error(f"its arguments read the shape of {key!r}, the tensor it makes; write them from the "
                            "config", key=key)
        _WHOLE_SHAPES_BEING_READ.add(key)
        try:
            dim, _ = split_dim(step.args, ctx.integer, shape, count, ctx)
        finally:
            _WHOLE_SHAPES_BEING_READ.discard(key)
        return (*shape[:dim], shape[dim] * count, *shape[dim + 1:])

    def _source_config(self, name: str, path: str, where: str, text: str) -> Any:
        """A field of source ``name``'s config file (the planner opened the source)."""
        spec = self.rules.sources[name]
        if spec.unread:
            raise _AbsentField(f"{where}: {text}: source {name!r} is read only when given; pass --source "
                               f"{name}=LOCATION, or write a default after ' ?? '", source=name)
        ckpt = self.ckpts[name]
        found = ckpt.config(spec.config_file)
        if not path and found is not None:  # ${source.NAME.config}: all of it
            return copy.deepcopy(found)
        value = get_path(found or {}, path) if path else MISSING
        if value is MISSING:
            raise _AbsentField(f"{where}: {text}: the {spec.config_file} of source {name!r} ({ckpt.location}) has "
                               f"no field {path!r}; add it there, or write the value in the rule file" if path else
                               f"{where}: {text}: source {name!r} ({ckpt.location}) has no {spec.config_file}; add one",
                               source=name)
        return copy.deepcopy(value)

    def _source(self, name: str, attr: str) -> Any:
        spec = self.rules.sources[name]
        if attr == "repo":
            # What the user gave: a Hub override's repo id, a local override's path as given
            # (a consumer offline resolves that, not the rule's default repo); its commit is
            # in the audit's sources.
            if spec.override is not None:
                hub = hub_location(spec.override)
                return hub[0] if hub is not None else spec.override
            return spec.repo or spec.location
        if attr == "revision":
            ckpt = self.ckpts.get(name)
            return (ckpt.commit if ckpt else None) or spec.revision
        return spec.location


def get_path(obj: dict[str, Any], path: str) -> Any:
    cur: Any = obj
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return MISSING
        cur = cur[part]
    return cur


class _OpContext(Context):
    """An op's arguments resolved outside its chain (a shape a config expression reads)."""

    def __init__(self, label: str, refs: References) -> None:
        self.label, self._refs = label, refs

    def integer(self, value: Any, what: str) -> int:
        return self._refs.integer(value, f"{self.label}: {what}")
