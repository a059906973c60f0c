"""What an op of a rule's ``ops:`` chain is, and the values it works on at plan time.

An op is ONE definition (an ``OpDef`` subclass in this package, registered by its verb):
the JSON Schema fragment of its arguments, its kind (``map``: one tensor to one;
``reduce``: a group over a template variable to one; ``split``: one to a group), its
shape rule, its inverse and its audit wording. Its program is part of it too: a layout
op rewrites a ``View`` (which byte runs of which inputs make the tensor), so the executor
streams byte runs and never decodes; a block op returns a ``Block``, whose ``blocks``
decode a bounded slice of the inputs at a time.

The contract between the links of a chain is declared, and the planner checks it before
each op's shape rule runs (so a chain that plans also applies): ``accepts`` says what each
input may be (rank, dtype), and a block op's ``row_sliced`` says whether a later op may
read its output by rows (as every layout op and block op does: a block op's output is
one more input to them, decoded a block of rows at a time).
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from ..digits import is_ascii_digits
from ..dtypes import DTYPE_SIZES
from ..errors import PlanError
from ..where import Where

if TYPE_CHECKING:
    from ..vocab.maps import Alignment, VocabMap
    from .accounts import RowsOrigin


@dataclass(frozen=True)
class Run:
    """Bytes ``[start, start + length)`` of input ``input`` of the group (-1: zero bytes)."""

    input: int
    start: int
    length: int


def join_runs(pieces: Sequence[Sequence[Run]] | Iterator[Sequence[Run]]) -> tuple[Run, ...]:
    """The runs one after another, adjacent runs of one input merged."""
    out: list[Run] = []
    for piece in pieces:
        for run in piece:
            if run.length == 0:
                continue
            last = out[-1] if out else None
            if last is not None and last.input == run.input and (run.input < 0 or last.start + last.length == run.start):
                out[-1] = Run(last.input, last.start, last.length + run.length)
            else:
                out.append(run)
    return tuple(out)


@dataclass(frozen=True)
class View:
    """A tensor as byte runs of the group's inputs, in order: nothing read yet."""

    shape: tuple[int, ...]
    dtype: str
    runs: tuple[Run, ...]

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * self.itemsize

    @property
    def row_nbytes(self) -> int:
        """Bytes of one index of dim 0 (of a tensor with no rows too)."""
        return prod(self.shape[1:]) * self.itemsize

    @cached_property
    def _starts(self) -> list[int]:
        starts, pos = [], 0
        for run in self.runs:
            starts.append(pos)
            pos += run.length
        return starts

    def slice(self, start: int, length: int) -> list[Run]:
        """The runs making bytes ``[start, start + length)`` of this tensor."""
        out: list[Run] = []
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        end = start + length
        while start < end and i < len(self.runs):
            run, begin = self.runs[i], self._starts[i]
            lo, hi = max(start, begin), min(end, begin + run.length)
            if lo < hi:
                out.append(Run(run.input, run.start + lo - begin if run.input >= 0 else 0, hi - lo))
                start = hi
            i += 1
        return out

    def rows(self, order: Sequence[int], shape: tuple[int, ...] | None = None) -> View:
        """Row ``j`` of the result is row ``order[j]`` of this tensor (any row permutation)."""
        width = self.row_nbytes if self.shape else 0
        return View(shape or (len(order), *self.shape[1:]), self.dtype,
                    join_runs(self.slice(r * width, width) for r in order))


@dataclass(frozen=True)
class InputTensor:
    """What a block program reads: one input of the group, as a ``View``. ``local`` is
    (file, offset of the view's first byte) when the view is one run of a local file, so a
    program may map it instead of reading piece by piece."""

    view: View
    read: Callable[[int, int], bytes]  # (start, length) -> bytes of the view
    local: tuple[Path, int] | None = None


