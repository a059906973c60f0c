"""What the plan says about each output tensor and each source tensor.

An output tensor has a recipe: how its bytes are made. Each recipe type is one family of
programs and knows everything about itself (its inputs, its audit wording, how its bytes
stream, which of them the kernel can copy, where it reads), so the executor, the audit
and the reports never switch on its type:

- ``CopyTensor``: one source tensor's bytes unchanged (a keep, a rename, an untie);
- ``ByteProgram``: byte runs of several inputs (stack, concat, split, any row
  permutation), made by a chain of layout ops; nothing is decoded but the block ops'
  outputs its runs read. A chain with a vocabulary row permutation (ops/rows.py) has its
  ``RowsOrigin`` (the audit's wording, its rows for a Hub prefetch);
- ``BlockProgram``: a block op (transpose, dequant) decoding a bounded block at a time;
- ``VocabField``: ``d2t``/``t2d`` of a vocabulary map;
- ``Constant``: every element one value (an ``add`` constant), made, never read.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

from ...dtypes import DTYPE_SIZES, nbytes
from ...errors import printable
from ...ops.base import Block, InputTensor, Run, View
from ...ops.accounts import RowAccount, RowsOrigin
from ...sources.base import Checkpoint, TensorInfo
from ...vocab.maps import VocabMap

#: bytes moved per read/write; bounds memory per tensor being copied or gathered
CHUNK_BYTES = 16 << 20


def rows_per_chunk(row_nbytes: int) -> int:
    """How many rows of ``row_nbytes`` bytes a chunk holds (at least one)."""
    return max(1, CHUNK_BYTES // max(1, row_nbytes))


#: runs at least this long are copied by the kernel when their file is local
KERNEL_RUN_MIN = 1 << 20

Chunk = bytes | bytearray | memoryview
#: a piece of an output written from a local file: (path, offset, length), or bytes
Piece = tuple[Path, int, int] | Chunk


class Sources(Protocol):
    """What a recipe reads from (OpenSources): the open checkpoints and the vocabulary maps."""

    checkpoints: dict[str, Checkpoint]
    vocab_maps: dict[str, VocabMap]


@dataclass(frozen=True, slots=True)  # one a tensor: no __dict__ each
class TensorRef:
    """``source``'s tensor ``key``; ``shard``: only its piece in that model-parallel shard file."""

    source: str
    key: str
    shard: int | None = None

    def info(self, plan: Sources) -> TensorInfo:
        ckpt = plan.checkpoints[self.source]
        return ckpt.tensors[self.key] if self.shard is None else ckpt.shard_tensors(self.key)[self.shard]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source, "key": self.key}
        if self.shard is not None:
            out["shard"] = self.shard
        return out


class Recipe(ABC):
    """How one output tensor's bytes are made."""

    # no state here: a recipe with slots (one a tensor: CopyTensor) then has no __dict__
    __slots__ = ()

    @property
    @abstractmethod
    def inputs(self) -> tuple[TensorRef, ...]:
        """The source tensors it reads, in order."""

    @abstractmethod
    def origin(self) -> dict[str, Any]:
        """The ``from`` field of the audit's ``written`` record (without ``cast_from``)."""

    @abstractmethod
    def stream(self, plan: Sources) -> Iterator[Chunk]:
        """The bytes in order, a bounded chunk at a time."""

    def local_pieces(self, plan: Sources) -> Iterator[Piece] | None:
        """The bytes as kernel copies from local files (and small chunks), or None when
        they cannot all be had that way."""
        return None

    def unchanged_copy(self, plan: Sources) -> tuple[str, str, int] | None:
        """``(source, file, offset)`` when the output is one source tensor's bytes, whole and
        unchanged (what the output layout lines up for cloning); None otherwise. Read from
        headers only, so the layout is the same for a local and a Hub source."""
        return None

    def read_order(self, plan: Sources) -> tuple[int, str, str, int]:
        """Sort key: what reads whole local tensors goes first, in source-file order."""
        return (1, "", "", 0)

    def prefetch_reads(self, plan: Sources) -> list[tuple[str, str, tuple[int, ...] | None]]:
        """``(source, key, rows)``: what it will read, some rows of a tensor or (None) all of
        it; Hub sources fetch these before writing, by ranges or a download of the file."""
        return [(ref.source, ref.key, None) for ref in self.inputs]

    def describe(self) -> str:
        """What ``plan`` prints after the arrow: ``source:key`` and what is done to it."""
        origin = self.origin()
        return f"{origin['source']}:{printable(origin['key'])}"

    def row_account(self) -> RowAccount | None:
        """For a vocabulary row permutation, where its rows come from; None for the rest."""
        return None

    def decodes(self) -> bool:
        """Whether making the bytes decodes values (a block op): CPU per byte, not I/O."""
        return False

    def carries_bytes_of(self, source: str) -> bool:
        """Whether at least one byte comes from a tensor of ``source`` (what makes an output
        count as loaded from the converted source: a tensor all filled, all zeros or all
        another source's rows is not)."""
        return any(ref.source == source for ref in self.inputs)


