"""GatherRows: an output whose rows are a source tensor's rows reordered by two vocabulary
maps (``permute_rows``), the rows of tokens the source lacks filled per ``missing_rows``.

From local files each run of adjacent rows is a kernel copy; otherwise rows are read a
bounded block at a time, each run straight into place. Only the ``mean`` and ``normal``
fills and a cast of borrowed rows decode values.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Any

from ...errors import PlanError, printable
from ...ops.decode import cast_bytes, mean_row, require_torch, tensor_bytes
from ...rules.model import MissingRows
from ...sources.base import TensorInfo
from .recipes import Chunk, Piece, Recipe, Sources, TensorRef, rows_per_chunk


@dataclass(frozen=True)
class GatherRows(Recipe):
    """Output row ``j`` is row ``rows[j]`` of ``source``'s ``key``; where ``rows[j]`` is -1
    the row is filled by ``fill`` for target token ``targets[j]``."""

    source: str
    key: str
    rows: tuple[int, ...]
    targets: tuple[int, ...]
    fill: MissingRows | None = None

    @property
    def rows_from_source(self) -> int:
        return len(self.rows) - self.rows.count(-1)

    @property
    def rows_filled(self) -> int:
        return len(self.rows) - self.rows_from_source

    @property
    def inputs(self) -> tuple[TensorRef, ...]:
        return (TensorRef(self.source, self.key),)

    def origin(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source, "key": self.key, "rows_from_source": self.rows_from_source,
                               "rows_filled": self.rows_filled}
        if self.fill is not None and self.rows_filled:
            out["fill"] = (f"{self.fill.rows_of}:{self.fill.tensor}" if self.fill.init == "rows_of"
                           else self.fill.init)
        return out

    def describe(self) -> str:
        return f"{self.source}:{printable(self.key)} (permuted)"

    def prefetch_reads(self, plan: Sources) -> list[tuple[str, str, tuple[int, ...] | None]]:
        """The source rows taken, and the fill's rows (those of the missing target ids)."""
        reads: list[tuple[str, str, tuple[int, ...] | None]] = [
            (self.source, self.key, tuple(i for i in self.rows if i >= 0))]
        if self.fill is not None and self.fill.init == "rows_of" and self.fill.rows_of and self.fill.tensor:
            missing = tuple(t for i, t in zip(self.rows, self.targets) if i < 0)
            reads.append((self.fill.rows_of, self.fill.tensor, missing))
        return reads

    def stream(self, plan: Sources) -> Iterator[Chunk]:
        ckpt = plan.checkpoints[self.source]
        info = ckpt.tensors[self.key]
        width = info.row_nbytes
        fill = _Filler(self, plan, info.dtype, info.shape[1:], width)
        block = rows_per_chunk(width)
        # One buffer refilled for every block: the writer is done with a chunk when its
        # write returns, and new memory costs page faults (0.1-0.8 s of system time for a
        # 400 MB lm_head on a vm) where refilling costs nothing.
        whole = bytearray(min(len(self.rows), block) * width)
        for first in range(0, len(self.rows), block):
            rows = self.rows[first:first + block]
            targets = self.targets[first:first + block]
            buf = memoryview(whole)[:len(rows) * width]
            _place_runs(buf, width, ckpt, info, [(j, row) for j, row in enumerate(rows) if row >= 0])
            fill.place(buf, [(j, target) for j, (row, target) in enumerate(zip(rows, targets)) if row < 0])
            yield buf


    def local_pieces(self, plan: Sources) -> Iterator[Piece] | None:
        """Runs of rows as kernel copies when the source (and a ``rows_of`` fill without a
        cast) are local files: a read into memory and a write of the rows cost twice the
        kernel copy, and new memory for them is slow to fault in on a vm."""
        ckpt = plan.checkpoints[self.source]
        info = ckpt.tensors[self.key]
        path = ckpt.local_path(info.file)
        if path is None or info.offset < 0:
            return None
        fill: tuple[TensorInfo, Path] | None = None
        if self.fill is not None and self.fill.init == "rows_of" and self.rows_filled:
            assert self.fill.rows_of is not None and self.fill.tensor is not None
            other = plan.checkpoints[self.fill.rows_of]
            other_info = other.tensors[self.fill.tensor]
            other_path = other.local_path(other_info.file)
            if other_path is None or other_info.offset < 0 or other_info.dtype != info.dtype:
                return None
            fill = (other_info, other_path)
        return self._pieces(plan, (info, path), fill)

    def _pieces(self, plan: Sources, source: tuple[TensorInfo, Path],
                fill: tuple[TensorInfo, Path] | None) -> Iterator[Piece]:
        width = source[0].row_nbytes
        filler = _Filler(self, plan, source[0].dtype, source[0].shape[1:], width)
        for present, group in groupby(zip(self.rows, self.targets), key=lambda pair: pair[0] >= 0):
            pairs = list(group)
            if present:
                yield from _row_pieces(source, [row for row, _ in pairs], width)
            elif fill is not None:
                yield from _row_pieces(fill, [target for _, target in pairs], width)
            else:
                block = rows_per_chunk(width)
                for first in range(0, len(pairs), block):
                    count = min(block, len(pairs) - first)
                    buf = memoryview(bytearray(count * width))
                    filler.place(buf, [(j, target) for j, (_, target) in enumerate(pairs[first:first + count])])
                    yield buf


