"""Plan a ``key:`` rule: claim its source tensors into complete groups, run its op chain
on views (shapes checked, nothing read), and make one recipe per output.

A group is every tensor that agrees on the variables the chain keeps; a reduce op
(stack, concat) takes the members in order (an enumeration's listed order, else natural
index order) and a missing member is a plan error naming the key that is missing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

from ...dtypes import DTYPE_SIZES
from ...errors import PlanError
from ...ops.base import Block, Context, IndexNames, Run, Step, Value, View, check_yield
from ...rules.model import TensorRule
from ...rules.templates import Template, expand_from, is_index, natural_key
from ...sources.base import TensorInfo
from .recipes import BlockProgram, ByteProgram, CopyTensor, Recipe, TensorRef
from .references import MISSING, References, get_path

Binding = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class PlannedOutput:
    """One output of a rule: its key, the recipe and the source tensors it reads."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    recipe: Recipe
    members: tuple[TensorInfo, ...]
    #: the one member's bytes as they are: the chain passed it through (a dequant op's
    #: unquantized norm), so it is recorded as loaded or renamed, not as transformed
    unchanged: bool = False


class _StepContext(Context):
    def __init__(self, refs: References, label: str, binding: Binding,
                 member_key: Callable[[str], str] | None = None) -> None:
        self.label = label
        self._refs = References(refs.rules, refs.ckpts, refs.vocab, refs.config, refs.config_label, dict(binding))
        self._member_key = member_key

    def key(self, value: str) -> str:
        assert self._member_key is not None, "key() is for reduce ops"
        return self._member_key(value)

    def config(self, path: str) -> Any:
        value = get_path(self._refs.config or {}, path)
        return None if value is MISSING else value

    def integer(self, value: Any, what: str) -> int:
        return self._refs.integer(value, f"{self.label}: {what}")

    def error(self, message: str, key: str | None = None) -> PlanError:
        return PlanError(f"{self.label}: {message}", key=key)


def plan_template_rule(rule: TensorRule, source: str, members: list[TensorInfo],
                       refs: References) -> list[PlannedOutput]:
    """The outputs of ``rule`` over the source tensors it matched, in key order."""
    key = rule.template
    assert key is not None
    chain = _Chain(rule, key, refs, list(members))
    items: list[tuple[Binding, Value]] = []
    for i, info in enumerate(members):
        matched = key.match(info.key)
        assert matched is not None
        items.append((tuple(sorted(matched.items())), View(info.shape, info.dtype, (Run(i, 0, info.nbytes),))))
    for index, step in enumerate(rule.ops):
        label = f"tensors[{rule.index}].ops[{index}] {step.verb} ({step.where.short})"
        items = chain.apply(step, items, label)
    out = []
    for binding, value in items:
        for target in rule.to:
            out.append(chain.output(expand_from(target, key, dict(binding)), value, source))
    return sorted(out, key=lambda o: o.key)