ProgramInput = TensorRef | Block


class ByteRecipe(Recipe):
    """An output that is byte runs of its inputs: streamed, or copied by the kernel."""

    __slots__ = ()

    @abstractmethod
    def runs(self, plan: Sources) -> tuple[Run, ...]:
        """The output's bytes as runs of ``sources()`` (input -1: zero bytes)."""

    def sources(self) -> tuple[ProgramInput, ...]:
        """What the runs point at: source tensors, or block ops' outputs read by later ops."""
        return self.inputs

    def decodes(self) -> bool:
        return any(isinstance(item, Block) for item in self.sources())

    def stream(self, plan: Sources) -> Iterator[Chunk]:
        reader = InputReader(self.sources(), plan)
        buf = bytearray()
        for run in self.runs(plan):
            for start in range(0, run.length, CHUNK_BYTES):
                length = min(CHUNK_BYTES, run.length - start)
                data = reader.read(run.input, run.start + start, length)
                if not buf and length == CHUNK_BYTES:
                    yield data
                    continue
                buf += data
                if len(buf) >= CHUNK_BYTES:
                    yield bytes(buf)
                    buf.clear()
        if buf:
            yield bytes(buf)

    def local_pieces(self, plan: Sources) -> Iterator[Piece] | None:
        places: list[tuple[Checkpoint, TensorInfo] | None] = []
        for item in self.sources():
            if isinstance(item, Block):
                if self.kernel_run_min() != 0:
                    return None
                places.append(None)  # decoded, through memory, between the kernel copies
                continue
            info = item.info(plan)
            ckpt = plan.checkpoints[item.source]
            if ckpt.local_segments(info, 0, 0) is None:  # not in local files
                return None
            places.append((ckpt, info))
        if not any(places):
            return None
        return self._pieces(plan, places)

    def kernel_run_min(self) -> int:
        """Runs at least this long are kernel copies (shorter ones go through memory); 0:
        every run of a local file, with a block op's runs decoded in between."""
        return KERNEL_RUN_MIN

    def _pieces(self, plan: Sources, places: list[tuple[Checkpoint, TensorInfo] | None]) -> Iterator[Piece]:
        runs = self.runs(plan)
        small: list[Run] = []
        least = self.kernel_run_min()
        for run in runs:
            place = places[run.input] if run.input >= 0 else None
            segments = None
            if place is not None and (run.length >= least or len(runs) == 1):
                segments = place[0].local_segments(place[1], run.start, run.length)
                # a run in many short pieces (a column shard's rows) costs a system call a
                # piece: through memory instead
                if segments is not None and len(segments) > 1 and min(n for _, _, n in segments) < least:
                    segments = None
            if segments is not None:
                if small:
                    yield from _SmallRuns(self, small).stream(plan)
                    small = []
                yield from segments
            else:
                small.append(run)
        if small:
            yield from _SmallRuns(self, small).stream(plan)

    def unchanged_copy(self, plan: Sources) -> tuple[str, str, int] | None:
        runs = self.runs(plan)
        if len(runs) != 1 or runs[0].input < 0 or runs[0].start != 0:
            return None
        item = self.sources()[runs[0].input]
        if not isinstance(item, TensorRef):
            return None
        info = item.info(plan)
        return (item.source, info.file, info.offset) if info.offset >= 0 and runs[0].length == info.nbytes else None

    def read_order(self, plan: Sources) -> tuple[int, str, str, int]:
        if any(isinstance(item, Block) for item in self.sources()):
            return (1, "", "", 0)
        first = self.inputs[0]
        info = first.info(plan)
        return (0, first.source, info.file, info.offset)