def _place_runs(buf: memoryview, width: int, ckpt: Any, info: Any, pairs: list[tuple[int, int]],
                cast: tuple[str, str] | None = None) -> None:
    """Copy row ``row`` of ``info`` to row ``pos`` of ``buf`` for each ``(pos, row)``: one read
    and one copy per run of rows adjacent on both sides (in a vocabulary alignment most
    are), not one per row."""
    runs: list[list[int]] = []  # [pos, row, count]
    for pos, row in pairs:
        if runs and runs[-1][0] + runs[-1][2] == pos and runs[-1][1] + runs[-1][2] == row:
            runs[-1][2] += 1
        else:
            runs.append([pos, row, 1])
    spans = [(row, count) for _, row, count in runs]
    if cast is None:
        ckpt.read_runs_into(info, spans, buf, [pos for pos, _, _ in runs])
        return
    for (pos, _, count), blob in zip(runs, ckpt.read_runs(info, spans), strict=True):
        buf[pos * width:(pos + count) * width] = cast_bytes(blob, *cast)


def _row_pieces(where: tuple[TensorInfo, Path], rows: list[int], width: int) -> Iterator[Piece]:
    """Rows ``rows`` of a local tensor ``where`` = (its info, its file), in order: a kernel
    copy per run of adjacent rows (one system call, as a read would be, and no copy
    through memory)."""
    info, path = where
    for first, count in _runs(rows):
        yield (path, info.offset + first * width, count * width)


def _runs(rows: list[int]) -> Iterator[tuple[int, int]]:
    """``(first, count)`` for each run of adjacent ids in ``rows``, in order."""
    start = 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[i - 1] + 1:
            yield rows[start], i - start
            start = i


class _Filler:
    """Rows for target tokens the source vocabulary lacks, per ``missing_rows``."""

    def __init__(self, recipe: GatherRows, plan: Sources, dtype: str, row_shape: tuple[int, ...], width: int):
        self.recipe, self.plan, self.dtype, self.row_shape, self.width = recipe, plan, dtype, row_shape, width
        self._generator: Any = None
        self._mean: bytes | None = None

    def place(self, buf: memoryview, missing: list[tuple[int, int]]) -> None:
        """Fill row ``pos`` of ``buf`` for each ``(pos, target token id)`` in ``missing``."""
        if not missing:
            return
        spec = self.recipe.fill
        if spec is None:
            raise PlanError(f"{self.recipe.key!r}: rows are missing and no missing_rows was given")
        width = self.width
        if spec.init == "rows_of":
            assert spec.rows_of is not None and spec.tensor is not None
            ckpt = self.plan.checkpoints[spec.rows_of]
            info = ckpt.tensors[spec.tensor]
            cast = (info.dtype, self.dtype) if info.dtype != self.dtype else None
            _place_runs(buf, width, ckpt, info, missing, cast)
        elif spec.init == "zeros":
            zeros = bytes(width)
            for pos, _ in missing:
                buf[pos * width:(pos + 1) * width] = zeros
        elif spec.init == "mean":
            if self._mean is None:
                self._mean = self._mean_row()
            for pos, _ in missing:
                buf[pos * width:(pos + 1) * width] = self._mean
        else:
            raw = self._normal(len(missing), spec.std, spec.seed)
            for i, (pos, _) in enumerate(missing):
                buf[pos * width:(pos + 1) * width] = raw[i * width:(i + 1) * width]

    def _mean_row(self) -> bytes:
        ckpt = self.plan.checkpoints[self.recipe.source]
        info = ckpt.tensors[self.recipe.key]
        present = sorted({r for r in self.recipe.rows if r >= 0})
        block = rows_per_chunk(self.width)
        chunks = (raw for i in range(0, len(present), block)
                  for raw in ckpt.read_rows(info, present[i:i + block]).values())
        return mean_row(chunks, self.dtype, tuple(self.row_shape), len(present))

    def _normal(self, count: int, std: float, seed: int) -> bytes:
        torch = require_torch("init: normal (torch's seeded generator)")

        from ...dtypes import torch_dtype

        if self._generator is None:
            self._generator = torch.Generator().manual_seed(seed)
        values = torch.randn((count, *self.row_shape), generator=self._generator, dtype=torch.float32) * std
        return tensor_bytes(values.to(torch_dtype(self.dtype)))