@dataclass(frozen=True)
class Block:
    """A tensor made by a block op from views of the group's inputs; decoded a bounded
    block at a time when written. Later layout ops see it as one more input (a view
    with one run over it), read a block of its rows at a time."""

    op: BlockOp
    args: dict[str, Any]
    inputs: tuple[View, ...]
    shape: tuple[int, ...]
    dtype: str


Value = View | Block


@dataclass(frozen=True)
class Accepts:
    """What an op takes as each input: a rank in ``[min_rank, max_rank]`` and one of
    ``dtypes`` (None: any)."""

    min_rank: int = 0
    max_rank: int | None = None
    dtypes: frozenset[str] | None = None

    def problem(self, value: View) -> str | None:
        """Why ``value`` cannot be an input, or None."""
        rank = len(value.shape)
        if rank < self.min_rank or (self.max_rank is not None and rank > self.max_rank):
            want = (f"{self.min_rank}" if self.max_rank == self.min_rank else
                    f"at least {self.min_rank}" if self.max_rank is None else f"{self.min_rank} to {self.max_rank}")
            return f"takes tensors of rank {want}, and this one has shape {list(value.shape)}"
        if self.dtypes is not None and value.dtype not in self.dtypes:
            return f"takes {', '.join(sorted(self.dtypes))} tensors, and this one is {value.dtype}"
        return None


@dataclass(frozen=True)
class Shards:
    """A source tensor's pieces in a model-parallel checkpoint's shard files: one view per
    file, in rank order (the tensor itself where the source is one file); ``missing(n)``
    says which files are missing when the tensor has ``n`` pieces."""

    key: str
    views: tuple[View, ...]
    files: tuple[str, ...]
    missing: Callable[[int], str]


class Context(ABC):
    """What an op's shape rule may ask of the planner: integers from expressions, and
    where it is (every error names the rule's FILE:LINE); for ops that read more than their
    input (permute_rows), the vocabulary alignments, other sources' tensors (each one more
    input of the chain) and what the audit records of them."""

    label: str

    @abstractmethod
    def integer(self, value: Any, what: str) -> int:
        """``value`` (an int or a ``${...}``) as an integer; ``what`` names it in errors."""

    def number(self, value: Any, what: str) -> int | float:
        """``value`` (a number or a ``${...}``) as a finite int or float (affine constants)."""
        raise NotImplementedError

    def error(self, message: str, key: str | None = None) -> PlanError:
        return PlanError(f"{self.label}: {message}", key=key)

    def key(self, value: str) -> str:
        """The source key of member ``value`` of the group being reduced, present or not."""
        raise NotImplementedError

    def config(self, path: str) -> Any:
        """The JSON value at a dotted path of the converted source's config, None when absent."""
        raise NotImplementedError

    def source_key(self) -> str:
        """Split ops: the source key of the tensor being worked on."""
        raise NotImplementedError

    def siblings(self, var: str) -> list[tuple[str, str, View]]:
        """Split ops: ``(value of var, source key, view)`` of the tensors agreeing with this
        one on every variable but ``var`` (a variable of ``key``), this one included, in the
        group's order. A set missing a member is a plan error naming it (as for a reduce)."""
        raise NotImplementedError

    def vocab(self, name: str) -> VocabMap:
        """The rule file's vocabulary map ``name``."""
        raise NotImplementedError

    def alignment(self, source_vocab: str, target_vocab: str) -> Alignment:
        """Where each draft index of ``target_vocab`` finds its token in ``source_vocab``
        (the plan keeps it)."""
        raise NotImplementedError

    def tensor_of(self, value: View) -> tuple[str, str, bool] | None:
        """``(source, key, whole)`` of the source tensor ``value`` first reads (``whole``:
        it is that tensor, every byte in order); None when it reads none."""
        raise NotImplementedError

    def other_tensor(self, source: str, key: str, what: str) -> tuple[View, str]:
        """``source``'s tensor ``key`` whole, as one more input of the chain, and its header
        dtype; a missing one is a plan error naming ``what`` asked for it."""
        raise NotImplementedError

    def has_tensor(self, source: str, key: str) -> bool:
        """Whether ``source`` has a tensor ``key`` (an op whose inputs may be absent asks)."""
        raise NotImplementedError

    def bound(self, var: str) -> str:
        """The value of template variable ``var`` where the op stands; KeyError when unbound."""
        raise NotImplementedError

    def block_input(self, block: Block) -> View:
        """A block op's output as one more input of the chain (runs of a view may point at it)."""
        raise NotImplementedError

    def lend(self, source: str, key: str, arg: str, reason: str) -> None:
        """Record in the audit that ``source``'s tensor ``key`` lends bytes to this output,
        at the place of the op's argument ``arg``."""
        raise NotImplementedError

    def account(self, rows: RowsOrigin, reason: str) -> None:
        """Where the rows of this output come from (``require.min_rows_from_source`` and the
        audit read it), and the audit's reason for the tensor it permutes."""
        raise NotImplementedError

    def shards(self, value: View) -> Shards:
        """``value``, a whole source tensor (the chain's input), as each shard file holds it."""
        raise NotImplementedError