class _SmallRuns(ByteRecipe):
    """Some runs of a byte recipe, streamed through memory (too short for a kernel copy)."""

    def __init__(self, whole: ByteRecipe, runs: list[Run]) -> None:
        self._whole, self._runs = whole, tuple(runs)

    @property
    def inputs(self) -> tuple[TensorRef, ...]:
        return self._whole.inputs

    def sources(self) -> tuple[ProgramInput, ...]:
        return self._whole.sources()

    def runs(self, plan: Sources) -> tuple[Run, ...]:
        return self._runs

    def origin(self) -> dict[str, Any]:
        return self._whole.origin()


@dataclass(frozen=True, slots=True)  # one a tensor: no __dict__ each
class CopyTensor(ByteRecipe):
    """The bytes of ``source``'s tensor ``key``, unchanged (a keep or a rename)."""

    source: str
    key: str

    @property
    def inputs(self) -> tuple[TensorRef, ...]:
        return (TensorRef(self.source, self.key),)

    def runs(self, plan: Sources) -> tuple[Run, ...]:
        return (Run(0, 0, self.inputs[0].info(plan).nbytes),)

    def origin(self) -> dict[str, Any]:
        return {"source": self.source, "key": self.key}


def _reads_from(items: tuple[ProgramInput, ...], views: tuple[View, ...], source: str) -> bool:
    """Whether a run of ``views`` reads a tensor of ``source``, directly or through a block
    op that moves or decodes its inputs' values (a fill's values are made, not carried)."""
    for view in views:
        for run in view.runs:
            item = items[run.input] if run.input >= 0 else None
            if isinstance(item, TensorRef) and item.source == source:
                return True
            if isinstance(item, Block) and not item.op.fills and _reads_from(items, item.inputs, source):
                return True
    return False


class _Chain:
    """What the two chain programs share: their inputs, how the audit names them, and a
    vocabulary row permutation's origin (``rows``) when the chain has one."""

    program_inputs: tuple[ProgramInput, ...]
    steps: tuple[str, ...]
    rows: RowsOrigin | None

    @property
    def inputs(self) -> tuple[TensorRef, ...]:
        return tuple(item for item in self.program_inputs if isinstance(item, TensorRef))

    def sources(self) -> tuple[ProgramInput, ...]:
        return self.program_inputs

    def origin(self) -> dict[str, Any]:
        if self.rows is None:
            return {"inputs": [ref.to_dict() for ref in self.inputs], "ops": list(self.steps)}
        out = self.rows.origin()
        if len(self.steps) > 1:  # the permutation is not all the chain does
            out["ops"] = list(self.steps)
        return out

    def describe(self) -> str:
        if self.rows is not None:
            return f"{self.rows.source}:{printable(self.rows.key)} (permuted)"
        first, more = self.inputs[0], len(self.inputs) - 1
        pieces = more and all(ref.shard is not None and ref.key == first.key for ref in self.inputs)
        head = f"{first.source}:{printable(first.key)}" + (
            f" ({more + 1} shards)" if pieces else f" and {more} more" if more else "")
        return head + (f" ({'; '.join(self.steps)})" if self.steps else "")

    def row_account(self) -> RowAccount | None:
        return self.rows.account if self.rows is not None else None

    def prefetch_reads(self, plan: Sources) -> list[tuple[str, str, tuple[int, ...] | None]]:
        if self.rows is not None and self.rows.reads:
            return list(self.rows.reads)
        return [(ref.source, ref.key, None) for ref in self.inputs]


@dataclass(frozen=True)
class ByteProgram(_Chain, ByteRecipe):
    """Byte runs of ``program_inputs`` made by the layout ops ``steps`` (as the audit words
    them); a vocabulary row permutation has its ``rows`` origin, and every run of its
    adjacent rows is a kernel copy from a local file (d8eeb36: a read into memory and a
    write cost twice the copy, and fresh memory is slow to fault in on a vm)."""

    program_inputs: tuple[ProgramInput, ...]
    view: View
    steps: tuple[str, ...]
    rows: RowsOrigin | None = None

    def runs(self, plan: Sources) -> tuple[Run, ...]:
        return self.view.runs

    def kernel_run_min(self) -> int:
        return 0 if self.rows is not None else KERNEL_RUN_MIN

    def carries_bytes_of(self, source: str) -> bool:
        return _reads_from(self.program_inputs, (self.view,), source)

    def read_order(self, plan: Sources) -> tuple[int, str, str, int]:
        if self.rows is not None:  # rows from all over the tensor: not a whole-tensor read
            return Recipe.read_order(self, plan)
        return ByteRecipe.read_order(self, plan)


