"""Table kernels: where every output value of a block is a function of (code, scale) and a
scale covers many codes, the block is one gather from a table of the output dtype's bits.

- FP8 block-scaled: a 128x128 block's 16,384 values take at most 256 distinct values, one
  per byte. The table of a block is the float32 product of each byte's value and the
  block's scale, rounded to nearest even in the output dtype: bit for bit what the
  arithmetic kernel (numpy_kernels.fp8) computes per element, the same real product
  rounded once to float32 (that kernel's factors differ by exact powers of two), NaN bytes
  and non-finite scales included; its NaNs are made the one quiet NaN.
- int4 per group: 16 codes a group, so the table of a group of 128 is 16 entries, made by
  numpy_kernels.int4 on the codes 0..15 under the group's scale (and zero point).
- NVFP4 and MXFP4: a group's scale is one byte (e4m3 times the tensor's global scale, or
  e8m0), so each (scale byte, code byte) pair is one entry of a 65,536-entry table of the
  byte's two output values (``nvfp4_pair_table``, mxfp4.pair_table).

The gather runs over bands of rows so that its index (8 bytes an element: numpy's
``take`` converts any other index dtype to intp first, and fancy indexing with uint16 or
uint8 indices was 1.4-2x slower) stays in cache, and writes straight into the output
array: decode, scale and round are one lookup an element, and no float32 array of the
block is made (FP8's index is made once a thread, the codes copied into its low bytes band
after band: ``_fp8_index``). numpy releases the GIL in ``take``, so blocks run on several threads
(quant/pipeline.py). Which kernel runs where (benchmarks/README.md, "Fused kernels" and
"FP8 dequant end to end"): the NVFP4 pair gather on both installs (1.0-1.4 GB/s of bf16 a
core against 0.8 for torch's arithmetic); the FP8 table on both too (on FP8 stand-in
weights 0.55-0.77 GB/s a core against 0.52-0.71 for torch's bands, measured on one vm
whose earlier host ran torch's at 1.4-1.9; and an FP8 run then does not import torch);
the int4 tables on numpy only (torch's arithmetic in bands is faster than a numpy gather
there, and torch's index ops need int64 indices too).
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import TYPE_CHECKING

from . import numpy_kernels
from .float_bits import e4m3_table, nvfp4_scales, quiet_nans
from .layouts import Fp4Groups, Fp8Block, Int4Groups

if TYPE_CHECKING:
    import numpy as np

Buffer = bytes | bytearray | memoryview

#: index elements per gather (8 bytes each: 2 MiB, in the L3 cache): bands of 2**17 to 2**19
#: all made 1.07-1.10 GB/s of bf16 (FP8), 2**15 0.8-0.95 (each call's cost)
BAND_ELEMENTS = 1 << 18
#: an FP8 band's values: its index (_fp8_index) is made once a thread, so the gather reads
#: it from the core's own cache. Alone, 2**16 made 1.64 GB/s of bf16 a core, 2**17 1.37-1.55,
#: 2**18 1.17-1.37 (a [1152, 7168] block, best of 5, the table build included); but each
#: band is two numpy calls, each a release and a retake of the GIL, and with two threads
#: decoding, a retake that finds the other thread in Python is a sleep and a wake-up (dear
#: on a vm): an apply of 1 GB of FP8 made 15,400 context switches at 2**16 and 9,600 at
#: 2**18, whose run took 0.82 of the time before, where 2**16 took 0.92-0.98 (paired, 8
#: rounds; benchmarks/README.md, "FP8 dequant end to end, sixth pass")
FP8_BAND = 1 << 18

#: the unsigned type holding one output value's bits
_BITS = {"BF16": "<u2", "F16": "<u2", "F32": "<u4"}


def fp8_worth_it(layout: Fp8Block, rows: int) -> bool:
    """Whether a table (256 entries a block) costs well under the block of ``rows`` rows it replaces."""
    return min(layout.block_rows, rows) * min(layout.block_cols, layout.cols) >= 2048


def int4_worth_it(layout: Int4Groups) -> bool:
    """Whether a table (16 entries a group) beats numpy's arithmetic: from groups of 128
    (measured: 1.5x; at 32 the gather and its index cost what the arithmetic does)."""
    return layout.group_size >= 128 and layout.cols == layout.groups * layout.group_size


def fp8_block(weight: Buffer, scale_inv: Buffer, layout: Fp8Block, rows: int, out_dtype: str) -> np.ndarray:
    """The output bytes (uint8, fresh) of ``rows`` rows of e4m3 ``weight`` under the F32
    ``scale_inv`` rows covering them; inputs checked by ``kernels.dequant_fp8_rows``."""
    import numpy as np

    blocks, sc, bh, cols = layout.scale_rows(rows), layout.scale_cols, layout.block_rows, layout.cols
    scales = np.frombuffer(scale_inv, dtype="<f4").reshape(blocks, sc, 1)
    # a few numpy calls, not the ~20 of the arithmetic kernel on 256 bytes a block (each a
    # release and retake of the GIL, while another thread decodes)
    products = scales * e4m3_table()  # the float32 product, rounded once: the kernel's
    table = np.ascontiguousarray(numpy_kernels.rounded_array(products, out_dtype)).view(_BITS[out_dtype])
    quiet_nans(table, out_dtype)
    table = table.reshape(blocks, sc * 256)
    k = layout.band_blocks(FP8_BAND)
    w = np.frombuffer(weight, dtype=np.uint8).reshape(rows, cols)
    out = np.empty((rows, cols), dtype=table.dtype)
    index = _fp8_index(layout, k)
    low_bytes = index.view(np.uint8).reshape(*index.shape, index.itemsize)[..., 0 if sys.byteorder == "little" else -1]
    for first, n, _ in layout.bands(rows, FP8_BAND):
        b = first // bh
        # the codes become the index's low bytes; the bytes above them hold the offsets
        np.copyto(low_bytes[:n], w[first:first + n])
        # every index is in the table: nothing is clipped (``clip`` skips the bounds error path)
        np.take(table[b:b + k].reshape(-1), index[:n], out=out[first:first + n], mode="clip")
    return out.reshape(-1).view(np.uint8)


def int4_groups(packed: Buffer, scale: Buffer, layout: Int4Groups, rows: int, zero_point: Buffer | None,
                out_dtype: str) -> np.ndarray:
    """The output bytes (uint8, fresh) of ``rows`` rows of packed int4 words under their
    scale rows (and zero-point rows); inputs checked by ``kernels.dequant_int4_rows``."""
    import numpy as np

    groups, g, cols = layout.groups, layout.group_size, layout.cols
    # codes 0..15 of every group: two words a group, nibble k of a word is code k (+8)
    words = np.tile(np.array([0x76543210, 0xFEDCBA98], dtype="<u4"), rows * groups)
    table = numpy_kernels.int4(words, scale, Int4Groups(cols=groups * 16, group_size=16, scale_dtype=layout.scale_dtype),
                               rows, zero_point, out_dtype).view(_BITS[out_dtype])
    quiet_nans(table, out_dtype)
    band = max(1, BAND_ELEMENTS // cols)
    offsets = 16 * (np.arange(band)[:, None] * groups + np.arange(cols)[None, :] // g)
    width = layout.words * 8  # nibbles a row, the padding of a last half-used word included
    pb = np.frombuffer(packed, dtype=np.uint8).reshape(rows, layout.words * 4)
    out = np.empty((rows, cols), dtype=table.dtype)
    for r in range(0, rows, band):
        n = min(band, rows - r)
        index = _index(n * width).reshape(n, width)
        np.bitwise_and(pb[r:r + n], np.uint8(0xF), out=index[:, 0::2])
        np.right_shift(pb[r:r + n], np.uint8(4), out=index[:, 1::2])
        used = index[:, :cols]
        used += offsets[:n]
        np.take(table[r * groups * 16:(r + n) * groups * 16], used, out=out[r:r + n], mode="clip")
    return out.reshape(-1).view(np.uint8)


def scaled_pairs(table: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``out[i, j] = table[scales[i] * 256 + codes[i, j]]``: rows of code bytes (uint8
    ``[n, per]``) under one scale byte each (uint8 ``[n]``), ``table`` holding the output
    values of each (scale, byte) pair; MXFP4 and NVFP4 (``pair_table`` of each)."""
    import numpy as np

    n, per = codes.shape
    out = np.empty((n, per), dtype=table.dtype)
    band = max(1, BAND_ELEMENTS // per)
    for first in range(0, n, band):
        count = min(band, n - first)
        index = _index(count * per).reshape(count, per)
        np.left_shift(scales[first:first + count, None], 8, out=index, dtype=np.intp)
        np.bitwise_or(index, codes[first:first + count], out=index)
        np.take(table, index, out=out[first:first + count], mode="clip")  # every index is < 65,536
    return out


@functools.lru_cache(maxsize=16)
def nvfp4_pair_table(global_scale: float, divide: bool, signed_zero: bool, out_dtype: str) -> np.ndarray:
    """Entry ``s * 256 + byte``: the two output values (low nibble first, in the low half)
    of code ``byte`` under e4m3 scale byte ``s``, for one tensor's global scale: what
    numpy_kernels.fp4 computes for them under the group scale ``nvfp4_scales`` makes."""
    import numpy as np

    scales = nvfp4_scales(bytes(range(256)), global_scale, divide=divide)
    codes = np.tile(np.arange(256, dtype=np.uint8), 256)
    out = numpy_kernels.fp4(codes, scales, Fp4Groups(cols=512, group_size=512, signed_zero=signed_zero), 256,
                            out_dtype).view(_BITS[out_dtype])
    quiet_nans(out, out_dtype)
    return out.view("<u8" if out_dtype == "F32" else "<u4")


_local = threading.local()


def _fp8_index(layout: Fp8Block, k: int) -> np.ndarray:
    """This thread's index of an FP8 band of ``layout`` (``k`` block rows a band, or part of
    one): ``256 * (the block's table among the band's) + byte``, the offsets made once and
    kept, only the low bytes (the codes, written by a strided byte copy) changing from band
    to band: adding the codes to the offsets, a uint8 + intp ufunc, took twice that copy's
    time and more than the gather itself (benchmarks/README.md, "FP8 dequant end to end")."""
    import numpy as np

    key = (layout, k)
    cached = getattr(_local, "fp8", None)
    if cached is not None and cached[0] == key:
        return cached[1]  # type: ignore[no-any-return]
    bh, bw, cols = layout.block_rows, layout.block_cols, layout.cols
    n = k * bh if k > 1 else max(1, min(bh, FP8_BAND // max(1, cols)))
    row_block = np.arange(n)[:, None] // bh
    index = (256 * (row_block * layout.scale_cols + np.arange(cols)[None, :] // bw)).astype(np.intp)
    _local.fp8 = (key, index)
    return index


def _index(n: int) -> np.ndarray:
    """``n`` intp indices owned by this thread, reused across bands and blocks."""
    import numpy as np

    buf = getattr(_local, "index", None)
    if buf is None or buf.size < n:
        buf = _local.index = np.empty(max(n, BAND_ELEMENTS), dtype=np.intp)
    return buf[:n]

