"""dequant_gguf: a tensor of a GGUF source (any type gguf-py decodes: F16, BF16, Q8_0,
Q4_K, IQ2_XS, MXFP4, ...) -> float32 values in transformers' shape, exactly gguf-py's
``gguf.quants.dequantize`` (what transformers' GGUF loader calls), a bounded band of rows at
a time (decoders in quant/gguf_blocks.py).

The tensor's GGUF type and the shape of its values come from the source
(``sources/gguf.py`` puts them in its config, ``gguf_tensor_types``/``gguf_tensor_shapes``):
the op must read a whole tensor of a GGUF source, first in its chain. An F32 tensor is passed
through unchanged. No inverse: quantizing again is not exact.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial
from math import prod
from typing import Any

from ..quant.gguf_blocks import decodable, dequant_gguf_bytes
from ..quant.pipeline import in_order
from .base import Block, BlockOp, Context, InputTensor, NoInverse, Value, View


class DequantGguf(BlockOp):
    verb = "dequant_gguf"
    kind = "map"
    yields = "either"  # an F32 tensor is its own bytes
    schema = {"type": "object", "additionalProperties": False,
              "properties": {"dtype": {"enum": ["float32"], "default": "float32",
                                       "description": "the output dtype: float32, what gguf-py and transformers' "
                                                      "GGUF loader give"}}}
    description = ("A GGUF source's tensor (F16, BF16, Q4_0..Q8_0, K-quants, I-quants, MXFP4: whatever gguf-py "
                   "decodes) -> float32 in transformers' shape, bit for bit gguf-py's dequantize; F32 unchanged.")

    def inverse(self, args: Any) -> tuple[str, Any]:
        raise NoInverse("dequant_gguf cannot be undone: quantizing again is not exact")

    def describe(self, args: Any) -> str:
        return "dequant_gguf to float32"

    def map(self, args: Any, ctx: Context, value: View) -> Value:
        held = ctx.tensor_of(value)
        types, shapes = ctx.config("gguf_tensor_types"), ctx.config("gguf_tensor_shapes")
        if held is None or not held[2]:
            raise ctx.error("dequant_gguf reads a whole source tensor: put it first in the chain")
        key = held[1]
        if not isinstance(types, dict) or key not in types or not isinstance(shapes, dict):
            raise ctx.error(f"{key!r} is not a tensor of a GGUF source (its config has no gguf_tensor_types "
                            "entry for it); dequant_gguf reads .gguf files", key=key)
        kind, shape = types[key], tuple(shapes[key])
        if kind == "F32":
            return value
        if not decodable(kind):
            raise ctx.error(f"{key!r} is GGUF type {kind}, which gguf-py cannot dequantize; convert the file "
                            "with llama.cpp to another type first", key=key)
        return Block(self, {"type": kind, "dtype": "F32"}, (value,), shape, "F32")

    def blocks(self, block: Block, inputs: Sequence[InputTensor], chunk_bytes: int,
               rows: range | None = None) -> Iterator[bytes | memoryview]:
        (source,) = inputs
        kind, shape = block.args["type"], block.shape
        if len(shape) == 1:  # a vector is one row of blocks: decoded whole (vectors are small)
            values = dequant_gguf_bytes(source.read(0, source.view.nbytes), kind)
            picked = values if rows is None else values[rows.start:rows.stop]
            return iter([memoryview(picked.tobytes())])
        in_row, out_row = source.view.nbytes // shape[0], prod(shape[1:]) * 4
        wanted = rows if rows is not None else range(shape[0])
        stop = min(wanted.stop, shape[0])
        step = max(1, chunk_bytes // max(1, out_row))

        def tasks() -> Iterator[Callable[[], memoryview]]:
            for start in range(wanted.start, stop, step):
                count = min(step, stop - start)
                yield partial(_decode, source.read(start * in_row, count * in_row), kind)
        return in_order(tasks())


def _decode(data: bytes, kind: str) -> memoryview:
    return memoryview(dequant_gguf_bytes(data, kind)).cast("B")