class _Chain:
    """One rule's op chain. ``space`` is what runs point at: the matched source tensors,
    then each block op's output that a later op reads."""

    def __init__(self, rule: TensorRule, key: Template, refs: References, members: list[TensorInfo]) -> None:
        self.rule, self.key, self.refs = rule, key, refs
        self.space: list[TensorInfo | Block] = list(members)

    def view(self, value: Value, step: Step, ctx: _StepContext, member: str | None = None) -> View:
        """``value`` as an input of ``step``, refused when the op's contract does not take it."""
        if isinstance(value, Block):
            if not value.op.row_sliced:
                raise ctx.error(f"{step.verb} reads its input by rows, and the output of {value.op.verb} "
                                f"cannot be made a range of rows at a time; {value.op.verb} must be the "
                                "last op of the chain")
            self.space.append(value)
            value = View(value.shape, value.dtype, (Run(len(self.space) - 1, 0, prod(value.shape) * DTYPE_SIZES[value.dtype]),))
        problem = step.op.accepts.problem(value)
        if problem is not None:
            raise ctx.error(f"{step.verb} {problem}" + (f" ({ctx.key(member)!r})" if member is not None else ""))
        return value

    def apply(self, step: Step, items: list[tuple[Binding, Value]], label: str) -> list[tuple[Binding, Value]]:
        op, var = step.op, step.variable
        out: list[tuple[Binding, Value]] = []
        if op.kind == "map":
            for binding, value in items:
                ctx = _StepContext(self.refs, label, binding)
                out.append((binding, check_yield(op, op.map(step.args, ctx, self.view(value, step, ctx)))))
            return out
        if op.kind == "split":
            names = next((t.variables[var].values for t in self.rule.to if var in t.variables), None) if var else None
            for binding, value in items:
                ctx = _StepContext(self.refs, label, binding)
                for name, part in op.split(step.args, ctx, self.view(value, step, ctx), names):
                    out.append((tuple(sorted((*binding, (var or "", name)))), check_yield(op, part)))
            return out
        assert var is not None
        groups: dict[Binding, list[tuple[str, Value]]] = {}
        for binding, value in items:
            bound = dict(binding)
            member = bound.pop(var)
            groups.setdefault(tuple(sorted(bound.items())), []).append((member, value))
        for rest, values in sorted(groups.items()):
            ctx = _StepContext(self.refs, label, rest,
                               lambda v, rest=rest: _member_key(self.key, dict(rest), var, v))
            group = [(m, self.view(value, step, ctx, m)) for m, value in values]
            present = {m for m, _ in group}
            if op.partial_groups and var in self.key.variables:
                order = [m for m in self.key.variables[var].values if m in present]
            else:
                order = self._order(step, ctx, rest, var, present)
            by_name = dict(group)
            out.append((rest, check_yield(op, op.reduce(step.args, ctx, [(m, by_name[m]) for m in order]))))
        return out

    def _order(self, step: Step, ctx: _StepContext, rest: Binding, var: str, present: set[str]) -> list[str]:
        """The members a complete group has, in order; a plan error names one that is missing.

        A count (a config field, a header's dim, the largest index in a key) may be any
        size: the group is checked against it before a name is listed, so a huge one is
        a missing member, not an unbounded list."""
        enumerated = self.key.variables[var].values if var in self.key.variables else None
        expected = enumerated or step.op.expected(step.args, ctx)
        if expected is not None:
            order: Sequence[str] = expected
        elif all(map(is_index, present)):
            order = IndexNames(max(int(m) for m in present) + 1)
        else:
            order = sorted(present, key=natural_key)
        verb = step.verb
        inside = [m for m in present if m in order]
        if len(inside) < len(order):
            first = next(m for m in order if m not in present)  # among the first len(present) + 1
            name = _member_key(self.key, dict(rest), var, first)
            missing = len(order) - len(inside)
            raise ctx.error(f"incomplete group: {name!r} is missing"
                            + (f" ({missing:,} members missing)" if missing > 1 else "")
                            + f"; {verb} over {{{var}}} needs {', '.join(order[:8])}"
                            + ("..." if len(order) > 8 else ""), key=name)
        extra = sorted(present - set(inside), key=natural_key)
        if extra:
            raise ctx.error(f"{_member_key(self.key, dict(rest), var, extra[0])!r} is beyond the {len(order)} "
                            f"members {verb} over {{{var}}} expects ({', '.join(order[:8])})")
        return list(order)

    def output(self, out_key: str, value: Value, source: str) -> PlannedOutput:
        """The recipe of one output: the inputs it reads (renumbered in reading order)."""
        used: dict[int, int] = {}

        def visit(view: View) -> None:
            for run in view.runs:
                if run.input >= 0 and run.input not in used:
                    item = self.space[run.input]
                    if isinstance(item, Block):
                        for inner in item.inputs:
                            visit(inner)
                    used[run.input] = len(used)

        roots = value.inputs if isinstance(value, Block) else (value,)
        for view in roots:
            visit(view)
        if not used and self.space:
            used[0] = 0

        def remap(view: View) -> View:
            return View(view.shape, view.dtype,
                        tuple(Run(used[r.input], r.start, r.length) if r.input >= 0 else r for r in view.runs))

        def program_input(item: TensorInfo | Block) -> TensorRef | Block:
            if isinstance(item, Block):
                return Block(item.op, item.args, tuple(remap(v) for v in item.inputs), item.shape, item.dtype)
            return TensorRef(source, item.key)

        inputs = tuple(program_input(self.space[i]) for i in used)
        read = tuple(m for i in used if isinstance(m := self.space[i], TensorInfo))
        steps = tuple(step.op.describe(step.args) for step in self.rule.ops)
        if isinstance(value, Block):
            block = program_input(value)
            assert isinstance(block, Block)
            return PlannedOutput(out_key, value.shape, value.dtype, BlockProgram(inputs, block, steps), read)
        view = remap(value)
        only = self.space[next(iter(used))] if len(used) == 1 else None
        if isinstance(only, TensorInfo) and view.runs == (Run(0, 0, only.nbytes),) and view.shape == only.shape:
            return PlannedOutput(out_key, view.shape, view.dtype, CopyTensor(source, only.key), read, unchanged=True)
        return PlannedOutput(out_key, view.shape, view.dtype, ByteProgram(inputs, view, steps), read)


def _member_key(key: Template, bound: dict[str, str], var: str, value: str) -> str:
    """The source key of one member of a group (variables no longer bound shown as ``{X}``)."""
    names = {**bound, var: value}
    return "".join(p if isinstance(p, str) else names.get(p.name, "{" + p.name + "}") for p in key.parts)
