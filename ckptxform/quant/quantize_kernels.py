"""Quantizing a bounded block of weight rows exactly as compressed-tensors 0.20's CPU path
does (what llm-compressor's ``model_free_ptq`` writes), on numpy (torch is not needed).

The weight is BF16, F16 or F32 (``dtype``); every rounding is the one torch makes on the
CPU for that dtype, each spelled out below (tests/test_quantize_reference.py checks them
against compressed-tensors itself). "Rounded to the weight's dtype" means: computed in
float32 (torch's CPU arithmetic for bf16/f16 upcasts), then rounded to nearest even.

FP8 e4m3 (``FP8_BLOCK``: a scale per ``bh x bw`` block; ``FP8_DYNAMIC``: a scale per row),
the scale stored in the weight's dtype:

- ``scale = absmax(block) / 448``, rounded to the weight's dtype (a partial edge block's
  absmax is over its real elements: compressed-tensors pads with zeros, which change no
  absmax); a zero scale (an all-zero block) is stored as the dtype's epsilon.
  ``Fp8Block`` gives the block; one scale per row is ``block_rows = 1, block_cols = cols``.
- ``q = e4m3(clamp(round_w(x / scale), -448, 448))``: the quotient is rounded to the
  weight's dtype BEFORE the cast to e4m3 (the CPU path; a GPU kernel that casts the
  float32 quotient directly may differ in the last bit), both to nearest even. The sign
  of zero is kept: ``-0.0`` and a negative value that rounds to zero are ``0x80``.

NVFP4 (``nvfp4-pack-quantized``: e2m1 codes two a byte, an e4m3 scale per 16 columns and
one float32 ``weight_global_scale`` per tensor, or per fused set: q/k/v, gate/up):

- ``global = round_w(round_w(1 / absmax) * 2688)`` (448 * 6; torch computes ``c / t`` as
  ``t.reciprocal() * c``), absmax at least the dtype's smallest normal; an all-zero set
  is 1.0. An F16 quotient that overflows (absmax < ~0.041) is computed in float32 instead
  (compressed-tensors' own dtype for it: its 1.0 fallback would zero a third of the
  weight), and a nonzero set whose float32 quotient overflows too is refused.
- ``s = e4m3(clamp(f32(global * round_w(absmax(group) / 6)), -448, 448))``, 0 stored as 0.125.
- ``code = e2m1(clamp(f32(x / f32(f32(s) / global)), -6, 6))``, ties to even; the sign bit is
  set for a NEGATIVE quotient only: a negative value that rounds to zero is code 8
  (``-0.0``), but an input of ``-0.0`` is code 0 (compressed-tensors multiplies by
  ``sign(x)``, which is 0 there).

Non-finite weights are refused (``NonFiniteWeight``): their codes would be meaningless.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from .fp4 import pack_e2m1
from .layouts import Fp8Block
from .quantize_shared import FP4_MAX, FP8_MAX, WEIGHT_DTYPES, NonFiniteWeight, UnscalableWeight, eps
from .quantize_shared import bits16 as _bits16
from .quantize_shared import finite as _finite
from .quantize_shared import rounded as _round
from .quantize_shared import stored as _stored
from .quantize_shared import weight_values as _values

if TYPE_CHECKING:
    import numpy as np

__all__ = ["FP4_MAX", "FP8_MAX", "NonFiniteWeight", "UnscalableWeight", "WEIGHT_DTYPES", "absmax", "eps", "fp8_rows", "fp8_scale_rows",
           "nvfp4_global_scale", "nvfp4_rows", "nvfp4_scale_rows"]

Buffer = bytes | bytearray | memoryview

NVFP4_GROUP = 16
#: what a zero e4m3 scale of NVFP4 becomes (compressed-tensors' eps for float8_e4m3fn)
_FP8_SCALE_EPS = 0.125


def _e4m3(values: np.ndarray) -> np.ndarray:
    """float32 values within +-448 as e4m3fn bytes (uint8), to nearest even."""
    import ml_dtypes
    import numpy as np

    return values.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def _e4m3_values(codes: np.ndarray) -> np.ndarray:
    import ml_dtypes
    import numpy as np

    return codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)


@functools.cache
def _e4m3_of_bits(dtype: str) -> np.ndarray:
    """uint8 [65536]: the e4m3 code of every BF16 or F16 pattern clamped to +-448: the
    cast of a quotient already rounded to that dtype is one table lookup."""
    import numpy as np

    bits = np.arange(1 << 16, dtype=np.uint32)
    values = (bits << np.uint32(16)).view(np.float32) if dtype == "BF16" else \
        bits.astype(np.uint16).view(np.float16).astype(np.float32)
    with np.errstate(invalid="ignore"):
        return _e4m3(np.clip(values, -FP8_MAX, FP8_MAX))


# -- FP8 ------------------------------------------------------------------------------

def _on_torch() -> Any:
    """``quantize_torch`` where dequantization runs on torch too (``kernels.backend``), else
    None: the numpy kernels below (the light install, or ``CKPTXFORM_NUMERIC=numpy``)."""
    from .kernels import backend

    if backend().__name__.endswith(".torch_kernels"):
        from . import quantize_torch

        return quantize_torch
    return None


def _fp8_blocks(x: np.ndarray, layout: Fp8Block) -> np.ndarray:
    """``x`` as [block rows, bh, block cols, bw], zero-padded where an edge block is
    partial (zeros change no absmax, and their codes are cut off again)."""
    import numpy as np

    rows, cols = x.shape
    bh, bw = layout.block_rows, layout.block_cols
    sr, sc = layout.scale_rows(rows), layout.scale_cols
    if rows % bh or cols % bw:
        padded = np.zeros((sr * bh, sc * bw), dtype=np.float32)
        padded[:rows, :cols] = x
        x = padded
    return x.reshape(sr, bh, sc, bw)


def _fp8_scales(blocks: np.ndarray, dtype: str) -> np.ndarray:
    """float32 ``[block rows, block cols]``: each block's scale, rounded to ``dtype``."""
    import numpy as np

    amax = _finite(np.maximum(blocks.max(axis=(1, 3)), -blocks.min(axis=(1, 3))))
    scale = _round(amax / np.float32(FP8_MAX), dtype)
    scale[scale == 0] = np.float32(eps(dtype))
    return scale


