"""Raw tensor bytes <-> values, for the programs that decode: numpy (with ml_dtypes for
bf16 and fp8), so casts and mean fills run without torch and give torch's bytes.

Where numpy's conversions and torch's differ, torch's are kept: a float cast to
F8_E4M3 saturates at +-448 as torch's does (ml_dtypes makes NaN of what overflows). NaN
stays NaN, but its payload bits are not torch's: torch's own depend on the array's
length (F64 -> BF16 gives 0x7FC0 for one element, 0xFFFF for 64), so no fixed rule
can match them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TORCH_EXTRA", "cast_bytes", "require_torch", "tensor_bytes", "values_of"]

#: what to install when an input or an op needs torch
TORCH_EXTRA = "pip install 'ckptxform[torch]'"

_E4M3_MAX = 448.0


def require_torch(what: str) -> Any:
    """The torch module, or one ``CkptxformError`` line naming the extra to install."""
    try:
        import torch
    except ImportError:
        from ..errors import CkptxformError

        raise CkptxformError(f"{what} needs torch, which is not installed; {TORCH_EXTRA}") from None
    return torch


def values_of(raw: bytes | bytearray | memoryview, dtype: str) -> Any:
    """A read-only numpy array over the raw little-endian bytes of ``dtype`` values (no copy)."""
    import numpy as np

    from ..dtypes import numpy_dtype

    return np.frombuffer(raw, dtype=numpy_dtype(dtype))


def tensor_bytes(tensor: Any) -> bytes:
    """The raw bytes of a CPU torch tensor (or a numpy array)."""
    if hasattr(tensor, "tobytes"):
        return tensor.tobytes()
    import ctypes

    tensor = tensor.contiguous()
    return ctypes.string_at(tensor.data_ptr(), tensor.numel() * tensor.element_size())


def cast_bytes(raw: bytes | bytearray | memoryview, src: str, dst: str) -> bytes:
    """Elementwise dtype conversion of raw little-endian tensor bytes, rounding to
    nearest even (the plan refuses casts that could change an integer)."""
    import numpy as np

    from ..dtypes import is_float, numpy_dtype

    values = values_of(raw, src)
    with np.errstate(all="ignore"):  # overflow to inf and NaN are values, not errors
        if dst == "F8_E4M3" and is_float(src):
            # torch saturates (ml_dtypes makes NaN): clipped in float32, as torch converts
            values = np.clip(values.astype(np.float32), -_E4M3_MAX, _E4M3_MAX)
        return values.astype(numpy_dtype(dst)).tobytes()
