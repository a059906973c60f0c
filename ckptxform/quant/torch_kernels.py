"""The block kernels on torch (vectorised on CPU): what ``kernels`` runs where torch is
installed, about 3x the numpy kernels' speed here, bit-identical to them
(tests/test_numeric_backends.py). Inputs are checked by ``kernels``; each function
returns the output block as a fresh uint8 array.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from ..dtypes import torch_dtype
from .fp4 import fp4_values
from .layouts import Fp4Groups, Fp8Block, Int4Groups
from .torch_buffers import as_tensor

Buffer = bytes | bytearray | memoryview

#: torch's fused bands beat a numpy table gather (and torch's index ops need int64 indices)
GATHERS_TABLES = False


def fp8(weight: Buffer, scale_inv: Buffer, layout: Fp8Block, rows: int, out_dtype: str,
        nan: np.ndarray | None) -> np.ndarray:
    """Decode, scale and round in one sweep of bands of rows that stay in cache, each band
    rounded into its rows of the output: 1.9-2.2 GB/s of
    bf16 a core here against 1.1 for the numpy table gather and 0.8-0.9 for the same passes
    over the whole block (benchmarks/README.md, "Fused kernels")."""
    blocks, bh, cols = layout.scale_rows(rows), layout.block_rows, layout.cols
    s = as_tensor(scale_inv, torch.float32).view(blocks, layout.scale_cols)
    # The decoded values are the weights times 2**-120. Folding 2**120 into the scales
    # saves a pass and changes no bit: both factors are exact, so their product is the
    # same real number, rounded once, as long as the scaled scales do not overflow.
    folded = rows > 0 and bool(s.abs().max() < 2.0 ** 8)
    if folded:
        s = s * 2.0 ** 120
    s_cols = s.repeat_interleave(layout.block_cols, dim=1)[:, :cols]  # a scale per column of each block row
    w = as_tensor(weight, torch.int8).view(rows, cols)
    mask = torch.from_numpy(nan).view(rows, cols) if nan is not None else None
    out = torch.empty((rows, cols), dtype=torch_dtype(out_dtype))
    for first, count, k in layout.bands(rows, FUSED_BAND):
        values = _decode_e4m3(w[first:first + count], count * cols,
                              None if mask is None else mask[first:first + count]).view(count, cols)
        if not folded:
            values.mul_(2.0 ** 120)
        b = first // bh
        if k == 1:  # part of one block row: one scale row
            values.mul_(s_cols[b])
        else:  # k whole block rows (the last may be partial): each its own scale row
            whole = count // bh
            if whole:
                values[:whole * bh].view(whole, bh, cols).mul_(s_cols[b:b + whole, None, :])
            if whole * bh < count:
                values[whole * bh:].mul_(s_cols[b + whole])
        # the float32 product, then the output dtype: two roundings to nearest even, as the
        # reference; a float32 multiply with a bf16 ``out=`` was 25% slower than the two ops
        out[first:first + count].copy_(values)
    return out.view(torch.uint8).numpy().reshape(-1)


#: values a band of ``fp8`` or ``int4`` decodes at once: its int32 scratch (2 MiB) and its output stay in
#: the L3 cache, and a band is large enough that torch's per-call cost (~8 us an op here)
#: stays small: bands of 2**15 values made 0.6 GB/s, of 2**19 1.9 (loaded vm, one thread)
FUSED_BAND = 1 << 19


def int4(packed: Buffer, scale: Buffer, layout: Int4Groups, rows: int, zero_point: Buffer | None,
         out_dtype: str) -> np.ndarray:
    """In bands of rows, as ``fp8``: unpack, subtract, scale in the scale's dtype (one
    rounding there, as compressed-tensors), then into the output's rows. Whole-block passes
    made 1.1 GB/s of bf16 a core here with float32 scales, bands 2.0 (bf16 scales: 1.7-1.8
    either way)."""
    sdtype, cols = torch_dtype(layout.scale_dtype), layout.cols
    raw = as_tensor(packed, torch.uint8).view(rows, layout.words * 4)
    s = as_tensor(scale, sdtype).view(rows, layout.groups)[:, :, None]  # broadcast over a group
    zp = None
    if zero_point is not None:
        zp_rows = layout.zero_point_rows(rows)
        zp_bytes = as_tensor(zero_point, torch.uint8).view(zp_rows, layout.groups, 4)
        # words hold 8 consecutive rows: nibble k of word [w, g] is row 8w + k
        zp = _nibbles(zp_bytes).view(zp_rows, layout.groups, 8).transpose(1, 2)
        zp = zp.reshape(zp_rows * 8, layout.groups)[:rows].to(sdtype)[:, :, None]
    out = torch.empty((rows, cols), dtype=torch_dtype(out_dtype))
    band = max(1, FUSED_BAND // max(1, cols))
    values = torch.empty((min(band, rows), cols), dtype=sdtype)
    for first in range(0, rows, band):
        n = min(band, rows - first)
        nibbles, v = _nibbles(raw[first:first + n])[:, :cols], values[:n]
        if zp is None:
            # q = nibble - 8, wrapped in uint8 and read as int8: exact, and half the bytes of
            # subtracting in the scale's dtype
            v.copy_(nibbles.sub_(8).view(torch.int8))
        else:
            v.copy_(nibbles)
            # (q + 8) - (zp + 8): the stored offsets cancel; the difference is exact
            _per_group(v, layout).sub_(zp[first:first + n])
        if v.dtype == out.dtype:  # one rounding, in the scale's dtype, into the output
            torch.mul(_per_group(v, layout), s[first:first + n], out=_per_group(out[first:first + n], layout))
        else:  # rounded in the scale's dtype, then cast, as torch does
            _per_group(v, layout).mul_(s[first:first + n])
            out[first:first + n].copy_(v)
    return out.view(torch.uint8).numpy().reshape(-1)


def fp4(packed: Buffer, scale: Buffer, layout: Fp4Groups, rows: int, out_dtype: str) -> np.ndarray:
    # the byte lookup on numpy: torch's uint8 -> int64 index conversion alone is 4x slower
    values = torch.from_numpy(fp4_values(packed, layout, rows))
    s = as_tensor(scale, torch.float32).view(rows, layout.groups)
    # an e2m1 value has 2 significant bits: the product is rounded once to float32
    values.view(rows, layout.groups, layout.group_size).mul_(s[:, :, None])
    return _to_bytes(values, out_dtype, copy=False)


def _decode_e4m3(raw: torch.Tensor, n: int, nan: torch.Tensor | None) -> torch.Tensor:
    """float32 values of ``n`` e4m3fn bytes (given as int8) TIMES 2**-120, exactly, in a
    per-thread scratch buffer: torch's own float8 -> float32 conversion is a scalar loop
    here (~5x slower). The bit trick is float_bits.decode_e4m3's; ``nan`` marks the
    NaN bytes 0x7F/0xFF (found by ``kernels`` with numpy: torch's uint8 ops are ~60x slower)."""
    bits = _scratch(n).view(raw.shape)
    bits.copy_(raw)
    bits.bitwise_left_shift_(20).bitwise_and_(_E4M3_MASK)
    values = bits.view(torch.float32)
    if nan is not None:
        values[nan] = float("nan")
    return values


#: sign bit and the 7 bits of exponent+mantissa, after the shift (as a signed int32)
_E4M3_MASK = 0x87F00000 - (1 << 32)

_local = threading.local()


def _scratch(n: int) -> torch.Tensor:
    """An int32 buffer of ``n`` elements owned by this thread, reused across blocks."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < n:
        buf = _local.buf = torch.empty(n, dtype=torch.int32)
    return buf[:n]


def _nibbles(raw: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> uint8 [..., 2n]: low nibble first (little-endian words). Each byte
    is widened to 16 bits and its high nibble moved to the high byte, so the pairs land in
    order without an interleaving copy (``torch.stack`` of the two halves was 3.4x slower)."""
    wide = raw.to(torch.int16)
    high = wide.bitwise_left_shift(4).bitwise_and_(0x0F00)
    return wide.bitwise_and_(0xF).bitwise_or_(high).view(torch.uint8)


def _per_group(values: torch.Tensor, layout: Int4Groups) -> torch.Tensor:
    """[rows, cols] viewed as [rows, groups, group_size] (compressed-tensors requires
    cols to be a multiple of the group size), so a per-group value broadcasts."""
    if layout.cols != layout.groups * layout.group_size:
        raise ValueError(f"{layout.cols} columns are not whole groups of {layout.group_size}")
    return values.view(values.shape[0], layout.groups, layout.group_size)


def _to_bytes(values: torch.Tensor, out_dtype: str, *, copy: bool) -> np.ndarray:
    """The bytes of ``values`` cast to ``out_dtype`` (round to nearest even); ``copy``
    when ``values`` will be overwritten, since the caller may hold the bytes a while."""
    out = values.to(torch_dtype(out_dtype), copy=copy).contiguous()
    return out.view(torch.uint8).numpy().reshape(-1)
