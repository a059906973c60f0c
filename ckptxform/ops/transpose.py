"""transpose: swap two dims; a block op (values move element by element).

The output is made in order, a block of its leading index at a time: for ``transpose(a, c)``
of a tensor viewed as ``[A, M, C, T]`` (a = dim a, c = dim c), output rows ``c0..c1`` are
``input[:, :, c0:c1, :]`` permuted, read as ``A*M`` runs of ``(c1 - c0)*T`` elements.
Peak memory: two blocks of at most ``max(chunk_bytes, one output row)`` bytes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from math import prod
from typing import Any

from .base import Block, BlockOp, Context, InputTensor, Value, View

_DIMS = {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}


class Transpose(BlockOp):
    verb = "transpose"
    description = "Swap two dims ([in, out] Conv1D -> [out, in] Linear): [D0, D1]."
    schema = _DIMS

    def map(self, args: Any, ctx: Context, value: View) -> Value:
        rank = len(value.shape)
        d0, d1 = args
        if not (-rank <= d0 < rank and -rank <= d1 < rank) or d0 % max(rank, 1) == d1 % max(rank, 1):
            raise ctx.error(f"transpose {list(args)}: needs two different dims of a tensor of shape "
                            f"{list(value.shape)}")
        a, c = sorted((d0 % rank, d1 % rank))
        shape = list(value.shape)
        shape[a], shape[c] = shape[c], shape[a]
        return Block(self, {"dims": (a, c)}, (value,), tuple(shape), value.dtype)

    def inverse(self, args: Any) -> tuple[str, Any]:
        return "transpose", args

    def describe(self, args: Any) -> str:
        return f"transpose {list(args)}"

    def blocks(self, block: Block, inputs: Sequence[InputTensor], chunk_bytes: int,
               rows: range | None = None) -> Iterator[bytes]:
        import torch

        from ..dtypes import torch_dtype
        from .decode import tensor_bytes

        (source,) = inputs
        view = source.view
        a, c = block.args["dims"]
        shape = view.shape
        before, big_a, mid = prod(shape[:a]), shape[a], prod(shape[a + 1:c])
        big_c, tail = shape[c], prod(shape[c + 1:])
        size = view.itemsize
        dtype = torch_dtype(view.dtype)
        row = big_a * mid * tail * size  # one index of the output's dim a (a row when a == 0)
        step = max(1, chunk_bytes // max(1, row))
        # the output's dim 0 is dim c when a == 0, else the input's dim 0 (one of `before`'s)
        per = before // shape[0] if a > 0 and shape[0] else 1
        wanted = rows if rows is not None else range(block.shape[0] if block.shape else 1)
        slabs, columns = ((range(wanted.start * per, wanted.stop * per), range(big_c)) if a > 0
                          else (range(before), wanted))
        for b in slabs:
            base = b * big_a * mid * big_c * tail * size
            for c0 in range(columns.start, columns.stop, step):
                count = min(step, columns.stop - c0)
                run = count * tail * size
                buf = bytearray(big_a * mid * run)
                for i in range(big_a * mid):
                    buf[i * run:(i + 1) * run] = source.read(base + (i * big_c + c0) * tail * size, run)
                tile = torch.frombuffer(buf, dtype=dtype).reshape(big_a, mid, count, tail) if buf else None
                if tile is not None:
                    yield tensor_bytes(tile.permute(2, 1, 0, 3))
