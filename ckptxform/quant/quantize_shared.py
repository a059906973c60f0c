"""What the quantize kernels share: the weight dtypes, the e4m3/e2m1 limits, the scale a
zero block gets, the refusal of non-finite weights, and the weight's values with torch's
CPU roundings spelled out on numpy (``rounded``: a BF16/F16 result is computed in float32
and rounded once, to nearest even). A leaf: the dispatcher (``quantize_kernels``), its
torch backend (``quantize_torch``) and the int4 kernels (``int4_quantize``) import it, it
imports none of them."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

Buffer = bytes | bytearray | memoryview

#: the weight dtypes quantized (safetensors names); the FP8 scale takes the weight's
WEIGHT_DTYPES = ("BF16", "F16", "F32")
FP8_MAX = 448.0
FP4_MAX = 6.0


class NonFiniteWeight(ValueError):
    """A NaN or infinite weight value: quantizing it is meaningless."""


class UnscalableWeight(ValueError):
    """A nonzero weight too small for any float32 NVFP4 global scale (2688 / absmax overflows)."""


def eps(dtype: str) -> float:
    """The machine epsilon of a weight dtype: the scale compressed-tensors stores for an
    all-zero block (``torch.finfo(dtype).eps``).

    >>> eps("BF16"), eps("F16")
    (0.0078125, 0.0009765625)
    """
    return {"BF16": 2.0 ** -7, "F16": 2.0 ** -10, "F32": 2.0 ** -23}[dtype]


def weight_values(weight: Buffer, dtype: str, cols: int) -> np.ndarray:
    """float32 ``[rows, cols]`` of the weight bytes (exact). Non-finite values are found
    by the callers from the block maxima (a NaN or inf makes its maximum non-finite)."""
    import numpy as np

    if dtype == "BF16":
        import ml_dtypes

        out = np.frombuffer(weight, dtype=ml_dtypes.bfloat16).astype(np.float32)
    elif dtype in ("F16", "F32"):
        out = np.frombuffer(weight, dtype="<f2" if dtype == "F16" else "<f4").astype(np.float32)
    else:
        raise ValueError(f"weight dtype {dtype!r} is not one of {', '.join(WEIGHT_DTYPES)}")
    if cols == 0 or out.size % cols:
        raise ValueError(f"{out.size} values are not whole rows of {cols}")
    return out.reshape(-1, cols)


def finite(maxima: np.ndarray) -> np.ndarray:
    import numpy as np

    if not np.isfinite(maxima).all():
        raise NonFiniteWeight("the weight holds NaN or infinite values")
    return maxima


def bits16(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 ``values`` rounded to nearest even in BF16 or F16: the uint16 patterns."""
    import numpy as np

    if dtype == "F16":
        with np.errstate(over="ignore"):
            return values.astype(np.float16).view(np.uint16)
    import ml_dtypes

    return values.astype(ml_dtypes.bfloat16).view(np.uint16)  # to nearest even


def rounded(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 ``values`` rounded to nearest even in ``dtype``, as float32 again (exact)."""
    import numpy as np

    if dtype == "F32":
        return values
    if dtype == "F16":
        return bits16(values, dtype).view(np.float16).astype(np.float32)
    return (bits16(values, dtype).astype(np.uint32) << np.uint32(16)).view(np.float32)


def stored(values: np.ndarray, dtype: str) -> bytes:
    """float32 values exact in ``dtype``, as that dtype's bytes."""
    import numpy as np

    if dtype == "BF16":
        return (values.view(np.uint32) >> np.uint32(16)).astype("<u2").tobytes()
    return values.astype("<f2" if dtype == "F16" else "<f4").tobytes()
