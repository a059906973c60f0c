"""What the quantize dispatcher (``quantize_kernels``, numpy) and its torch backend
(``quantize_torch``) share: the weight dtypes, the e4m3/e2m1 limits, the scale a zero
block gets and the refusal of non-finite weights. A leaf: both import it, it imports
neither."""

from __future__ import annotations

#: the weight dtypes quantized (safetensors names); the FP8 scale takes the weight's
WEIGHT_DTYPES = ("BF16", "F16", "F32")
FP8_MAX = 448.0
FP4_MAX = 6.0


class NonFiniteWeight(ValueError):
    """A NaN or infinite weight value: quantizing it is meaningless."""


def eps(dtype: str) -> float:
    """The machine epsilon of a weight dtype: the scale compressed-tensors stores for an
    all-zero block (``torch.finfo(dtype).eps``).

    >>> eps("BF16"), eps("F16")
    (0.0078125, 0.0009765625)
    """
    return {"BF16": 2.0 ** -7, "F16": 2.0 ** -10, "F32": 2.0 ** -23}[dtype]
