"""AutoAWQ (GEMM) and GPTQ int4 storage: unpacking, dequantizing a block of rows exactly as
their reference kernels do on the CPU, and repacking nibbles into compressed-tensors'
``pack-quantized`` layout without a float round trip. numpy only (the light install runs it).

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
from typing import Any

import numpy as np

from .numpy_kernels import as_float32, rounded, rounded_array

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


def _scaled(q: np.ndarray, zeros: np.ndarray, scales: Buffer, which: np.ndarray, scale_dtype: str,
            out_dtype: str) -> np.ndarray:
    """``(q - zeros[which]) * scales[which]`` (codes ``[rows, cols]``, per-group zero points and
    scale bytes ``[groups, cols]``, ``which`` each row's group) rounded to the scale's dtype,
    then to ``out_dtype``: the bytes, fresh. On torch where it is installed (its float16
    conversions are vectorised: 5-8x numpy's here), else numpy; the same bytes."""
    if os.environ.get("CKPTXFORM_NUMERIC") != "numpy":
        try:
            import torch
        except ImportError:
            pass
        else:
            return _scaled_torch(torch, q, zeros, scales, which, scale_dtype, out_dtype)
    diff = q.astype(np.int16, order="C")  # GPTQ's rows come transposed
    diff -= zeros[which]
    values = diff.astype(np.float32)
    values *= as_float32(scales, scale_dtype).reshape(-1, q.shape[1])[which]  # exact: 5 bits times at most 24
    if scale_dtype != "F32" and scale_dtype != out_dtype:
        values = as_float32(np.ascontiguousarray(rounded_array(values, scale_dtype)), scale_dtype)
    return rounded(values.reshape(diff.shape), out_dtype)


def _scaled_torch(torch: Any, q: np.ndarray, zeros: np.ndarray, scales: Buffer, which: np.ndarray, scale_dtype: str,
                  out_dtype: str) -> np.ndarray:
    from ..dtypes import torch_dtype
    from .torch_buffers import as_tensor

    sdtype = torch_dtype(scale_dtype)
    index = torch.from_numpy(which.astype(np.int64, copy=False))
    diff = torch.from_numpy(np.ascontiguousarray(q)).to(torch.int16)
    diff.sub_(torch.from_numpy(zeros).index_select(0, index))
    # the int difference in the scale's dtype (exact), one product rounded there: the references' op
    values = diff.to(sdtype).mul_(as_tensor(scales, sdtype).view(-1, q.shape[1]).index_select(0, index))
    return values.to(torch_dtype(out_dtype)).contiguous().view(torch.uint8).numpy().reshape(-1)


def dequant_awq_rows(qweight: Buffer, qzeros: Buffer, scales: Buffer, *, first: int, cols: int, group: int,
                     scale_dtype: str, out_dtype: str) -> memoryview:
    """Rows ``first ..`` of the ``[in, out]`` weight (``cols`` = out) from their ``qweight``
    rows, and the ``qzeros`` and ``scales`` rows of groups ``first // group`` to the last row's.

    >>> q = np.array([[0x76543210]], dtype="<u4")  # nibble i (value i) holds column AWQ_ORDER[i]
    >>> out = dequant_awq_rows(q.tobytes(), np.zeros(1, "<u4").tobytes(), np.ones(8, "<f2").tobytes(),
    ...                        first=0, cols=8, group=1, scale_dtype="F16", out_dtype="F32")
    >>> np.frombuffer(out, "<f4").tolist()
    [0.0, 4.0, 1.0, 5.0, 2.0, 6.0, 3.0, 7.0]
    """
    q = awq_columns(_words(qweight, cols // 8))
    z = awq_columns(_words(qzeros, cols // 8)).astype(np.int16)
    which = np.arange(first, first + q.shape[0]) // group - first // group
    return memoryview(_scaled(q, z, scales, which, scale_dtype, out_dtype)).toreadonly()


def gptq_zero_points(qzeros: np.ndarray) -> np.ndarray:
    """GPTQ v1 qzeros words ``[g, out/8]`` -> zero points ``[g, out]`` (int16): the stored
    nibble plus one, as auto-gptq adds it (a stored 15 is 16)."""
    return nibbles(qzeros).astype(np.int16) + 1


def dequant_gptq_rows(qweight: Buffer, qzeros: Buffer, scales: Buffer, g_idx: np.ndarray, *, first_group: int,
                      cols: int, scale_dtype: str, out_dtype: str) -> memoryview:
    """The rows of the ``[in, out]`` weight packed in ``qweight`` (whole word rows: 8 rows
    each), ``g_idx`` their groups, ``qzeros``/``scales`` the rows of groups ``first_group`` on
    (every group ``g_idx`` names among them).

    >>> q = np.full((1, 8), 0x76543210, dtype="<u4")  # rows 0..7 of 8 columns
    >>> out = dequant_gptq_rows(q.tobytes(), np.full(1, 0x77777777, "<u4").tobytes(), np.ones(8, "<f2").tobytes(),
    ...                         np.zeros(8, np.int32), first_group=0, cols=8, scale_dtype="F16", out_dtype="F32")
    >>> np.frombuffer(out, "<f4").reshape(8, 8)[:, 0].tolist()
    [-8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0]
    """
    words = _words(qweight, cols)
    q = nibbles(words.T.copy()).reshape(cols, -1).T  # row 8r + k of column c: nibble k of word [r, c]
    z = gptq_zero_points(_words(qzeros, cols // 8))
    which = g_idx.astype(np.int64) - first_group
    return memoryview(_scaled(q, z, scales, which, scale_dtype, out_dtype)).toreadonly()


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
