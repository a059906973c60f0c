"""Streaming a shard's outputs into its writer: kernel copies of local byte runs on one
thread, everything that goes through Python (gathers, casts, block ops, remote reads) on
another, whose fresh-block ops (FP8 dequant) decode on a few more (that thread among
them), each block read, hashed and written by the thread that decodes it. Reads only
through ``Sources`` (the plan's open sources, or a worker's), one thread at a time."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import groupby

from ...dtypes import DTYPE_SIZES
from ...ops.decode import cast_bytes
from ...quant.pipeline import then_in_order
from ..plan.recipes import BlockProgram, Chunk, OutputPlan, Piece, Sources
from .writer import ShardWriter


def _execution_order(outputs: list[OutputPlan], plan: Sources) -> list[OutputPlan]:
    """What reads whole local tensors in source-file order (sequential reads), then the rest."""
    return sorted(outputs, key=lambda o: (*o.recipe.read_order(plan), o.key))


def local_pieces(out: OutputPlan, plan: Sources) -> Iterator[Piece] | None:
    """``out``'s bytes as kernel copies from local files, when it is made of such (no cast)."""
    return out.recipe.local_pieces(plan) if out.dtype == out.input_dtype else None


def write_outputs(outputs: list[OutputPlan], plan: Sources, writer: ShardWriter,
                  progress: Callable[[int], None] | None) -> None:
    """Produce the bytes of ``outputs`` into ``writer``: kernel copies (I/O) on this
    thread, gathers, casts and block ops (Python) on another, so that on two cores they overlap."""
    _prefetch(plan, outputs)
    # which outputs are kernel copies, without keeping their pieces' generators: made
    # again when each is written (held for every tensor of a shard, they were ~450 bytes a
    # tensor, the peak of a run of many small tensors)
    copies, streamed = [], []
    for o in _execution_order(outputs, plan):
        (streamed if local_pieces(o, plan) is None else copies).append(o)
    stop = threading.Event()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptxform-stream") as pool:
        background = pool.submit(_write_streamed, streamed, plan, writer, progress, stop)
        try:
            _write_copies(copies, plan, writer, progress, stop)
            background.result()
        except BaseException:
            stop.set()  # the other thread stops at its next chunk; the pool waits for it
            raise


def _write_copies(outputs: list[OutputPlan], plan: Sources, writer: ShardWriter,
                  progress: Callable[[int], None] | None, stop: threading.Event) -> None:
    """Byte runs of local files: in the kernel, never through Python memory (short runs
    between them through a small buffer). Consecutive runs of one file go to the writer
    together, which copies them with one system call each and no more."""
    for o in outputs:
        pieces = local_pieces(o, plan)
        assert pieces is not None  # it was a moment ago: made from headers only
        for path, group in groupby(pieces, key=lambda piece: piece[0] if isinstance(piece, tuple) else None):
            if stop.is_set():
                return
            if path is None:
                for chunk in group:
                    writer.write(o.key, chunk)
                    if progress is not None:
                        progress(len(chunk))
                continue
            runs = [(offset, length) for _, offset, length in group]
            writer.copy_runs(o.key, path, runs)
            if progress is not None:
                progress(sum(length for _, length in runs))
        writer.finish_tensor(o.key)


def _write_streamed(outputs: list[OutputPlan], plan: Sources, writer: ShardWriter,
                    progress: Callable[[int], None] | None, stop: threading.Event) -> None:
    """Everything else (row gathers, casts, remote copies, vocab maps), chunk by chunk."""
    try:
        for o in outputs:
            put = _putter(o, writer, progress, stop)
            if _in_turns(o):
                # decoded on several threads, each block hashed and written, in order, by
                # the thread that decoded it (the bytes still in its core's cache)
                assert isinstance(o.recipe, BlockProgram)
                then_in_order(o.recipe.block_tasks(plan), put)
            else:
                for chunk in o.recipe.stream(plan):
                    put(chunk)
            if stop.is_set():
                return
            writer.finish_tensor(o.key)
    except _Stopped:
        return
    except BaseException:
        stop.set()  # the copying thread stops at its next tensor
        raise


class _Stopped(Exception):
    """The other thread failed: stop writing (its error is the one raised)."""


def _putter(o: OutputPlan, writer: ShardWriter, progress: Callable[[int], None] | None,
            stop: threading.Event) -> Callable[[Chunk], None]:
    """What writes each next chunk of ``o`` (cast first when ``o`` changes its dtype);
    ``_Stopped`` once the other thread has failed."""
    cast = o.dtype != o.input_dtype
    size = DTYPE_SIZES[o.input_dtype] if cast else 1

    def put(chunk: Chunk) -> None:
        if stop.is_set():
            raise _Stopped
        if cast:
            assert len(chunk) % size == 0
            chunk = cast_bytes(chunk, o.input_dtype, o.dtype)
        writer.write(o.key, chunk)
        if progress is not None:
            progress(len(chunk))
    return put


def _in_turns(o: OutputPlan) -> bool:
    """Whether ``o`` is a block op's output whose blocks are tasks (``fresh_blocks``),
    decoded, hashed and written on several threads (``then_in_order``)."""
    return isinstance(o.recipe, BlockProgram) and o.recipe.block.op.fresh_blocks


def _prefetch(plan: Sources, outputs: list[OutputPlan]) -> None:
    """Tell each source which tensors of ``outputs`` will be copied whole and which rows
    gathered (Hub sources fetch them, by ranges or a download, and remember how: the
    audit's ``fetch`` events, written at the commit)."""
    tensors: dict[str, set[str]] = {}
    rows: dict[str, dict[str, list[int]]] = {}
    for o in outputs:
        for source, key, wanted in o.recipe.prefetch_reads(plan):
            if wanted is None:
                tensors.setdefault(source, set()).add(key)
            else:
                rows.setdefault(source, {}).setdefault(key, []).extend(wanted)
    for name in sorted(set(tensors) | set(rows)):
        plan.checkpoints[name].prefetch((), tensors=sorted(tensors.get(name, ())), rows=rows.get(name, {}))


