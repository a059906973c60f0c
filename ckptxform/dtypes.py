"""safetensors dtype names and their sizes; the numpy and torch mappings are imported lazily."""

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


# The dtypes whose values ckptxform can decode (casts, numeric fills), by torch name; the
# others (U16, U32, U64, F8_E8M0) are copied and permuted as bytes only.
_TORCH_NAMES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "F32": "float32",
    "I64": "int64",
    "F64": "float64",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
}

# Integer ranges, and the largest integer each float holds exactly (2 ** significand bits).
_INT_RANGES: dict[str, tuple[int, int]] = {
    "BOOL": (0, 1), "U8": (0, 2**8 - 1), "I8": (-(2**7), 2**7 - 1), "I16": (-(2**15), 2**15 - 1),
    "U16": (0, 2**16 - 1), "I32": (-(2**31), 2**31 - 1), "U32": (0, 2**32 - 1),
    "I64": (-(2**63), 2**63 - 1), "U64": (0, 2**64 - 1),
}
_FLOAT_EXACT: dict[str, int] = {
    "F8_E5M2": 2**3, "F8_E4M3": 2**4, "BF16": 2**8, "F16": 2**11, "F32": 2**24, "F64": 2**53,
}


def decodable(dtype: str) -> bool:
    """Whether values of ``dtype`` can be decoded (a cast, a mean or normal fill)."""
    return dtype in _TORCH_NAMES


def cast_problem(src: str, dst: str) -> str | None:
    """Why casting ``src`` values to ``dst`` may change them (None when every value
    survives). Float to narrower float is allowed: that rounding is what a cast is for."""
    if src == dst:
        return None
    for dtype in (src, dst):
        if not decodable(dtype):
            return f"{dtype} values cannot be decoded (ckptxform has no torch dtype for it)"
    if src in _FLOAT_EXACT and dst in _INT_RANGES:
        return f"{src} -> {dst} would drop every fraction and clip the range"
    if src in _INT_RANGES and dst in _FLOAT_EXACT:
        low, high = _INT_RANGES[src]
        if max(-low, high) > _FLOAT_EXACT[dst]:
            return (f"{src} holds integers up to {high:,}, {dst} holds them exactly only up to "
                    f"{_FLOAT_EXACT[dst]:,} (ids and offsets would change)")
    if src in _INT_RANGES and dst in _INT_RANGES:
        (low, high), (dst_low, dst_high) = _INT_RANGES[src], _INT_RANGES[dst]
        if low < dst_low or high > dst_high:
            return f"{dst} holds {dst_low:,}..{dst_high:,}, not every {src} value ({low:,}..{high:,})"
    return None


def int_range(dtype: str) -> tuple[int, int]:
    """The least and greatest value of an integer dtype (BOOL: 0 and 1)."""
    return _INT_RANGES[dtype]


def is_float(dtype: str) -> bool:
    return dtype in _FLOAT_EXACT


def numpy_dtype(dtype: str) -> Any:
    """The numpy dtype for a decodable safetensors dtype name (bf16 and fp8 from ml_dtypes)."""
    import numpy as np

    if dtype in ("BF16", "F8_E4M3", "F8_E5M2"):
        import ml_dtypes

        return np.dtype({"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
                         "F8_E5M2": ml_dtypes.float8_e5m2}[dtype])
    return np.dtype("bool" if dtype == "BOOL" else _TORCH_NAMES[dtype]).newbyteorder("<")


def from_numpy_dtype(dt: Any) -> str:
    """The safetensors dtype name for a numpy (or ml_dtypes) dtype."""
    for name in _TORCH_NAMES:
        if numpy_dtype(name) == dt:
            return name
    raise ValueError(f"numpy dtype {dt} has no safetensors name")


def torch_dtype(dtype: str) -> Any:
    """The torch dtype for a decodable safetensors dtype name (imports torch)."""
    import torch

    return getattr(torch, _TORCH_NAMES[dtype])


def from_torch_dtype(dt: Any) -> str:
    """The safetensors dtype name for a torch dtype."""
    name = str(dt).removeprefix("torch.")
    special = {"float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
    if name in special:
        return special[name]
    return USER_DTYPES[name]
