"""Plan a tensor rule: claim its source tensors into complete groups, run its op chain
on views (shapes checked, nothing read), and make one recipe per output.

A group is every tensor that agrees on the variables the chain keeps (a ``match`` rule
binds the whole key: each tensor is its own group); a reduce op (stack, concat) takes the
members in order (an enumeration's listed order, else natural index order) and a missing
member is a plan error naming the key that is missing. An op that reads more than its
input (permute_rows) asks the planner through the step's Context (``PlannerAccess``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any, Protocol

from ...dtypes import DTYPE_SIZES
from ...errors import PlanError
from ...ops.base import Block, Context, IndexNames, Run, Shards, Step, Value, View, check_yield
from ...ops.accounts import RowsOrigin
from ...rules.model import TensorRule
from ...rules.templates import is_index, natural_key
from ...sources.base import ShardInfo, TensorInfo
from ...sources.model_parallel import missing_shards
from ...vocab.maps import Alignment, VocabMap
from .recipes import BlockProgram, ByteProgram, CopyTensor, Recipe, TensorRef
from .references import MISSING, References, get_path

Binding = tuple[tuple[str, str], ...]
#: a source tensor a chain reads: (source, header entry)
Held = tuple[str, TensorInfo]


class PlannerAccess(Protocol):
    """What a chain's ops may ask of the planner beyond the rule's own tensors."""

    vocab: Mapping[str, VocabMap]

    def alignment(self, source_vocab: str, target_vocab: str) -> Alignment: ...

    def tensor(self, source: str, key: str, why: str) -> TensorInfo: ...

    def lend(self, source: str, info: TensorInfo, where: str, reason: str) -> None: ...

    def has_tensor(self, source: str, key: str, why: str) -> bool: ...


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
    #: what an op said the audit records of the tensors it changed (a permutation's rows)
    reason: str | None = None


class _StepContext(Context):
    def __init__(self, chain: _Chain, step: Step, label: str, binding: Binding,
                 member_key: Callable[[str], str] | None = None,
                 siblings: Callable[[str], list[tuple[str, str, View]]] | None = None) -> None:
        self.label = label
        self._siblings = siblings
        refs = chain.refs
        self._refs = References(refs.rules, refs.ckpts, refs.vocab, refs.config, refs.config_label, dict(binding))
        self._member_key = member_key
        self._chain, self._step, self._binding = chain, step, binding

    def vocab(self, name: str) -> VocabMap:
        return self._chain.access.vocab[name]

    def alignment(self, source_vocab: str, target_vocab: str) -> Alignment:
        return self._chain.access.alignment(source_vocab, target_vocab)

    def tensor_of(self, value: View) -> tuple[str, str, bool] | None:
        first = next((run for run in value.runs if run.input >= 0), None)
        if first is None:
            return None
        item = self._chain.space[first.input]
        if isinstance(item, Block):
            inner = next((self.tensor_of(view) for view in item.inputs), None)
            return None if inner is None else (inner[0], inner[1], False)
        source, info = item
        return source, info.key, value.runs == (Run(first.input, 0, info.nbytes),) and value.shape == info.shape

    def other_tensor(self, source: str, key: str, what: str) -> tuple[View, str]:
        info = self._chain.access.tensor(source, key, f"{self.label} {what}")
        return self._chain.hold((source, info)), info.dtype

    def block_input(self, block: Block) -> View:
        return self._chain.hold(block)

    def has_tensor(self, source: str, key: str) -> bool:
        return self._chain.access.has_tensor(source, key, self.label)

    def bound(self, var: str) -> str:
        return dict(self._binding)[var]

    def lend(self, source: str, key: str, arg: str, reason: str) -> None:
        info = self._chain.access.tensor(source, key, self.label)
        self._chain.access.lend(source, info, self._step.place(arg).short, reason)

    def account(self, rows: RowsOrigin, reason: str) -> None:
        self._chain.accounts[self._binding] = (rows, reason)

    def shards(self, value: View) -> Shards:
        return self._chain.shards(value, self, self._step)

    def key(self, value: str) -> str:
        assert self._member_key is not None, "key() is for reduce ops"
        return self._member_key(value)

    def source_key(self) -> str:
        assert self._member_key is not None, "source_key() is for split ops"
        return self._member_key("")

    def siblings(self, var: str) -> list[tuple[str, str, View]]:
        assert self._siblings is not None, "siblings() is for split ops"
        return self._siblings(var)

    def config(self, path: str) -> Any:
        value = get_path(self._refs.config or {}, path)
        return None if value is MISSING else value

    def integer(self, value: Any, what: str) -> int:
        return self._refs.integer(value, f"{self.label}: {what}")

    def number(self, value: Any, what: str) -> int | float:
        return self._refs.number(value, f"{self.label}: {what}")

    def error(self, message: str, key: str | None = None) -> PlanError:
        return PlanError(f"{self.label}: {message}", key=key)


def plan_rule(rule: TensorRule, source: str, members: list[TensorInfo], refs: References,
              access: PlannerAccess) -> list[PlannedOutput]:
    """The outputs of ``rule`` over the source tensors of ``source`` it matched, in key order."""
    chain = _Chain(rule, refs, [(source, info) for info in members], access)
    items: list[tuple[Binding, Value]] = []
    for i, info in enumerate(members):
        matched = rule.binding(info.key)
        assert matched is not None
        items.append((tuple(sorted(matched.items())), View(info.shape, info.dtype, (Run(i, 0, info.nbytes),))))
    for index, step in enumerate(rule.ops):
        label = rule.label if step.rule_level else f"tensors[{rule.index}].ops[{index}] {step.verb} ({step.where.short})"
        items = chain.apply(step, items, label)
    out = []
    for binding, value in items:
        for target in rule.targets(dict(binding)):
            out.append(chain.output(target, value, binding))
    return sorted(out, key=lambda o: o.key)


class _Chain:
    """One rule's op chain. ``space`` is what runs point at: the matched source tensors,
    then what ops add (another source's tensor, a block op's output that a later op reads);
    ``accounts`` holds, per group, a row permutation's origin and the audit's reason."""

    def __init__(self, rule: TensorRule, refs: References, members: list[Held], access: PlannerAccess) -> None:
        self.rule, self.key, self.refs, self.access = rule, rule.template, refs, access
        self.space: list[Held | Block] = list(members)
        self.members = len(members)
        self.accounts: dict[Binding, tuple[RowsOrigin, str]] = {}
        #: variables a reduce consumed whose output stands for one member (``Op.stands_for``):
        #: the keys later ops see name that member, so a dequant's scales never pass for it
        self.stands: dict[str, str] = {}

    def hold(self, item: Held | Block) -> View:
        """``item`` as one more input: a view of all its bytes."""
        self.space.append(item)
        shape, dtype = (item.shape, item.dtype) if isinstance(item, Block) else (item[1].shape, item[1].dtype)
        return View(shape, dtype, (Run(len(self.space) - 1, 0, prod(shape) * DTYPE_SIZES[dtype]),))

    def shards(self, value: View, ctx: Context, step: Step) -> Shards:
        """``value`` as each model-parallel shard file holds it: the pieces join ``space``."""
        run = value.runs[0] if len(value.runs) == 1 else None
        item = self.space[run.input] if run is not None and 0 <= run.input < self.members else None
        if (step is not self.rule.ops[0] or item is None or isinstance(item, Block) or run is None or run.start
                or run.length != item[1].nbytes or value.shape != item[1].shape):
            raise ctx.error("concat_shards reads a source tensor's pieces in every shard file: it must be the "
                            "first op of the chain")
        source, info = item
        ckpt = self.refs.ckpts[source]
        pieces = ckpt.shard_tensors(info.key)
        files = tuple(p.file for p in pieces)
        root = getattr(ckpt, "root", None)  # local sources: where missing shard files would be

        def missing(count: int) -> str:
            return missing_shards(files, count, root)

        views = (value,) if len(pieces) == 1 else tuple(self.hold((source, piece)) for piece in pieces)
        return Shards(info.key, views, files, missing)

    def view(self, value: Value, step: Step, ctx: _StepContext, member: str | None = None) -> View:
        """``value`` as an input of ``step``, refused when the op's contract does not take it."""
        if isinstance(value, Block):
            if not value.op.row_sliced:
                raise ctx.error(f"{step.verb} reads its input by rows, and the output of {value.op.verb} "
                                f"cannot be made a range of rows at a time; {value.op.verb} must be the "
                                "last op of the chain")
            value = self.hold(value)
        problem = step.op.accepts.problem(value)
        if problem is not None:
            raise ctx.error(f"{step.verb} {problem}" + (f" ({ctx.key(member)!r})" if member is not None else ""))
        return value

    def apply(self, step: Step, items: list[tuple[Binding, Value]], label: str) -> list[tuple[Binding, Value]]:
        op, var = step.op, step.variable
        out: list[tuple[Binding, Value]] = []
        if op.kind == "map":
            for binding, value in items:
                ctx = _StepContext(self, step, label, binding)
                out.append((binding, check_yield(op, op.map(step.args, ctx, self.view(value, step, ctx)))))
            return out
        if op.kind == "split":
            names = next((t.variables[var].values for t in self.rule.to if var in t.variables), None) if var else None
            index: dict[tuple[str, Binding], list[tuple[str, Value]]] = {}
            for binding, value in items:
                ctx = _StepContext(self, step, label, binding, lambda _, b=binding: self.member_key(dict(b), "", ""),
                                   lambda v, b=binding: self._siblings(step, label, items, index, b, v))
                for name, part in op.split(step.args, ctx, self.view(value, step, ctx), names):
                    out.append((tuple(sorted((*binding, (var or "", name)))), check_yield(op, part)))
            return out
        assert var is not None
        groups: dict[Binding, list[tuple[str, Value]]] = {}
        for binding, value in items:
            bound = dict(binding)
            member = bound.pop(var)
            groups.setdefault(tuple(sorted(bound.items())), []).append((member, value))
        orders: list[tuple[Binding, list[str]]] = []
        for rest, values in sorted(groups.items()):
            ctx = _StepContext(self, step, label, rest, lambda v, rest=rest: self.member_key(dict(rest), var, v))
            group = [(m, self.view(value, step, ctx, m)) for m, value in values]
            present = {m for m, _ in group}
            assert self.key is not None  # the loader gives a match rule map ops only
            if op.partial_groups and var in self.key.variables:
                order = [m for m in self.key.variables[var].values if m in present]
            else:
                order = self._order(step, ctx, rest, var, present)
                orders.append((rest, order))
            by_name = dict(group)
            out.append((rest, check_yield(op, op.reduce(step.args, ctx, [(m, by_name[m]) for m in order]))))
        self._same_count(step, label, var, orders)
        if op.stands_for is not None:
            self.stands[var] = op.stands_for
        return out

    def _siblings(self, step: Step, label: str, items: list[tuple[Binding, Value]],
                  index: dict[tuple[str, Binding], list[tuple[str, Value]]], binding: Binding,
                  var: str) -> list[tuple[str, str, View]]:
        """The items agreeing with ``binding`` on all but ``var``, in the group's order
        (``index``: those sets, made once per variable)."""
        if not any(k == var for k, _ in binding):
            raise PlanError(f"{label}: {step.verb}: {{{var}}} is not a variable of 'key'")
        if not any(v == var for v, _ in index):
            for b, value in items:
                bound = dict(b)
                member = bound.pop(var)
                index.setdefault((var, tuple(sorted(bound.items()))), []).append((member, value))
        rest = tuple(sorted((k, v) for k, v in binding if k != var))
        present = dict(index[(var, rest)])
        ctx = _StepContext(self, step, label, rest, lambda m: self.member_key(dict(rest), var, m))
        return [(m, ctx.key(m), self.view(present[m], step, ctx, m))
                for m in self._order(step, ctx, rest, var, set(present))]

    def _same_count(self, step: Step, label: str, var: str, orders: list[tuple[Binding, list[str]]]) -> None:
        """Every instance of the template (each layer) reduces as many members: a layer whose
        count comes from its own header (its router's rows) and lacks an expert with it would
        otherwise stack a shorter tensor than its neighbours."""
        if len(orders) < 2:
            return
        short, less = min(orders, key=lambda o: len(o[1]))
        full, more = max(orders, key=lambda o: len(o[1]))
        if len(less) == len(more):
            return
        have = set(less)
        first = next(m for m in more if m not in have)
        name = self.member_key(dict(short), var, first)
        raise PlanError(f"{label}: incomplete group: {name!r} is missing; {step.verb} over {{{var}}} takes "
                        f"{len(more)} members for {self.member_key(dict(full), var, '*')!r} but {len(less)} for "
                        f"{self.member_key(dict(short), var, '*')!r}; every instance of the template must have "
                        "as many", key=name)

    def _order(self, step: Step, ctx: _StepContext, rest: Binding, var: str, present: set[str]) -> list[str]:
        """The members a complete group has, in order; a plan error names one that is missing.

        A count (a config field, a header's dim, the largest index in a key) may be any
        size: the group is checked against it before a name is listed, so a huge one is
        a missing member, not an unbounded list."""
        assert self.key is not None
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
            name = self.member_key(dict(rest), var, first)
            missing = len(order) - len(inside)
            raise ctx.error(f"incomplete group: {name!r} is missing"
                            + (f" ({missing:,} members missing)" if missing > 1 else "")
                            + f"; {verb} over {{{var}}} needs {', '.join(order[:8])}"
                            + ("..." if len(order) > 8 else ""), key=name)
        extra = sorted(present - set(inside), key=natural_key)
        if extra:
            raise ctx.error(f"{self.member_key(dict(rest), var, extra[0])!r} is beyond the {len(order)} "
                            f"members {verb} over {{{var}}} expects ({', '.join(order[:8])})")
        return list(order)

    def output(self, out_key: str, value: Value, binding: Binding) -> PlannedOutput:
        """The recipe of one output: the inputs it reads (renumbered in reading order)."""
        used: dict[int, int] = {}
        roots = value.inputs if isinstance(value, Block) else (value,)
        for view in roots:
            self._visit(view, used)
        if not used and self.members:  # all zeros: it is still the output of its group's member
            used[self._member_of(binding)] = 0

        def remap(view: View) -> View:
            return View(view.shape, view.dtype,
                        tuple(Run(used[r.input], r.start, r.length) if r.input >= 0 else r for r in view.runs))

        def program_input(item: Held | Block) -> TensorRef | Block:
            if isinstance(item, Block):
                return Block(item.op, item.args, tuple(remap(v) for v in item.inputs), item.shape, item.dtype)
            return TensorRef(item[0], item[1].key, item[1].shard if isinstance(item[1], ShardInfo) else None)

        inputs = tuple(program_input(self.space[i]) for i in used)
        read = tuple(held[1] for i in used if i < self.members and not isinstance(held := self.space[i], Block))
        if not read and self.members:  # all made (a filled row split off): still its group's output
            held = self.space[self._member_of(binding)]
            assert not isinstance(held, Block)
            read = (held[1],)
        steps = tuple(step.op.describe(step.args) for step in self.rule.ops)
        rows, reason = self.accounts.get(binding, (None, None))
        if isinstance(value, Block):
            block = program_input(value)
            assert isinstance(block, Block)
            return PlannedOutput(out_key, value.shape, value.dtype, BlockProgram(inputs, block, steps, rows), read,
                                 reason=reason)
        view = remap(value)
        first = next(iter(used))
        # a permutation that keeps every row in place is still one (its rows are counted)
        only = self.space[first] if len(used) == 1 and first < self.members and rows is None else None
        if isinstance(only, tuple) and view.runs == (Run(0, 0, only[1].nbytes),) and view.shape == only[1].shape:
            return PlannedOutput(out_key, view.shape, view.dtype, CopyTensor(only[0], only[1].key), read,
                                 unchanged=True)
        return PlannedOutput(out_key, view.shape, view.dtype, ByteProgram(inputs, view, steps, rows), read,
                             reason=reason)

    def _visit(self, view: View, used: dict[int, int]) -> None:
        """Number the inputs ``view`` reads (a block's own inputs first) in reading order.
        A method, not a recursive closure: a closure that calls itself is a reference
        cycle, one per output, which only the cyclic collector frees (at 200,000 tensors
        its full passes over the growing plan were the superlinear part of planning)."""
        for run in view.runs:
            if run.input >= 0 and run.input not in used:
                item = self.space[run.input]
                if isinstance(item, Block):
                    for inner in item.inputs:
                        self._visit(inner, used)
                used[run.input] = len(used)

    def _member_of(self, binding: Binding) -> int:
        """The first member whose key binds what ``binding`` does."""
        for i in range(self.members):
            held = self.space[i]
            assert not isinstance(held, Block)
            if set(binding) <= set((self.rule.binding(held[1].key) or {}).items()):
                return i
        return 0

    def member_key(self, bound: dict[str, str], var: str, value: str) -> str:
        """The source key of one member of a group (variables no longer bound shown as ``{X}``)."""
        assert self.key is not None, "only a key: rule regroups"
        names = {**self.stands, **bound, var: value}
        return "".join(p if isinstance(p, str) else names.get(p.name, "{" + p.name + "}") for p in self.key.parts)
