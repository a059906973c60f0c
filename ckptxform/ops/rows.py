"""permute_rows: a tensor's rows reordered by two vocabulary maps, the rows of tokens the
source vocabulary lacks filled (``missing_rows``).

The program is a row view over the source (every run of adjacent rows one run, so a local
lm_head is written by one kernel copy per run) plus, for the rows it lacks: zeros, a run of
zero bytes; ``rows_of`` another tensor of the same dtype, runs of that tensor's rows; and
``mean``, ``normal`` or ``rows_of`` a tensor of another dtype, the rows of a small block op
(``FillRows``), the only part that decodes values.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from math import prod
from typing import Any

from ..dtypes import DTYPE_SIZES
from .base import Block, BlockOp, InputTensor, NoInverse, Run, View, join_runs
from .decode import cast_bytes
from .fills import NormalRows, mean_row


class FillRows(BlockOp):
    """The filled rows of a permutation, in order: the mean of the rows taken from the
    source, seeded normal values, or another tensor's rows cast to the output dtype."""

    verb = "fill_rows"  # not a verb of ``ops:``: made by permute_rows only
    description = "The rows permute_rows fills (mean, normal, or rows of another dtype)."
    schema: dict[str, Any] = {}

    def inverse(self, args: Any) -> tuple[str, Any]:
        raise NoInverse("filled rows are made, not moved")

    def blocks(self, block: Block, inputs: Sequence[InputTensor], chunk_bytes: int,
               rows: range | None = None) -> Iterator[bytes | memoryview]:
        count, row_shape = block.shape[0], block.shape[1:]
        width = DTYPE_SIZES[block.dtype] * prod(row_shape)
        wanted = rows if rows is not None else range(count)
        step = max(1, chunk_bytes // max(1, width))
        init = block.args["init"]
        if init == "cast":  # rows of another tensor, in its dtype
            (source,) = inputs
            src_width = source.view.row_nbytes
            for first in range(wanted.start, wanted.stop, step):
                n = min(step, wanted.stop - first)
                yield cast_bytes(source.read(first * src_width, n * src_width), source.view.dtype, block.dtype)
        elif init == "mean":
            (source,) = inputs
            have, src_width = source.view.shape[0], source.view.row_nbytes
            spans = [(first, min(step, have - first)) for first in range(0, have, step)]
            mean = mean_row(((source.read(f * src_width, n * src_width), n) for f, n in spans), row_shape,
                            block.dtype)
            for first in range(wanted.start, wanted.stop, step):
                yield mean * min(step, wanted.stop - first)
        else:  # normal: one stream from the first filled row, whatever range is asked
            normal = NormalRows(block.args["seed"], block.args["std"], row_shape, block.dtype)
            for first in range(0, wanted.stop, step):
                n = min(step, wanted.stop - first)
                values = normal.take(n)
                if first + n > wanted.start:
                    yield values[max(0, wanted.start - first) * width:]


FILL_ROWS = FillRows()


def permuted_rows(source: View, rows: Sequence[int], targets: Sequence[int], fill: dict[str, Any] | None,
                  fill_view: View | None, block_input: int) -> tuple[View, Block | None]:
    """Output row ``j`` is row ``rows[j]`` of ``source``; where that is -1, the row for target
    token ``targets[j]`` made per ``fill`` (``init``: zeros, rows_of, mean, normal; ``std``,
    ``seed``), from ``fill_view`` (the rows_of tensor). A fill that makes values is a
    ``FillRows`` block, which the runs point at as input ``block_input``; returned with the
    view (None when there is none)."""
    width = source.row_nbytes
    shape = (len(rows), *source.shape[1:])
    missing = [t for r, t in zip(rows, targets) if r < 0]
    init = fill["init"] if fill is not None and missing else None
    block = None
    if init == "rows_of" and fill_view is not None and fill_view.dtype != source.dtype:
        block = Block(FILL_ROWS, {"init": "cast"}, (fill_view.rows(missing),), (len(missing), *shape[1:]),
                      source.dtype)
    elif init == "mean":
        present = sorted({r for r in rows if r >= 0})
        block = Block(FILL_ROWS, {"init": "mean"}, (source.rows(present),), (len(missing), *shape[1:]), source.dtype)
    elif init == "normal":
        assert fill is not None
        block = Block(FILL_ROWS, {"init": "normal", "std": fill["std"], "seed": fill["seed"]}, (),
                      (len(missing), *shape[1:]), source.dtype)
    pieces: list[Sequence[Run]] = []
    filled = 0
    for row, target in zip(rows, targets):
        if row >= 0:
            pieces.append(source.slice(row * width, width))
            continue
        if block is not None:
            pieces.append((Run(block_input, filled * width, width),))
        elif init == "rows_of":
            assert fill_view is not None
            pieces.append(fill_view.slice(target * width, width))
        else:
            pieces.append((Run(-1, 0, width),))
        filled += 1
    return View(shape, source.dtype, join_runs(pieces)), block