@dataclass(frozen=True)
class BlockProgram(_Chain, Recipe):
    """A block op's output over views of ``program_inputs``, decoded a bounded block at a time."""

    program_inputs: tuple[ProgramInput, ...]
    block: Block
    steps: tuple[str, ...]
    rows: RowsOrigin | None = None

    def carries_bytes_of(self, source: str) -> bool:
        return not self.block.op.fills and _reads_from(self.program_inputs, self.block.inputs, source)

    def decodes(self) -> bool:
        return True

    def stream(self, plan: Sources) -> Iterator[Chunk]:
        reader = InputReader(self.program_inputs, plan)
        return self.block.op.blocks(self.block, reader.tensors(self.block), CHUNK_BYTES)

    def block_tasks(self, plan: Sources) -> Iterator[Callable[[], Chunk]]:
        """``stream``'s pieces as tasks not run yet (an op with ``fresh_blocks``)."""
        reader = InputReader(self.program_inputs, plan)
        return self.block.op.block_tasks(self.block, reader.tensors(self.block), CHUNK_BYTES)


class InputReader:
    """Byte ranges of a program's inputs: a source tensor's straight from its checkpoint; a
    block op's output decoded a block of rows at a time (the last block is kept, since
    neighbouring reads, e.g. a row permutation after a transpose, mostly hit it)."""

    def __init__(self, items: tuple[ProgramInput, ...], plan: Sources) -> None:
        self._items, self._plan = items, plan
        self._cached: tuple[int, int, bytes] | None = None  # (input, first byte, bytes)

    def read(self, index: int, start: int, length: int) -> bytes:
        if index < 0:
            return bytes(length)
        item = self._items[index]
        if isinstance(item, TensorRef):
            return self._plan.checkpoints[item.source].read(item.info(self._plan), start, length)
        cached = self._cached
        if cached is None or cached[0] != index or not cached[1] <= start <= start + length <= cached[1] + len(cached[2]):
            cached = self._cached = (index, *self._decode(item, start, length))
        return cached[2][start - cached[1]:start - cached[1] + length]

    def _decode(self, block: Block, start: int, length: int) -> tuple[int, bytes]:
        row = prod(block.shape[1:]) * DTYPE_SIZES[block.dtype] if block.shape else DTYPE_SIZES[block.dtype]
        step = rows_per_chunk(row)
        first = start // row // step * step
        stop = max(first + step, -(-(start + length) // row))
        stop = min(stop, block.shape[0] if block.shape else 1)
        data = b"".join(block.op.blocks(block, self.tensors(block), CHUNK_BYTES, range(first, stop)))
        return first * row, data

    def tensors(self, block: Block) -> list[InputTensor]:
        """``block``'s input views, each readable by byte range."""
        return [InputTensor(view, _ViewReader(self, view).read, self._local(view)) for view in block.inputs]

    def _local(self, view: View) -> tuple[Path, int] | None:
        if len(view.runs) != 1 or view.runs[0].input < 0:
            return None
        item = self._items[view.runs[0].input]
        if not isinstance(item, TensorRef):
            return None
        info = item.info(self._plan)
        path = self._plan.checkpoints[item.source].local_path(info.file)
        return (path, info.offset + view.runs[0].start) if path is not None and info.offset >= 0 else None


class _ViewReader:
    """Byte ranges of a view, read from the runs that make it."""

    def __init__(self, reader: InputReader, view: View) -> None:
        self._reader, self._view = reader, view

    def read(self, start: int, length: int) -> bytes:
        parts = [self._reader.read(run.input, run.start, run.length) for run in self._view.slice(start, length)]
        return parts[0] if len(parts) == 1 else b"".join(parts)


@dataclass(frozen=True)
class VocabField(Recipe):
    """``d2t`` or ``t2d`` of a vocabulary map."""

    vocab: str
    field: Literal["d2t", "t2d"]
    encoding: Literal["offset", "absolute"] = "offset"

    @property
    def inputs(self) -> tuple[TensorRef, ...]:
        return ()

    def origin(self) -> dict[str, Any]:
        out: dict[str, Any] = {"vocab": self.vocab, "field": self.field}
        if self.field == "d2t":
            out["encoding"] = self.encoding
        return out

    def stream(self, plan: Sources) -> Iterator[Chunk]:
        vmap = plan.vocab_maps[self.vocab]
        yield vmap.d2t_bytes(self.encoding) if self.field == "d2t" else vmap.t2d_bytes()

    def describe(self) -> str:
        return f"vocab {self.vocab}.{self.field}"


@dataclass(frozen=True)
class Constant(Recipe):
    """Every element the same value (an ``add`` constant): made, never read, and streamed
    a bounded chunk at a time however large the tensor."""

    #: one element's bytes in the output dtype, as hex (a plan is digested as JSON), and how
    #: many elements
    element: str
    count: int
    #: the value as the rule file gave it (after ``${...}``), for the audit
    value: int | float

    def __post_init__(self) -> None:  # what a job file someone edited may hold
        try:
            ok = len(bytes.fromhex(self.element)) > 0 and type(self.count) is int and self.count >= 0
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError("a constant is one element's bytes (hex) and a count of 0 or more")

    @property
    def inputs(self) -> tuple[TensorRef, ...]:
        return ()

    def origin(self) -> dict[str, Any]:
        return {"created": "constant", "fill": self.value}

    def stream(self, plan: Sources) -> Iterator[Chunk]:
        element = bytes.fromhex(self.element)
        per_chunk = max(1, CHUNK_BYTES // len(element))
        block = element * min(per_chunk, self.count)
        left = self.count
        while left >= per_chunk:
            yield block
            left -= per_chunk
        if left:
            yield block[:left * len(element)]

    def describe(self) -> str:
        return f"created: constant {self.value!r}"


@dataclass(frozen=True, slots=True)  # one a tensor: no __dict__ each
class OutputPlan:
    """One tensor of the output: its key, dtype, shape and how its bytes are made.

    ``input_dtype`` is the dtype the recipe produces; when it differs from ``dtype`` the
    executor casts (the only case, with numeric fills and block ops, that decodes values)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    recipe: Recipe
    input_dtype: str
    rule: str
    #: True when at least one of its bytes comes from the converted source (what
    #: require.loaded asks); an ``add`` is a declared extra, never loaded
    loaded: bool

    @property
    def nbytes(self) -> int:
        return nbytes(self.dtype, self.shape)

    def origin(self) -> dict[str, Any]:
        """The ``from`` field of the audit's ``written`` record."""
        out = self.recipe.origin()
        if self.dtype != self.input_dtype:
            out["cast_from"] = self.input_dtype
        return out


@dataclass(frozen=True, slots=True)
class TargetReason:
    """A record's reason that is a fixed text and then the record's target (``'a', 'b'``),
    made when it is asked for: one object a rule, where each tensor's text ("matched,
    renamed to 'layers.0.e.1.w1'") was ~90 bytes a tensor held for the whole run."""

    prefix: str

    def text(self, target: str | tuple[str, ...] | None) -> str:
        return self.prefix + ", ".join(map(repr, target if isinstance(target, tuple) else (target,)))


@dataclass(frozen=True, slots=True)  # one a tensor: no __dict__ each
class TensorRecord:
    """What happened to one tensor of a source file the run opened (an audit ``tensor`` event).
    ``target`` is a list when one source tensor feeds several outputs (an untie, a split)."""

    source: str
    key: str
    action: str
    target: str | tuple[str, ...] | None
    #: None (both) for a skipped key of a shard whose header was not read (``unread_file``)
    shape: tuple[int, ...] | None
    dtype: str | None
    rule: str | None
    #: the reason, or how to make it from ``target`` (``reason`` is the text)
    why: str | TargetReason
    #: the shard the index assigns the key to, when its header was not read: every key the
    #: index gives it is skipped, so nothing of it is needed (the event says
    #: ``"file": ..., "header": "not read"`` in place of shape and dtype)
    unread_file: str | None = None
    #: the plan's digest hashes the text of the reason (engine/output/digest.py)
    DIGEST_AS: ClassVar[dict[str, str]] = {"why": "reason"}

    @property
    def reason(self) -> str:
        """Why it took its action, as the audit says it."""
        return self.why if isinstance(self.why, str) else self.why.text(self.target)

    def to_event(self) -> dict[str, Any]:
        target = list(self.target) if isinstance(self.target, tuple) else self.target
        header: dict[str, Any] = ({"shape": list(self.shape), "dtype": self.dtype} if self.shape is not None
                                  else {"file": self.unread_file, "header": "not read"})
        return {"event": "tensor", "source": self.source, "key": self.key, "action": self.action,
                "target": target, **header, "rule": self.rule, "reason": self.reason}


@dataclass(frozen=True)
class SourceRecord:
    """Where a source came from, for the audit's ``run`` record."""

    name: str
    location: str
    revision: str | None
    commit: str | None

    fingerprint: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"location": self.location, "revision": self.revision, "commit": self.commit,
                "fingerprint": self.fingerprint}

