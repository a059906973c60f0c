"""The block kernels on numpy (no torch): what ``kernels`` runs when torch is absent,
bit-identical to ``torch_kernels`` (tests/test_numeric_backends.py). Inputs are checked by
``kernels``; each function returns the output block as a fresh uint8 array. Where a table
gather pays (quant/tables.py, built on these kernels), the dispatcher runs it instead.

Each block is decoded in a per-thread scratch buffer the size of one block and rounded
straight into its output: no full-size float32 copy of the tensor. numpy releases the
GIL in its loops, so several blocks run at once (quant/pipeline.py).
"""

from __future__ import annotations

import numpy as np

from .float_bits import decode_e4m3, scratch
from .fp4 import fp4_values
from .layouts import Fp4Groups, Fp8Block, Int4Groups

Buffer = bytes | bytearray | memoryview

#: the dispatcher gathers from a table (quant/tables.py) instead of these passes where one
#: pays: 1.1 GB/s of bf16 a core against 0.43 (FP8 blocks), 0.7 against 0.46 (int4 groups of 128)
GATHERS_TABLES = True


def fp8(weight: Buffer, scale_inv: Buffer, layout: Fp8Block, rows: int, out_dtype: str,
        nan: np.ndarray | None) -> np.ndarray:
    blocks = layout.scale_rows(rows)
    s = np.frombuffer(scale_inv, dtype="<f4").reshape(blocks, layout.scale_cols)
    raw = np.frombuffer(weight, dtype=np.int8)
    out = decode_e4m3(raw, nan).reshape(rows, layout.cols)
    # The decoded values are the weights times 2**-120. Folding 2**120 into the scales
    # saves a pass and changes no bit: both factors are exact, so their product is the
    # same real number, rounded once, as long as the scaled scales do not overflow.
    if rows and float(np.abs(s).max()) < 2.0 ** 8:
        s = s * np.float32(2.0 ** 120)
    else:
        out *= np.float32(2.0 ** 120)
    # one scale per column of each block row, then broadcast over the block's rows
    s_cols = np.repeat(s, layout.block_cols, axis=1)[:, :layout.cols]
    full = rows // layout.block_rows
    if full:
        body = out[:full * layout.block_rows].reshape(full, layout.block_rows, layout.cols)
        body *= s_cols[:full, None, :]
    if full < blocks:  # a partial last block of rows
        out[full * layout.block_rows:] *= s_cols[full]
    return rounded(out, out_dtype)


def int4(packed: Buffer, scale: Buffer, layout: Int4Groups, rows: int, zero_point: Buffer | None,
         out_dtype: str) -> np.ndarray:
    nibbles = _nibbles(np.frombuffer(packed, dtype=np.uint8).reshape(rows, layout.words * 4))[:, :layout.cols]
    values = scratch(rows * layout.cols, np.float32).reshape(rows, layout.cols)
    if zero_point is None:
        # q = nibble - 8, wrapped in uint8 and read as int8: exact
        nibbles -= np.uint8(8)
        values[...] = nibbles.view(np.int8)
    else:
        values[...] = nibbles
        zp_rows = layout.zero_point_rows(rows)
        zp_bytes = np.frombuffer(zero_point, dtype=np.uint8).reshape(zp_rows, layout.groups, 4)
        # words hold 8 consecutive rows: nibble k of word [w, g] is row 8w + k
        zp = _nibbles(zp_bytes).reshape(zp_rows, layout.groups, 8).transpose(0, 2, 1)
        zp = zp.reshape(zp_rows * 8, layout.groups)[:rows]
        # (q + 8) - (zp + 8): the stored offsets cancel; the difference is exact
        per_group(values, layout)[...] -= zp[:, :, None]
    s = _widened(np.frombuffer(scale, dtype=_SCALE_DTYPES[layout.scale_dtype]), layout.scale_dtype)
    # q * s is exact in float32 for every scale dtype (4 + at most 24 bits); rounding it
    # once to the scale's dtype is compressed-tensors' product in that dtype
    per_group(values, layout)[...] *= s.reshape(rows, layout.groups)[:, :, None]
    if layout.scale_dtype == out_dtype or layout.scale_dtype == "F32":
        return rounded(values, out_dtype)
    # rounded to the scale's dtype first, then cast, as torch does (exact when widening)
    return rounded(_widened(rounded_array(values, layout.scale_dtype), layout.scale_dtype), out_dtype)


