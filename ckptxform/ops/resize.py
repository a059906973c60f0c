"""resize_rows: truncate dim 0, or pad it with the fills ``missing_rows`` knows.

Truncating and zero padding are byte programs (a run of the input, a run of zero bytes);
``mean`` (of the input's rows, summed in float64) and ``normal`` (seeded) make values,
so they are a block op: the kept rows are copied a block at a time and the new rows made
a block at a time.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from ..dtypes import decodable, is_float
from .base import Block, BlockOp, Context, InputTensor, NoInverse, Run, Value, View, join_runs
from .layout import _EXPR


class ResizeRows(BlockOp):
    verb = "resize_rows"
    description = ("Truncate dim 0 to `rows`, or pad it with zeros (default), the mean row, or seeded "
                   "normal values (std default 0.02, seed default 0).")
    schema = {"type": "object", "additionalProperties": False, "required": ["rows"],
              "properties": {"rows": _EXPR, "fill": {"enum": ["zeros", "mean", "normal"]},
                             "std": {"type": "number", "exclusiveMinimum": 0}, "seed": {"type": "integer"}}}

    def map(self, args: Any, ctx: Context, value: View) -> Value:
        rows = ctx.integer(args["rows"], "resize_rows.rows")
        if not value.shape or rows < 0:
            raise ctx.error(f"resize_rows: cannot give a tensor of shape {list(value.shape)} {rows} rows")
        have = value.shape[0]
        width = value.nbytes // have if have else 0
        shape = (rows, *value.shape[1:])
        fill = args.get("fill", "zeros")
        if fill == "zeros" or rows <= have:
            runs = list(value.slice(0, min(rows, have) * width))
            if rows > have:
                runs.append(Run(-1, 0, (rows - have) * width))
            return View(shape, value.dtype, join_runs([runs]))
        if not (is_float(value.dtype) and decodable(value.dtype)):
            raise ctx.error(f"resize_rows fill: {fill} makes float values and the tensor is {value.dtype}; "
                            "use fill: zeros")
        if fill == "mean" and have == 0:
            raise ctx.error("resize_rows fill: mean of a tensor with no rows; use fill: zeros")
        return Block(self, {"fill": fill, "std": float(args.get("std", 0.02)), "seed": int(args.get("seed", 0))},
                     (value,), shape, value.dtype)

    def inverse(self, args: Any) -> tuple[str, Any]:
        raise NoInverse("resizing drops or invents rows; write the reverse resize_rows by hand")

    def describe(self, args: Any) -> str:
        return f"resize_rows rows={args['rows']}" + (f" fill={args['fill']}" if "fill" in args else "")

    def blocks(self, block: Block, inputs: Sequence[InputTensor], chunk_bytes: int,
               rows: range | None = None) -> Iterator[bytes | memoryview]:
        from .decode import mean_row, require_torch, tensor_bytes

        (source,) = inputs
        have, width = source.view.shape[0], source.view.nbytes // source.view.shape[0]
        row_shape = tuple(source.view.shape[1:])
        wanted = rows if rows is not None else range(block.shape[0])
        step = max(1, chunk_bytes // max(1, width))
        for first in range(wanted.start, min(wanted.stop, have), step):
            yield source.read(first * width, (min(first + step, wanted.stop, have) - first) * width)
        start = max(wanted.start, have)
        if start >= wanted.stop:
            return
        if block.args["fill"] == "mean":
            chunks = (source.read(first * width, min(step, have - first) * width) for first in range(0, have, step))
            mean = mean_row(chunks, block.dtype, row_shape, have)
            for first in range(start, wanted.stop, step):
                yield mean * (min(step, wanted.stop - first))
            return
        torch = require_torch("fill: normal (torch's seeded generator)")
        from ..dtypes import torch_dtype

        dtype = torch_dtype(block.dtype)
        generator = torch.Generator().manual_seed(block.args["seed"])
        for first in range(have, wanted.stop, step):  # from the first new row: the same values for any `rows`
            count = min(step, wanted.stop - first)
            values = torch.randn((count, *row_shape), generator=generator, dtype=torch.float32) * block.args["std"]
            if first + count > start:
                skip = max(0, start - first)
                yield tensor_bytes(values[skip:].to(dtype))
