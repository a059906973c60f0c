"""Plan a ``key:`` rule: claim its source tensors into complete groups, run its op chain
on views (shapes checked, nothing read), and make one recipe per output.

A group is every tensor that agrees on the variables the chain keeps; a reduce op
(stack, concat) takes the members in order (an enumeration's listed order, else natural
index order) and a missing member is a plan error naming the key that is missing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import PlanError
from ..ops.base import Block, Context, Run, Step, Value, View
from ..rules.model import TensorRule
from ..rules.templates import Template, expand_from, natural_key
from ..sources.base import TensorInfo
from .recipes import BlockProgram, ByteProgram, CopyTensor, Recipe, TensorRef
from .references import References

Binding = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class PlannedOutput:
    """One output of a rule: its key, the recipe and the source tensors it reads."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    recipe: Recipe
    members: tuple[TensorInfo, ...]


class _StepContext(Context):
    def __init__(self, refs: References, label: str, binding: Binding) -> None:
        self.label = label
        self._refs = References(refs.rules, refs.ckpts, refs.vocab, refs.config, refs.config_label, dict(binding))

    def integer(self, value: Any, what: str) -> int:
        return self._refs.integer(value, f"{self.label}: {what}")

    def error(self, message: str, key: str | None = None) -> PlanError:
        return PlanError(f"{self.label}: {message}", key=key)


def plan_template_rule(rule: TensorRule, source: str, members: list[TensorInfo],
                       refs: References) -> list[PlannedOutput]:
    """The outputs of ``rule`` over the source tensors it matched, in key order."""
    key = rule.template
    assert key is not None
    items: list[tuple[Binding, Value]] = []
    for i, info in enumerate(members):
        binding = key.match(info.key)
        assert binding is not None
        items.append((tuple(sorted(binding.items())), View(info.shape, info.dtype, (Run(i, 0, info.nbytes),))))
    for index, step in enumerate(rule.ops):
        label = f"tensors[{rule.index}].ops[{index}] {step.verb} ({step.where.short})"
        items = _apply(step, items, refs, label, key, rule)
    out = []
    for binding, value in items:
        bound = dict(binding)
        for target in rule.to:
            out_key = expand_from(target, key, bound)
            out.append(_output(out_key, value, source, members, rule))
    return sorted(out, key=lambda o: o.key)


def _apply(step: Step, items: list[tuple[Binding, Value]], refs: References, label: str, key: Template,
           rule: TensorRule) -> list[tuple[Binding, Value]]:
    op, var = step.op, step.variable
    out: list[tuple[Binding, Value]] = []
    if op.kind == "map":
        for binding, value in items:
            out.append((binding, op.map(step.args, _StepContext(refs, label, binding), _view(value, label))))
        return out
    if op.kind == "split":
        names = next((t.variables[var].values for t in rule.to if var in t.variables), None) if var else None
        for binding, value in items:
            ctx = _StepContext(refs, label, binding)
            for name, part in op.split(step.args, ctx, _view(value, label), names):
                out.append((tuple(sorted((*binding, (var or "", name)))), part))
        return out
    assert var is not None
    groups: dict[Binding, list[tuple[str, View]]] = {}
    for binding, value in items:
        bound = dict(binding)
        member = bound.pop(var)
        groups.setdefault(tuple(sorted(bound.items())), []).append((member, _view(value, label)))
    enumerated = key.variables[var].values if var in key.variables else None
    for rest, group in sorted(groups.items()):
        ctx = _StepContext(refs, label, rest)
        expected = enumerated or op.expected(step.args, ctx)
        present = {m for m, _ in group}
        order = (list(expected) if expected is not None else
                 sorted(present, key=natural_key) if not all(m.isdigit() for m in present) else
                 [str(i) for i in range(max(int(m) for m in present) + 1)])
        missing = [m for m in order if m not in present]
        if missing:
            raise ctx.error(f"incomplete group: {_missing_key(key, dict(rest), var, missing[0])!r} is missing"
                            + (f" ({len(missing)} members missing)" if len(missing) > 1 else "")
                            + f"; {op.verb} over {{{var}}} needs {', '.join(order[:8])}"
                            + ("..." if len(order) > 8 else ""), key=_missing_key(key, dict(rest), var, missing[0]))
        extra = sorted(present - set(order), key=natural_key)
        if extra:
            raise ctx.error(f"{_missing_key(key, dict(rest), var, extra[0])!r} is beyond the {len(order)} members "
                            f"{op.verb} over {{{var}}} expects ({', '.join(order[:8])})")
        by_name = dict(group)
        out.append((rest, op.reduce(step.args, ctx, [(m, by_name[m]) for m in order])))
    return out


def _view(value: Value, label: str) -> View:
    if isinstance(value, Block):  # the loader lets a decoding op only end a chain
        raise PlanError(f"{label}: follows an op that decodes values; make that op the last")
    return value


def _missing_key(key: Template, bound: dict[str, str], var: str, value: str) -> str:
    names = {**bound, var: value}
    return "".join(p if isinstance(p, str) else names.get(p.name, "{" + p.name + "}") for p in key.parts)


def _output(out_key: str, value: Value, source: str, members: list[TensorInfo], rule: TensorRule) -> PlannedOutput:
    runs = value.runs if isinstance(value, View) else tuple(r for v in value.inputs for r in v.runs)
    used = list(dict.fromkeys(r.input for r in runs if r.input >= 0))  # in the order the output reads them
    if not used and members:
        used = [0]
    remap: Callable[[View], View] = _remapper(used)
    inputs = tuple(TensorRef(source, members[i].key) for i in used)
    chain = tuple(step.op.describe(step.args) for step in rule.ops)
    picked = tuple(members[i] for i in used)
    if isinstance(value, Block):
        block = Block(value.op, value.args, tuple(remap(v) for v in value.inputs), value.shape, value.dtype)
        return PlannedOutput(out_key, value.shape, value.dtype, BlockProgram(inputs, block, chain), picked)
    view = remap(value)
    only = picked[0] if len(picked) == 1 else None
    if only is not None and view.runs == (Run(0, 0, only.nbytes),) and view.shape == only.shape:
        return PlannedOutput(out_key, view.shape, view.dtype, CopyTensor(source, only.key), picked)
    return PlannedOutput(out_key, view.shape, view.dtype, ByteProgram(inputs, view, chain), picked)


def _remapper(used: list[int]) -> Callable[[View], View]:
    index = {old: new for new, old in enumerate(used)}

    def remap(view: View) -> View:
        return View(view.shape, view.dtype,
                    tuple(Run(index[r.input], r.start, r.length) if r.input >= 0 else r for r in view.runs))
    return remap