def fp4(packed: Buffer, scale: Buffer, layout: Fp4Groups, rows: int, out_dtype: str) -> np.ndarray:
    values = fp4_values(packed, layout, rows)
    s = np.frombuffer(scale, dtype="<f4").reshape(rows, layout.groups)
    # an e2m1 value has 2 significant bits: the product is rounded once to float32
    values.reshape(rows, layout.groups, layout.group_size)[...] *= s[:, :, None]
    return rounded(values, out_dtype)


#: the scale dtypes of int4 (safetensors name -> the little-endian numpy storage type)
_SCALE_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}


def as_float32(raw: Buffer, dtype: str) -> np.ndarray:
    """float32 values of F32, F16 or BF16 bytes, exactly (BF16 widened by a shift: with
    ml_dtypes' bfloat16, the first use imports ml_dtypes, 1.0-1.2 s here)."""
    return _widened(np.frombuffer(raw, dtype=_SCALE_DTYPES[dtype]), dtype)


def _nibbles(raw: np.ndarray) -> np.ndarray:
    """uint8 [..., n] -> uint8 [..., 2n]: low nibble first (little-endian words)."""
    out = np.empty((*raw.shape[:-1], raw.shape[-1] * 2), dtype=np.uint8)
    np.bitwise_and(raw, np.uint8(0xF), out=out[..., 0::2])
    np.right_shift(raw, np.uint8(4), out=out[..., 1::2])
    return out


def per_group(values: np.ndarray, layout: Int4Groups) -> np.ndarray:
    """[rows, cols] viewed as [rows, groups, group_size] (compressed-tensors requires
    cols to be a multiple of the group size), so a per-group value broadcasts."""
    if layout.cols != layout.groups * layout.group_size:
        raise ValueError(f"{layout.cols} columns are not whole groups of {layout.group_size}")
    return values.reshape(values.shape[0], layout.groups, layout.group_size)


def _widened(stored: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values of F32/F16/BF16 (BF16 given as its uint16 bits), exactly."""
    if dtype == "BF16":
        return (stored.astype(np.uint32) << 16).view(np.float32)
    return stored.astype(np.float32, copy=False)


def rounded_array(values: np.ndarray, out_dtype: str) -> np.ndarray:
    """float32 ``values`` rounded to nearest even in ``out_dtype`` (BF16 as uint16 bits)."""
    if out_dtype == "F32":
        return values
    if out_dtype == "F16":
        with np.errstate(over="ignore"):  # overflow is inf, as in torch
            return values.astype(np.float16)
    # BF16: add half an ulp (less one, plus the kept lowest bit: ties to even) and keep
    # the high half. The NaNs here are quiet (NaN * scale), so the carry cannot reach inf.
    bits = values.view(np.uint32)
    carry = bits >> np.uint32(16)
    carry &= np.uint32(1)
    carry += np.uint32(0x7FFF)
    carry += bits
    return carry.view(np.uint16)[..., 1::2]  # the high halves (little-endian, as safetensors)


def rounded(values: np.ndarray, out_dtype: str) -> np.ndarray:
    """The bytes of ``values`` (float32) rounded to ``out_dtype``, in a fresh buffer:
    ``values`` is scratch, reused by the next block, while the caller holds the bytes."""
    out = np.ascontiguousarray(rounded_array(values, out_dtype))
    if np.shares_memory(out, values):
        out = out.copy()
    return out.reshape(-1).view(np.uint8)
