"""The block kernels on torch (vectorised on CPU): what ``kernels`` runs where torch is
installed, about 3x the numpy kernels' speed here, bit-identical to them
(tests/test_numeric_backends.py). Inputs are checked by ``kernels``; each function
returns the output block as a fresh uint8 array.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import numpy as np
import torch

from ..dtypes import torch_dtype
from . import numpy_kernels
from .layouts import Fp4Groups, Fp8Block, Int4Groups

Buffer = bytes | bytearray | memoryview


def fp8(weight: Buffer, scale_inv: Buffer, layout: Fp8Block, rows: int, out_dtype: str,
        nan: np.ndarray | None) -> np.ndarray:
    blocks = layout.scale_rows(rows)
    s = _as_tensor(scale_inv, torch.float32).view(blocks, layout.scale_cols)
    out = _decode_e4m3(_as_tensor(weight, torch.int8), rows * layout.cols, nan).view(rows, layout.cols)
    # The decoded values are the weights times 2**-120. Folding 2**120 into the scales
    # saves a pass and changes no bit: both factors are exact, so their product is the
    # same real number, rounded once, as long as the scaled scales do not overflow.
    if rows and bool(s.abs().max() < 2.0 ** 8):
        s = s * 2.0 ** 120
    else:
        out.mul_(2.0 ** 120)
    # one scale per column of each block row, then broadcast over the block's rows
    s_cols = s.repeat_interleave(layout.block_cols, dim=1)[:, :layout.cols]
    full = rows // layout.block_rows
    if full:
        body = out[:full * layout.block_rows].view(full, layout.block_rows, layout.cols)
        body.mul_(s_cols[:full, None, :])
    if full < blocks:  # a partial last block of rows
        out[full * layout.block_rows:].mul_(s_cols[full])
    return _to_bytes(out, out_dtype, copy=True)  # ``out`` is scratch, reused by the next block


def int4(packed: Buffer, scale: Buffer, layout: Int4Groups, rows: int, zero_point: Buffer | None,
         out_dtype: str) -> np.ndarray:
    sdtype = torch_dtype(layout.scale_dtype)
    nibbles = _nibbles(_as_tensor(packed, torch.uint8).view(rows, layout.words * 4))[:, :layout.cols]
    if zero_point is None:
        # q = nibble - 8, wrapped in uint8 and read as int8: exact, and half the bytes of
        # subtracting in the scale's dtype
        values = nibbles.sub_(8).view(torch.int8).to(sdtype)
    else:
        values = nibbles.to(sdtype)
        zp_rows = layout.zero_point_rows(rows)
        zp_bytes = _as_tensor(zero_point, torch.uint8).view(zp_rows, layout.groups, 4)
        # words hold 8 consecutive rows: nibble k of word [w, g] is row 8w + k
        zp = _nibbles(zp_bytes).view(zp_rows, layout.groups, 8).transpose(1, 2)
        zp = zp.reshape(zp_rows * 8, layout.groups)[:rows]
        # (q + 8) - (zp + 8): the stored offsets cancel; the difference is exact
        _per_group(values, layout).sub_(zp.to(sdtype)[:, :, None])
    s = _as_tensor(scale, sdtype).view(rows, layout.groups)
    _per_group(values, layout).mul_(s[:, :, None])  # one rounding in the scale's dtype, as compressed-tensors
    return _to_bytes(values, out_dtype, copy=False)


def fp4(packed: Buffer, scale: Buffer, layout: Fp4Groups, rows: int, out_dtype: str) -> np.ndarray:
    # the byte lookup on numpy: torch's uint8 -> int64 index conversion alone is 4x slower
    values = torch.from_numpy(numpy_kernels.fp4_values(packed, layout, rows))
    s = _as_tensor(scale, torch.float32).view(rows, layout.groups)
    # an e2m1 value has 2 significant bits: the product is rounded once to float32
    values.view(rows, layout.groups, layout.group_size).mul_(s[:, :, None])
    return _to_bytes(values, out_dtype, copy=False)


def _decode_e4m3(raw: torch.Tensor, n: int, nan: np.ndarray | None) -> torch.Tensor:
    """float32 values of ``n`` e4m3fn bytes (given as int8) TIMES 2**-120, exactly, in a
    per-thread scratch buffer: torch's own float8 -> float32 conversion is a scalar loop
    here (~5x slower). The bit trick is numpy_kernels._decode_e4m3's; ``nan`` marks the
    NaN bytes 0x7F/0xFF (found by ``kernels`` with numpy: torch's uint8 ops are ~60x slower)."""
    bits = _scratch(n)
    bits.copy_(raw)
    bits.bitwise_left_shift_(20).bitwise_and_(_E4M3_MASK)
    values = bits.view(torch.float32)
    if nan is not None:
        values[torch.from_numpy(nan)] = float("nan")
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
    """uint8 [..., n] -> uint8 [..., 2n]: low nibble first (little-endian words)."""
    return torch.stack((raw & 0xF, raw >> 4), dim=-1).flatten(-2)


def _per_group(values: torch.Tensor, layout: Int4Groups) -> torch.Tensor:
    """[rows, cols] viewed as [rows, groups, group_size] (compressed-tensors requires
    cols to be a multiple of the group size), so a per-group value broadcasts."""
    if layout.cols != layout.groups * layout.group_size:
        raise ValueError(f"{layout.cols} columns are not whole groups of {layout.group_size}")
    return values.view(values.shape[0], layout.groups, layout.group_size)


def _as_tensor(raw: Buffer, dtype: Any) -> torch.Tensor:
    """A tensor over ``raw`` without a copy. The kernels never write to their inputs, so
    a read-only buffer (``bytes`` from a source) is used as it is."""
    if not len(raw):
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(raw, dtype=dtype)


def _to_bytes(values: torch.Tensor, out_dtype: str, *, copy: bool) -> np.ndarray:
    """The bytes of ``values`` cast to ``out_dtype`` (round to nearest even); ``copy``
    when ``values`` will be overwritten, since the caller may hold the bytes a while."""
    out = values.to(torch_dtype(out_dtype), copy=copy).contiguous()
    return out.view(torch.uint8).numpy().reshape(-1)