@dataclass(frozen=True)
class Step:
    """One op of a rule's chain as written: its verb, raw arguments and place.
    ``rule_level``: written as a key of the rule (``permute_rows:``), which messages then
    name; ``places``: where its arguments were written, when apart from it."""

    op: OpDef
    args: Any
    where: Where
    rule_level: bool = False
    places: tuple[tuple[str, Where], ...] = ()

    def place(self, arg: str) -> Where:
        return dict(self.places).get(arg, self.where)

    @property
    def verb(self) -> str:
        return self.op.verb

    @property
    def variable(self) -> str | None:
        return self.op.variable(self.args)


@dataclass(frozen=True)
class IndexNames(Sequence[str]):
    """The indices ``'0'`` .. ``str(count - 1)``, never listed: a count from a config or a
    header may be any size, and a group is checked against it before anything is listed."""

    count: int

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [str(j) for j in range(*i.indices(self.count))]
        if not -self.count <= i < self.count:
            raise IndexError(i)
        return str(i % self.count)

    def __contains__(self, name: object) -> bool:
        # ASCII digits without a leading zero: '²' and '07' are no index
        return (isinstance(name, str) and is_ascii_digits(name) and str(int(name)) == name
                and int(name) < self.count)


@dataclass(frozen=True)
class OpDef(ABC):
    """The definition of one verb of ``ops:`` (a dataclass without fields: it is plain data
    where a plan is digested, named by its type)."""

    verb: ClassVar[str]
    kind: ClassVar[Literal["map", "reduce", "split"]] = "map"
    #: reduce ops that judge incomplete groups themselves: ``reduce`` gets the present
    #: members only, in the enumeration's order
    partial_groups: ClassVar[bool] = False
    #: reduce ops whose output is one member's tensor in another form (a dequant's module
    #: tensors -> its ``weight``): later ops see the group's key with the reduced variable
    #: set to this member (a quantize after a dequant judges ``X.weight``, not ``X.{T}``)
    stands_for: ClassVar[str | None] = None
    #: JSON Schema of the verb's argument
    schema: ClassVar[dict[str, Any]]
    description: ClassVar[str]
    #: what each input may be; checked by the planner before the shape rule runs
    accepts: ClassVar[Accepts] = Accepts()
    #: what the shape rule returns: ``view`` (byte runs of the inputs, nothing decoded),
    #: ``block`` (a ``Block``, made a bounded block at a time) or ``either`` (per arguments
    #: and inputs); the planner holds the op to it
    yields: ClassVar[Literal["view", "block", "either"]] = "view"
    #: the audit's action for a tensor the op changes
    action: ClassVar[str] = "transformed"
    #: the output is made, not moved (a fill): its bytes are none of the inputs'
    fills: ClassVar[bool] = False

    def sources(self, args: Any) -> tuple[str, ...]:
        """The sources the op reads besides its input (they are opened for the plan)."""
        return ()

    def variable(self, args: Any) -> str | None:
        """The template variable a reduce op reduces (``over``) or a split op makes (``into``)."""
        if self.kind == "map":
            return None
        value = args.get("over" if self.kind == "reduce" else "into")
        return value if isinstance(value, str) else None

    def expected(self, args: Any, ctx: Context) -> Sequence[str] | None:
        """Reduce ops: the values the variable must take in a complete group, when the op
        knows (a sequence that need not be listed: ``IndexNames`` for a count)."""
        return None

    def map(self, args: Any, ctx: Context, value: View) -> Value:
        raise NotImplementedError(self.verb)

    def reduce(self, args: Any, ctx: Context, members: list[tuple[str, View]]) -> Value:
        raise NotImplementedError(self.verb)

    def split(self, args: Any, ctx: Context, value: View, names: tuple[str, ...] | None) -> list[tuple[str, Value]]:
        raise NotImplementedError(self.verb)

    @abstractmethod
    def inverse(self, args: Any) -> tuple[str, Any] | None:
        """``(verb, args)`` of the op undoing this one; None when the inverse has nothing to
        undo (the op drops out of its chain); raise ``NoInverse`` when there is none."""

    def kept_reason(self, args: Any, key: str) -> str | None:
        """Why the op passed source tensor ``key`` through unchanged (for its audit record),
        when it chooses (a quantize op's ignored module)."""
        return None

    def describe(self, args: Any) -> str:
        """The op as the audit's ``written`` record names it (``stack over E``)."""
        if self.kind == "map":
            return f"{self.verb} {args}" if args not in (None, {}) else self.verb
        return f"{self.verb} {'over' if self.kind == 'reduce' else 'into'} {self.variable(args)}"


