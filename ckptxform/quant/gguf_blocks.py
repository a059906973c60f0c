"""Decode GGUF tensor bytes to float32, exactly as gguf-py's ``gguf.quants.dequantize``
does (llama.cpp's own Python library): whole rows of blocks at a time, so the caller
bounds memory by how many rows it asks for.

F32/F16/BF16 are widened to float32 (what gguf-py returns for them too); a block format
gguf-py decodes slowly uses the numpy kernel of ``gguf_fast`` (same bytes), every other
one gguf-py's own decoder. A format gguf-py cannot decode is named by ``decodable``.
numpy and gguf are imported when a tensor is decoded: ``ckptxform.ops`` imports this
module, and a plan or a rename imports neither.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

#: widened, not decoded (the numpy dtype of each)
PLAIN = {"F32": "float32", "F16": "float16", "F64": "float64"}


def block_shape(ggml_type: str) -> tuple[int, int]:
    """(values, bytes) of one block of ``ggml_type`` (1 value of its width for a plain type)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]


@lru_cache(maxsize=None)
def decodable(ggml_type: str) -> bool:
    """Whether gguf-py (so this module) can dequantize ``ggml_type``."""
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits

    return ggml_type in PLAIN or ggml_type == "BF16" or (
        ggml_type in GGMLQuantizationType.__members__ and GGMLQuantizationType[ggml_type] in _type_traits)


def dequant_gguf_bytes(data: bytes | memoryview | np.ndarray, ggml_type: str) -> np.ndarray:
    """``data`` (whole blocks of ``ggml_type``) as flat float32 values."""
    import numpy as np

    from .gguf_fast import FAST

    raw = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.view(np.uint8).reshape(-1)
    if ggml_type in PLAIN:
        return raw.view(PLAIN[ggml_type]).astype(np.float32)
    values, size = block_shape(ggml_type)
    if raw.size % size:
        raise ValueError(f"{raw.size} bytes are not whole {ggml_type} blocks of {size} bytes")
    blocks = raw.reshape(-1, size)
    fast = FAST.get(ggml_type)
    with np.errstate(all="ignore"):  # a NaN or inf scale gives what gguf-py gives, silently as it does
        if fast is not None:
            return fast(blocks).reshape(-1)
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        return dequantize(blocks, GGMLQuantizationType[ggml_type]).reshape(-1)
