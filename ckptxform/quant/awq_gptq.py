"""AutoAWQ (GEMM) and GPTQ int4 storage: unpacking, dequantizing a band of columns exactly as
their reference kernels do on the CPU, and repacking nibbles into compressed-tensors'
``pack-quantized`` layout without a float round trip. numpy (the light install runs it); the
float part of the dequantization on torch where it is installed (quant/awq_gptq_torch.py).
The dequantization takes a band of the source's columns and writes ``nn.Linear``'s rows: the
packed words are transposed (4 bytes for 8 codes), then a cache-sized sub-band of rows goes
from codes to output in one pass.

Both store ``[in, out]`` (the transpose of ``nn.Linear.weight``), 4-bit codes in int32 words:

- AutoAWQ GEMM: ``qweight`` ``[in, out/8]`` and ``qzeros`` ``[in/group, out/8]`` packed along
  the columns in AWQ's order: nibble ``i`` (bits ``4i..4i+3``) of word ``w`` is column
  ``8w + AWQ_ORDER[i]``; ``scales`` ``[in/group, out]``. ``w = (q - z) * s``
  (``awq.utils.packing_utils.dequantize_gemm``).
- GPTQ (v1, ``checkpoint_format: gptq``): ``qweight`` ``[in/8, out]`` packed along the rows in
  natural order (nibble ``k`` of word ``[r, c]`` is row ``8r + k``), ``qzeros``
  ``[groups, out/8]`` along the columns in natural order, stored one below the zero point
  (the v1 offset), ``scales`` ``[groups, out]``, ``g_idx`` ``[in]`` (each row's group; any
  order when ``desc_act``). ``w[r] = s[g_idx[r]] * (q[r] - (z[g_idx[r]] + 1))`` (auto-gptq's
  ``QuantLinear`` CPU path).

The integer difference is exact in int8, its product with the scale is rounded once to the
scale's dtype (as torch's int8 x float16 product is), then cast to the output dtype.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from ..dtypes import DTYPE_SIZES
from .numpy_kernels import as_float32, rounded_array

Buffer = bytes | bytearray | memoryview

#: nibble i of an AWQ word holds column AWQ_ORDER[i] of its eight
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: column k of an AWQ word's eight is nibble AWQ_REVERSE_ORDER[k]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def nibbles(words: np.ndarray) -> np.ndarray:
    """uint8 ``[..., 8n]``: nibble ``i`` of word ``w`` of ``words`` (uint32 ``[..., n]``) at ``8w + i``."""
    raw = np.ascontiguousarray(words).view(np.uint8)
    out = np.empty((*raw.shape[:-1], raw.shape[-1] * 2), dtype=np.uint8)
    np.bitwise_and(raw, np.uint8(0xF), out=out[..., 0::2])
    np.right_shift(raw, np.uint8(4), out=out[..., 1::2])
    return out


def awq_columns(words: np.ndarray) -> np.ndarray:
    """AWQ-packed words ``[r, n]`` -> codes ``[r, 8n]`` in column order."""
    codes = nibbles(words)
    return codes.reshape(*codes.shape[:-1], -1, 8)[..., list(AWQ_REVERSE_ORDER)].reshape(codes.shape)


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 codes ``[..., 8n]`` (each < 16) -> uint32 words ``[..., n]``, code ``8w + i`` in nibble ``i``."""
    c = np.ascontiguousarray(codes, dtype=np.uint8)
    pairs = c[..., 0::2] | (c[..., 1::2] << np.uint8(4))
    return np.ascontiguousarray(pairs).view("<u4")


def pack_down_rows(codes: np.ndarray) -> np.ndarray:
    """codes ``[8k, cols]`` -> words ``[k, cols]``, nibble ``i`` of word ``[w, c]`` row ``8w + i``
    (GPTQ's qweight layout; transposed, compressed-tensors' ``weight_packed``)."""
    k = codes.shape[0] // 8
    return pack_nibbles(codes.reshape(k, 8, codes.shape[1]).transpose(0, 2, 1)).reshape(k, codes.shape[1])


def _words(raw: Buffer, cols: int) -> np.ndarray:
    return np.frombuffer(raw, dtype="<u4").reshape(-1, cols)


#: codes of output rows decoded at once: a sub-band's codes and values stay in the cache
SUB_BAND = 1 << 18
#: scale bytes as signed integers of their size (torch reads them back as the float dtype)
_SCALE_BITS = {2: "<i2", 4: "<i4"}