class BlockOp(OpDef):
    """An op whose output is made a bounded block at a time (values moved or decoded)."""

    yields: ClassVar[Literal["view", "block", "either"]] = "block"
    #: ``blocks`` makes any range of dim-0 indices, so a later op may read the output by
    #: rows; a chain reading one that cannot is refused at plan time
    row_sliced: ClassVar[bool] = True
    #: the op defines ``block_tasks``: the run decodes several blocks at once and hashes and
    #: writes each, in order, on the thread that decoded it (quant/pipeline.py
    #: ``then_in_order``, engine/run/stream.py) instead of taking ``blocks``' pieces one by one
    fresh_blocks: ClassVar[bool] = False

    @abstractmethod
    def blocks(self, block: Block, inputs: Sequence[InputTensor], chunk_bytes: int,
               rows: range | None = None) -> Iterator[bytes | memoryview]:
        """The output's bytes in order (only its dim-0 indices ``rows`` when given), each
        piece made from a bounded read of the inputs, about ``chunk_bytes`` long."""

    def block_tasks(self, block: Block, inputs: Sequence[InputTensor],
                    chunk_bytes: int) -> Iterator[Callable[[], bytes | memoryview]]:
        """``blocks``' pieces of the whole output as tasks, in order, not run yet (the inputs
        read as the iterator advances), each making a buffer nothing touches afterwards;
        for ops with ``fresh_blocks``."""
        raise NotImplementedError(f"{self.verb} has no block_tasks (fresh_blocks is False)")


def check_yield(op: OpDef, value: Value) -> Value:
    """``value``, as the shape rule of ``op`` returned it, if it is what ``op`` declares it yields."""
    kind = "block" if isinstance(value, Block) else "view"
    if op.yields not in (kind, "either"):
        raise TypeError(f"op {op.verb} declares it yields a {op.yields} but its shape rule returned a {kind}")
    return value


class NoInverse(Exception):
    """An op (or a rule) that cannot be undone, and why."""


def outer_inner(shape: tuple[int, ...], dim: int, itemsize: int) -> tuple[int, int]:
    """(count of slices before ``dim``, bytes of one slice from ``dim`` on)."""
    return prod(shape[:dim]), prod(shape[dim:]) * itemsize
