"""The tensors of a GGUF file ckptxform wrote, as ``verify`` checks them: key, dtype and
shape as the audit records them (a block type as its U8 rows of blocks), absolute offset
and byte count. Read with gguf-py's ``GGUFReader``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ....errors import CheckpointFormatError


@dataclass(frozen=True)
class GgufTensor:
    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def gguf_tensors(path: Path, label: str) -> list[GgufTensor]:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as err:
        raise CheckpointFormatError(f"{label}: not a readable GGUF file ({err})", path=str(path)) from None
    out = []
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        name = t.tensor_type.name
        if name in ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"):
            dtype = name
        else:
            dtype, shape = "U8", tuple(gguf.quant_shape_to_byte_shape(shape, t.tensor_type))
        out.append(GgufTensor(t.name, dtype, shape, int(t.data_offset), int(t.n_bytes)))
    return out
