"""gguf_quantize: a float tensor -> the bytes of one GGML type (F32, F16, BF16, Q8_0), as
llama.cpp's ``convert_hf_to_gguf.py`` makes them.

The values go through gguf-py's own quantizers (``gguf.quants.quantize``: llama.cpp's
library; its Q8_0 is bit-exact with ggml's), from the dtype the converter hands them:
F16 and F32 as they are, any other float (BF16) widened to float32 first. The converter's
choice of type is kept too: a tensor of rank 0 or 1 is F32 whatever the type asked for
(llama.cpp's kernels take norms and biases only in F32), and a Q8_0 tensor whose rows are
not a whole number of 32-value blocks falls back to F16. A quantized tensor is written as
U8 rows of its blocks (``[..., cols / 32 * 34]``, gguf-py's byte shape); the GGUF output
(engine/output/gguf) reads its type from the op. Each row is quantized on its own, so a
band of rows at a time gives the bytes of the whole.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from .base import Accepts, Block, BlockOp, Context, InputTensor, NoInverse, Value, View

#: the types the op writes, and the bytes of one block of each and the values in it
GGML_TYPES: dict[str, tuple[int, int]] = {"F32": (4, 1), "F16": (2, 1), "BF16": (2, 1), "Q8_0": (34, 32)}
_FLOATS = frozenset({"BF16", "F16", "F32", "F64"})


def ggml_type_of(requested: str, shape: tuple[int, ...]) -> str:
    """The type llama.cpp's converter writes a tensor of ``shape`` in when ``requested``."""
    if len(shape) <= 1:
        return "F32"
    values = GGML_TYPES[requested][1]
    if shape[-1] % values:
        return "F16"  # llama.cpp: "... falling back to F16" (gguf.QuantError)
    return requested


def byte_shape(ggml_type: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the op's output: the tensor's own, or for a block type U8 rows of blocks."""
    size, values = GGML_TYPES[ggml_type]
    return shape if values == 1 else (*shape[:-1], shape[-1] // values * size)


class GgufQuantize(BlockOp):
    verb = "gguf_quantize"
    schema = {"type": "object", "additionalProperties": False, "required": ["type"],
              "properties": {"type": {"enum": sorted(GGML_TYPES),
                                      "description": "the GGML type (llama.cpp's --outtype); rank <= 1 tensors are "
                                                     "always F32 and Q8_0 rows that are not whole blocks F16, as "
                                                     "llama.cpp's converter writes them"}}}
    description = ("Quantize a float tensor to a GGML type with gguf-py's quantizers (F32, F16, BF16, Q8_0), "
                   "as convert_hf_to_gguf.py does; for a GGUF output.")
    accepts = Accepts(dtypes=_FLOATS)
    action = "quantized"

    def map(self, args: Any, ctx: Context, value: View) -> Value:
        ggml_type = ggml_type_of(args["type"], value.shape)
        dtype = "U8" if GGML_TYPES[ggml_type][1] > 1 else ggml_type
        return Block(self, {"ggml_type": ggml_type, "requested": args["type"]}, (value,),
                     byte_shape(ggml_type, value.shape), dtype)

    def inverse(self, args: Any) -> tuple[str, Any]:
        raise NoInverse("gguf_quantize rounds the values to a GGML type; read the GGUF back with gguf_to_hf")

    def describe(self, args: Any) -> str:
        return f"gguf_quantize {args['type']}"

    def blocks(self, block: Block, inputs: Sequence[InputTensor], chunk_bytes: int,
               rows: range | None = None) -> Iterator[bytes | memoryview]:
        import numpy as np  # here, not at the top: planning never imports numpy or gguf

        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        (source,) = inputs
        view = source.view
        qtype = GGMLQuantizationType[block.args["ggml_type"]]
        if len(view.shape) <= 1:  # one band: a norm or a bias is small
            yield np.ascontiguousarray(quantize(_values(source.read(0, view.nbytes), view.dtype), qtype)).tobytes()
            return
        row = view.row_nbytes
        wanted = rows if rows is not None else range(view.shape[0])
        step = max(1, chunk_bytes // max(1, row))
        for first in range(wanted.start, wanted.stop, step):
            count = min(step, wanted.stop - first)
            values = _values(source.read(first * row, count * row), view.dtype).reshape(count, *view.shape[1:])
            yield np.ascontiguousarray(quantize(values, qtype)).tobytes()


def _values(raw: bytes | memoryview, dtype: str) -> Any:
    """The values as llama.cpp's converter hands them to gguf-py: F16 and F32 as they are,
    anything else in float32 (BF16 widened by a shift of its bits: exact)."""
    import numpy as np

    if dtype == "BF16":
        return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    if dtype == "F64":
        return np.frombuffer(raw, dtype="<f8").astype(np.float32)
    return np.frombuffer(raw, dtype="<f2" if dtype == "F16" else "<f4").copy()