def fp8_scale_rows(weight: Buffer, dtype: str, layout: Fp8Block) -> bytes:
    """The scale rows (in ``dtype``) of whole block rows of a weight."""
    if (fast := _on_torch()) is not None:
        return fast.fp8_scale_rows(weight, dtype, layout)
    return _stored(_fp8_scales(_fp8_blocks(_values(weight, dtype, layout.cols), layout), dtype), dtype)


def fp8_rows(weight: Buffer, dtype: str, layout: Fp8Block) -> memoryview:
    """The e4m3 codes of whole block rows of a weight (each block by its own scale).

    >>> import numpy as np
    >>> w = np.array([[1.0, -0.5, 0.0, -0.0]], dtype=np.float32)
    >>> bytes(fp8_rows(w.tobytes(), "F32", Fp8Block(cols=4, block_rows=1, block_cols=4))).hex()
    '7ef60080'
    """
    if (fast := _on_torch()) is not None:
        return fast.fp8_rows(weight, dtype, layout)
    import numpy as np

    x = _values(weight, dtype, layout.cols)
    blocks = _fp8_blocks(x, layout)
    blocks /= _fp8_scales(blocks, dtype)[:, None, :, None]  # x is scratch: divided in place
    if dtype == "F32":
        np.clip(blocks, -FP8_MAX, FP8_MAX, out=blocks)
        codes = _e4m3(blocks)
    else:
        codes = _e4m3_of_bits(dtype)[_bits16(blocks, dtype)]
    sr, bh, sc, bw = blocks.shape
    return memoryview(np.ascontiguousarray(codes.reshape(sr * bh, sc * bw)[:x.shape[0], :layout.cols]).reshape(-1))


# -- NVFP4 ----------------------------------------------------------------------------

def absmax(weight: Buffer, dtype: str, cols: int) -> float:
    """The largest magnitude of some rows of a weight (0.0 for none)."""
    import numpy as np

    x = _values(weight, dtype, cols)
    return float(_finite(np.array(max(x.max(), -x.min())))) if x.size else 0.0


