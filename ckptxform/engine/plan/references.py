"""Resolve the references of ``${...}`` expressions (rules/expr.py) against opened sources.

One resolver serves the planner (op arguments: ``config`` is the converted source's
config) and the config builder (``config.set``: ``config`` is the config it starts from).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...errors import PlanError
from ...rules.expr import ExpressionError, Ref, parse_expression
from ...rules.model import RuleSet
from ...rules.templates import parse_template
from ...sources.base import Checkpoint
from ...sources.resolve import hub_location
from ...vocab import VocabMap

MISSING = object()


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
        try:
            return expression.evaluate(lambda ref: self.resolve(ref, where, value))
        except _AbsentField:
            if expression.has_default:
                return copy.deepcopy(expression.default)
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
        if ref.dim >= len(info.shape):
            raise PlanError(f"{where}: {text}: {key!r} has shape {list(info.shape)}, no dim {ref.dim}", key=key)
        return info.shape[ref.dim]

    def _source_config(self, name: str, path: str, where: str, text: str) -> Any:
        """A field of source ``name``'s config file (the planner opened the source)."""
        spec, ckpt = self.rules.sources[name], self.ckpts[name]
        value = get_path(ckpt.config(spec.config_file) or {}, path)
        if value is MISSING:
            raise _AbsentField(f"{where}: {text}: the {spec.config_file} of source {name!r} ({ckpt.location}) has "
                               f"no field {path!r}; add it there, or write the value in the rule file",
                               source=name)
        return copy.deepcopy(value)

    def _source(self, name: str, attr: str) -> Any:
        spec = self.rules.sources[name]
        if attr == "repo":
            # A Hub override names the repo actually read; a local override (a mirror,
            # a stand-in) keeps the rule file's repo, which is what consumers resolve.
            hub = hub_location(spec.override) if spec.override is not None else None
            return hub[0] if hub is not None else (spec.repo or spec.location)
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