def dequant_awq_columns(qweight: Buffer, qzeros: Buffer, scales: Buffer, *, rows: int, cols: int, group: int,
                        scale_dtype: str, out_dtype: str) -> memoryview:
    """Columns of the ``[in, out]`` weight (``rows`` = in, ``cols`` of them, a multiple of 8)
    from their ``qweight`` words ``[rows, cols/8]``, ``qzeros`` ``[rows/group, cols/8]`` and
    ``scales`` ``[rows/group, cols]``, as the rows ``[cols, rows]`` of ``nn.Linear``'s weight.

    >>> q = np.array([[0x76543210]], dtype="<u4")  # nibble i (value i) holds column AWQ_ORDER[i]
    >>> out = dequant_awq_columns(q.tobytes(), np.zeros(1, "<u4").tobytes(), np.ones(8, "<f2").tobytes(),
    ...                           rows=1, cols=8, group=1, scale_dtype="F16", out_dtype="F32")
    >>> np.frombuffer(out, "<f4").tolist()
    [0.0, 4.0, 1.0, 5.0, 2.0, 6.0, 3.0, 7.0]
    """
    words = np.ascontiguousarray(_words(qweight, cols // 8).T)  # [cols/8, rows]: 8 output rows a word row

    def codes(lo: int, hi: int) -> np.ndarray:
        raw = words[lo // 8:hi // 8].view(np.uint8).reshape(-1, rows, 4)
        out = np.empty((raw.shape[0], 8, rows), dtype=np.uint8)
        for byte in range(4):  # nibble 2b and 2b + 1 of each word: output rows AWQ_ORDER[...] of its eight
            np.bitwise_and(raw[:, :, byte], np.uint8(0xF), out=out[:, AWQ_ORDER[2 * byte]])
            np.right_shift(raw[:, :, byte], np.uint8(4), out=out[:, AWQ_ORDER[2 * byte + 1]])
        return out.reshape(hi - lo, rows)

    zeros = awq_columns(_words(qzeros, cols // 8)).astype(np.int16).T
    return _dequantized(codes, zeros, scales, group, rows=rows, cols=cols, scale_dtype=scale_dtype,
                        out_dtype=out_dtype)


def gptq_zero_points(qzeros: np.ndarray) -> np.ndarray:
    """GPTQ v1 qzeros words ``[g, out/8]`` -> zero points ``[g, out]`` (int16): the stored
    nibble plus one, as auto-gptq adds it (a stored 15 is 16)."""
    return nibbles(qzeros).astype(np.int16) + 1


def dequant_gptq_columns(qweight: Buffer, qzeros: Buffer, scales: Buffer, groups: int | np.ndarray, *, rows: int,
                         cols: int, scale_dtype: str, out_dtype: str) -> memoryview:
    """Columns of the ``[in, out]`` weight (``rows`` = in, a multiple of 8; ``cols`` of them,
    a multiple of 8) from their ``qweight`` words ``[rows/8, cols]``, ``qzeros``
    ``[g, cols/8]`` and ``scales`` ``[g, cols]``, as the rows ``[cols, rows]`` of ``nn.Linear``'s
    weight. ``groups``: each input row's group (int64 ``[rows]``, any order), or the rows a
    group spans when they come in order and ``rows`` is whole groups.

    >>> q = np.full((1, 8), 0x76543210, dtype="<u4")  # rows 0..7 of 8 columns
    >>> out = dequant_gptq_columns(q.tobytes(), np.full(1, 0x77777777, "<u4").tobytes(), np.ones(8, "<f2").tobytes(),
    ...                            8, rows=8, cols=8, scale_dtype="F16", out_dtype="F32")
    >>> np.frombuffer(out, "<f4").reshape(8, 8)[0].tolist()
    [-8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0]
    """
    # [cols, rows/8]: nibble k of word [c, r] is input row 8r + k, so the nibbles fall in order
    words = np.ascontiguousarray(_words(qweight, cols).T)
    zeros = gptq_zero_points(_words(qzeros, cols // 8)).T
    return _dequantized(lambda lo, hi: nibbles(words[lo:hi]), zeros, scales, groups, rows=rows, cols=cols,
                        scale_dtype=scale_dtype, out_dtype=out_dtype)


def _dequantized(codes: Callable[[int, int], np.ndarray], zeros: np.ndarray, scales: Buffer,
                 groups: int | np.ndarray, *, rows: int, cols: int, scale_dtype: str, out_dtype: str) -> memoryview:
    """Output rows ``[cols, rows]`` (``codes(lo, hi)``: the codes of rows lo..hi, multiples of
    8; ``zeros`` ``[cols, g]``; ``scales`` the ``[g, cols]`` bytes) a cache-sized sub-band of
    rows at a time, each in one pass from its codes into the output."""
    size = DTYPE_SIZES[scale_dtype]
    s = np.ascontiguousarray(np.frombuffer(scales, dtype=_SCALE_BITS[size]).reshape(-1, cols).T)
    out = np.empty((cols, rows * DTYPE_SIZES[out_dtype]), dtype=np.uint8)
    scaled = _backend()
    band = max(8, SUB_BAND // max(1, rows) // 8 * 8)
    for lo in range(0, cols, band):
        hi = min(lo + band, cols)
        z, sc, per = zeros[lo:hi], s[lo:hi], groups
        if not isinstance(per, int):  # each row's group, any order: numpy's take (5x torch's index_select here)
            z, sc, per = np.take(z, per, axis=1), np.take(sc, per, axis=1), 1
        scaled(out[lo:hi], codes(lo, hi), z, sc, per, scale_dtype, out_dtype)
    return memoryview(out.reshape(-1)).toreadonly()


def _backend() -> Callable[..., None]:
    """torch's sub-band kernel where it is installed (its float16 conversions are
    vectorised: 5-8x numpy's here), else numpy's; the same bytes."""
    if os.environ.get("CKPTXFORM_NUMERIC") != "numpy":
        try:
            from .awq_gptq_torch import scaled_into
        except ImportError:
            pass
        else:
            return scaled_into
    return _scaled_into


def _scaled_into(out: np.ndarray, codes: np.ndarray, zeros: np.ndarray, scales: np.ndarray, group: int,
                 scale_dtype: str, out_dtype: str) -> None:
    """``out`` (bytes ``[k, rows * size]``) = ``(codes - zeros) * scales`` per ``group`` rows, rounded
    to the scale's dtype, then to ``out_dtype``. The integer difference and its product with
    the scale are exact in float32 (5 bits times at most 24): one rounding, as torch's."""
    k, rows = codes.shape
    values = codes.astype(np.float32)
    z = zeros.astype(np.float32)
    s = as_float32(scales.tobytes(), scale_dtype).reshape(k, -1)
    per_group = values.reshape(k, -1, group)
    per_group -= z[:, :, None]
    per_group *= s[:, :, None]
    if scale_dtype != "F32" and scale_dtype != out_dtype:
        values = as_float32(np.ascontiguousarray(rounded_array(values, scale_dtype)), scale_dtype).reshape(k, rows)
    result = rounded_array(values, out_dtype)
    out.view(result.dtype)[...] = result


def awq_rows_packed_down(qweight: Buffer, cols: int) -> memoryview:
    """AWQ ``qweight`` rows (a multiple of 8) -> the same codes packed down the rows
    ``[rows/8, cols]``: compressed-tensors' ``weight_packed``, transposed. AWQ's code ``q``
    in 0..15 is compressed-tensors' ``q - 8`` stored with its offset of 8: the same nibble."""
    codes = awq_columns(_words(qweight, cols // 8))
    return memoryview(pack_down_rows(codes).reshape(-1).view(np.uint8)).toreadonly()


def awq_zeros_natural(qzeros: Buffer, cols: int) -> memoryview:
    """AWQ ``qzeros`` words ``[g, out/8]`` with their nibbles put in column order: compressed-
    tensors' ``weight_zero_point`` (8 output rows a word), transposed. The zero point ``z`` is
    compressed-tensors' ``z - 8`` with its offset: the same nibble."""
    codes = awq_columns(_words(qzeros, cols // 8))
    return memoryview(pack_nibbles(codes).reshape(-1).view(np.uint8)).toreadonly()


def gptq_zeros_offset(qzeros: Buffer, cols: int) -> tuple[memoryview, int]:
    """GPTQ v1 ``qzeros`` with each nibble raised by the v1 offset of one: compressed-tensors'
    ``weight_zero_point`` transposed (its ``zp + 8`` is GPTQ's ``z + 1``); and the count of
    stored 15s, whose zero point 16 no int4 nibble holds (the caller refuses them)."""
    codes = nibbles(_words(qzeros, cols // 8))
    overflow = int(np.count_nonzero(codes == 15))
    return memoryview(pack_nibbles((codes + np.uint8(1)) & np.uint8(0xF)).reshape(-1).view(np.uint8)).toreadonly(), \
        overflow