def nvfp4_global_scale(amax: float, dtype: str) -> float:
    """The float32 ``weight_global_scale`` of a tensor (or fused set) of absmax ``amax``.

    In the weight's dtype, as llm-compressor's model-free path hands compressed-tensors'
    ``generate_gparam`` the weight's own statistics, except where an F16 quotient overflows
    (absmax below 2688 / 65504, about 0.041): there in float32, as ``generate_gparam``
    computes from float32 statistics (its fallback of 1.0 for the overflow would put a
    third of such a weight's values at 0). An all-zero set is 1.0; a nonzero absmax whose
    quotient overflows even float32 (below about 7.9e-36) raises ``UnscalableWeight``.

    >>> nvfp4_global_scale(0.0, "BF16"), nvfp4_global_scale(1.0, "BF16"), nvfp4_global_scale(0.0123, "F16")
    (1.0, 2688.0, 218536.609375)
    """
    import numpy as np

    if amax == 0.0:
        return 1.0
    value = _quotient(amax, dtype)
    if not np.isfinite(value) and dtype == "F16":
        value = _quotient(amax, "F32")
    if not np.isfinite(value):
        raise UnscalableWeight(f"absmax {amax!r}: 2688 / absmax overflows float32")
    return value


def _quotient(amax: float, dtype: str) -> float:
    """``2688 / max(amax, tiny)`` as torch computes it in ``dtype`` (``t.reciprocal() * c``)."""
    import numpy as np

    tiny = float(np.finfo(np.float16 if dtype == "F16" else np.float32).tiny)
    with np.errstate(over="ignore", divide="ignore"):
        inv = _round(np.array([1.0], np.float32) / np.float32(max(amax, tiny)), dtype)
        return float(_round(inv * np.float32(FP8_MAX * FP4_MAX), dtype)[0])


def _nvfp4_scales(x: np.ndarray, global_scale: float, dtype: str) -> np.ndarray:
    """e4m3 codes (uint8) ``[rows, cols / 16]`` of the group scales."""
    import numpy as np

    rows, cols = x.shape
    if cols % NVFP4_GROUP:
        raise ValueError(f"{cols} columns are not whole groups of {NVFP4_GROUP}")
    amax = _finite(np.abs(x).reshape(rows, cols // NVFP4_GROUP, NVFP4_GROUP).max(axis=2))
    scale = _round(amax / np.float32(FP4_MAX), dtype) * np.float32(global_scale)
    np.clip(scale, -FP8_MAX, FP8_MAX, out=scale)
    codes = _e4m3(scale)
    codes[codes == 0] = _e4m3(np.array([_FP8_SCALE_EPS], np.float32))[0]
    return codes


def nvfp4_scale_rows(weight: Buffer, dtype: str, cols: int, global_scale: float) -> bytes:
    """The e4m3 ``weight_scale`` rows of some rows of a weight."""
    return _nvfp4_scales(_values(weight, dtype, cols), global_scale, dtype).tobytes()


def nvfp4_rows(weight: Buffer, dtype: str, cols: int, global_scale: float) -> bytes:
    """The ``weight_packed`` rows (two e2m1 codes a byte, low nibble first) of some rows.

    >>> import numpy as np
    >>> w = np.array([[6.0, -3.0, 0.1, -0.1] + [0.0] * 12], dtype=np.float32)
    >>> nvfp4_rows(w.tobytes(), "F32", 16, 1.0).hex()[:4]
    'd780'
    """
    import numpy as np

    x = _values(weight, dtype, cols)
    rows = x.shape[0]
    scales = _e4m3_values(_nvfp4_scales(x, global_scale, dtype)) / np.float32(global_scale)
    q = x.reshape(rows, cols // NVFP4_GROUP, NVFP4_GROUP) / scales[:, :, None]
    np.clip(q, -FP4_MAX, FP4_MAX, out=q)
    return pack_e2m1(_e2m1_codes(q.reshape(rows, cols))).tobytes()


#: the e2m1 magnitudes' rounding bounds and whether a value ON the bound rounds up (ties to
#: even: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4)
_E2M1_BOUNDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def _e2m1_codes(q: np.ndarray) -> np.ndarray:
    """Codes 0..15 of float32 values within +-6: magnitude code plus 8 for a negative value."""
    import numpy as np

    a = np.abs(q)
    codes = np.zeros(q.shape, dtype=np.uint8)
    for bound, up in _E2M1_BOUNDS:
        codes += (a >= bound) if up else (a > bound)
    codes |= (q < 0).astype(np.uint8) << 3
    return codes
