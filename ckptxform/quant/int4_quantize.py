"""Quantizing rows of a weight to int4 ``pack-quantized`` (compressed-tensors W4A16 and
W4A16_ASYM: weights only, one scale per ``group_size`` columns of a row), exactly as
compressed-tensors 0.20's CPU path does under llm-compressor's ``model_free_ptq``
(tests/test_w4a16_reference.py runs both), on numpy.

Every value below is rounded to the weight's dtype (BF16, F16 or F32) where torch rounds
it: computed in float32, then to nearest even (``rounded``). Per group of a row, with
``lo = min(min(x), 0)`` and ``hi = max(max(x), 0)`` (zero is always representable):

- symmetric: ``scale = max(|lo|, hi) / 7.5``; asymmetric: ``scale = (hi - lo) / 15`` with
  ``hi - lo`` rounded first, and ``zp = round(clamp(-8 - lo / scale, -8, 7))`` (half to
  even, as ``torch.round``), each step rounded. A group of zeros has ``scale`` 0 there, so
  ``lo / scale`` is NaN, which torch's cast to int8 makes 0 (on x86 CPUs): ``zp = 0``.
  A zero scale is then stored as the dtype's epsilon.
- ``q = round(clamp(x / scale [+ zp], -8, 7))``: the quotient, then the sum with the zero
  point, each rounded to the weight's dtype before the clamp and the rounding half to even.
  ``-0.0`` is 0.
- packing (``pack_to_int32``): ``q + 8`` as nibbles, element ``8w + k`` of a row in bits
  ``4k..4k+3`` of word ``w`` (little-endian int32), a short last word padded with zero
  nibbles; the zero point (``zp + 8``) is packed the same way down the rows, so its words
  hold 8 consecutive rows: ``[ceil(rows / 8), groups]``.

Columns must be whole groups (compressed-tensors refuses others); the ops check it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .quantize_shared import eps, finite, rounded, stored, weight_values

if TYPE_CHECKING:
    import numpy as np

__all__ = ["int4_rows", "int4_scale_rows", "int4_zero_point_rows"]

Buffer = bytes | bytearray | memoryview

INT4_MIN, INT4_MAX = -8.0, 7.0


def _groups(weight: Buffer, dtype: str, cols: int, group_size: int) -> np.ndarray:
    """float32 ``[rows, groups, group_size]`` of the weight rows (exact)."""
    x = weight_values(weight, dtype, cols)
    if cols % group_size:
        raise ValueError(f"{cols} columns are not whole groups of {group_size}")
    return x.reshape(x.shape[0], cols // group_size, group_size)


def _qparams(x: np.ndarray, dtype: str, symmetric: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """Per group: the scale (float32, exact in ``dtype``) and, asymmetric, the zero point (float32 integers)."""
    import numpy as np

    lo = np.minimum(finite(x.min(axis=2)), np.float32(0))
    hi = np.maximum(finite(x.max(axis=2)), np.float32(0))
    zp = None
    with np.errstate(divide="ignore", invalid="ignore"):
        if symmetric:
            scale = rounded(np.maximum(-lo, hi) / np.float32(7.5), dtype)
        else:
            scale = rounded(rounded(hi - lo, dtype) / np.float32(15.0), dtype)
            zp = rounded(np.float32(INT4_MIN) - rounded(lo / scale, dtype), dtype)
            zp = np.rint(np.clip(np.nan_to_num(zp, nan=0.0), INT4_MIN, INT4_MAX))
    scale[scale == 0] = np.float32(eps(dtype))
    return scale, zp


def _codes(x: np.ndarray, dtype: str, symmetric: bool) -> np.ndarray:
    """uint8 ``[rows, cols]``: ``q + 8`` of every value (0..15)."""
    import numpy as np

    scale, zp = _qparams(x, dtype, symmetric)
    with np.errstate(over="ignore"):
        q = rounded(x / scale[:, :, None], dtype)
        if zp is not None:
            q = rounded(q + zp[:, :, None], dtype)
    np.clip(q, INT4_MIN, INT4_MAX, out=q)
    q = np.rint(q) + np.float32(8)
    return q.astype(np.uint8).reshape(x.shape[0], -1)


def _pack(nibbles: np.ndarray) -> np.ndarray:
    """uint8 ``[n, m]`` nibbles -> little-endian int32 words ``[n, ceil(m / 8)]``, element
    ``8w + k`` in bits ``4k..4k+3`` of word ``w``, a short last word padded with zeros."""
    import numpy as np

    n, m = nibbles.shape
    words = -(-m // 8)
    if m != words * 8:
        padded = np.zeros((n, words * 8), dtype=np.uint8)
        padded[:, :m] = nibbles
        nibbles = padded
    pairs = nibbles[:, 0::2] | (nibbles[:, 1::2] << np.uint8(4))  # byte j: elements 2j, 2j + 1
    return np.ascontiguousarray(pairs).view("<i4").reshape(n, words)


def int4_rows(weight: Buffer, dtype: str, cols: int, group_size: int, symmetric: bool) -> bytes:
    """The ``weight_packed`` rows (int32, ``ceil(cols / 8)`` a row) of some rows of a weight.

    >>> import numpy as np
    >>> w = np.array([[7.5, -7.5, 1.0, -0.0, 0.5, 2.5, -3.5, 0.0]], dtype=np.float32)
    >>> hex(int(np.frombuffer(int4_rows(w.tobytes(), "F32", 8, 8, True), "<u4")[0]))
    '0x84a8890f'
    """
    return _pack(_codes(_groups(weight, dtype, cols, group_size), dtype, symmetric)).tobytes()


def int4_scale_rows(weight: Buffer, dtype: str, cols: int, group_size: int, symmetric: bool) -> bytes:
    """The ``weight_scale`` rows (the weight's dtype, one a group) of some rows of a weight."""
    scale, _ = _qparams(_groups(weight, dtype, cols, group_size), dtype, symmetric)
    return stored(scale, dtype)


def int4_zero_point_rows(weight: Buffer, dtype: str, cols: int, group_size: int) -> bytes:
    """The packed ``weight_zero_point`` rows (int32 ``[ceil(rows / 8), groups]``) of some
    rows of a weight, which start at a multiple of 8 rows (asymmetric schemes)."""
    import numpy as np

    _, zp = _qparams(_groups(weight, dtype, cols, group_size), dtype, symmetric=False)
    assert zp is not None
    nibbles = (zp + np.float32(8)).astype(np.uint8)  # [rows, groups]
    return np.ascontiguousarray(_pack(np.ascontiguousarray(nibbles.T)).T).tobytes()
