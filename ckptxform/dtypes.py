"""safetensors dtype names and their sizes; the torch mapping is imported lazily."""

from __future__ import annotations

from typing import Any

# Bytes per element of every dtype the safetensors format defines.
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}

# The names users write in rule files (torch-style), mapped to safetensors names.
USER_DTYPES: dict[str, str] = {
    "bfloat16": "BF16",
    "float16": "F16",
    "float32": "F32",
    "float64": "F64",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


def nbytes(dtype: str, shape: tuple[int, ...] | list[int]) -> int:
    n = DTYPE_SIZES[dtype]
    for dim in shape:
        n *= dim
    return n


def torch_dtype(dtype: str) -> Any:
    """The torch dtype for a safetensors dtype name (imports torch)."""
    import torch

    table = {
        "BOOL": torch.bool,
        "U8": torch.uint8,
        "I8": torch.int8,
        "I16": torch.int16,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I32": torch.int32,
        "F32": torch.float32,
        "I64": torch.int64,
        "F64": torch.float64,
        "F8_E5M2": torch.float8_e5m2,
        "F8_E4M3": torch.float8_e4m3fn,
    }
    return table[dtype]


def from_torch_dtype(dt: Any) -> str:
    """The safetensors dtype name for a torch dtype."""
    name = str(dt).removeprefix("torch.")
    special = {"float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
    if name in special:
        return special[name]
    return USER_DTYPES[name]
