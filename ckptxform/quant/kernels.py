"""Exact dequantization of one block of weight rows, vectorised, on torch or numpy.

The unit of work is a *row block*: some rows of a quantized weight plus the rows of its
scales that cover them, in, and the output rows' bytes, out. The executor streams a
tensor as a sequence of such blocks, so memory is bounded by a block whatever the
tensor's size. Each function checks the sizes it is given and never reads past them.

- FP8 block-scaled (DeepSeek-V3/R1, Kimi-K2): ``out[i, j] = round(float32(W[i, j]) *
  scale_inv[i // bh, j // bw])`` with the product rounded to float32 and then to the
  output dtype, both to nearest even (what DeepSeek's ``weight_dequant`` kernel computes).
  Edge blocks may be partial; each uses its own scale.
- int4 pack-quantized (compressed-tensors): nibble ``k`` (bits ``4k..4k+3``) of word
  ``w`` of a row is element ``8w + k``, stored as ``q + 8``; ``out[r, c] =
  round_s(round_s(q[r, c] - zp[r, c // g]) * scale[r, c // g])`` computed in the scale's
  dtype ``s`` (as compressed-tensors' ``dequantize`` does), then cast to the output dtype.
  The zero point (asymmetric schemes) is packed the same way along rows.
- FP4 e2m1 per group (NVFP4): two codes a byte, low nibble first; ``out[r, c] =
  round(value(code[r, c]) * scale[r, c // g])``, the product rounded to float32 and then to
  the output dtype. NVFP4's float32 group scale is its e4m3 ``weight_scale`` times
  (ModelOpt's ``weight_scale_2``) or divided by (compressed-tensors' reciprocal
  ``weight_global_scale``) the global scale, rounded once to float32 (``nvfp4_scales``).

Two arithmetic backends give the same bytes (tests/test_numeric_backends.py):
``torch_kernels`` where torch is installed, ``numpy_kernels`` elsewhere (the light
install). Where a scale covers many codes (FP8 blocks of 2,048 values or more, int4 groups
of 128, every NVFP4 tensor), a block is one gather from a table of output values made by
the numpy kernel for each (code, scale) pair (quant/tables.py): FP8 and NVFP4 on every
install (an FP8 block-scaled run then never imports torch: its import cost 1.5 CPU-seconds
and 250 MB, and on this project's vm the gather makes FP8 stand-in weights at least as
fast as torch's bands; benchmarks/README.md, "FP8 dequant end to end"), int4 where the
backend is numpy's (``GATHERS_TABLES``). This module is the
dispatcher: it imports the backends and the tables, and they import only the leaves
(``layouts``, ``float_bits``, ``fp4``, ``torch_buffers``), never this module. Each decodes a block in a per-thread
scratch buffer the size of one block: no full-size float32 copy of the tensor. NaN stays
NaN (one quiet NaN per output dtype). numpy and torch are imported when a block runs:
importing this module costs nothing to ``validate`` or ``plan``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ..dtypes import DTYPE_SIZES
from .float_bits import NAN_BITS, np_errors_ignored, nvfp4_scales, quiet_nans
from .layouts import Fp4Groups, Fp8Block, Int4Groups

if TYPE_CHECKING:
    import numpy as np

__all__ = ["Fp4Groups", "Fp8Block", "Int4Groups", "dequant_fp4_rows", "dequant_fp8_rows", "dequant_int4_rows",
           "dequant_nvfp4_rows", "nvfp4_largest_scale", "nvfp4_scales", "tensor_view"]

Buffer = bytes | bytearray | memoryview

#: output dtypes a dequantization may produce (safetensors names)
OUTPUT_DTYPES = ("BF16", "F16", "F32")


def dequant_fp8_rows(weight: Buffer, scale_inv: Buffer, layout: Fp8Block, *,
                     out_dtype: str = "BF16") -> memoryview:
    """The output bytes of the rows of an F8_E4M3 weight in ``weight`` (whole rows,
    starting at a block boundary), given the F32 scale rows covering them.

    >>> import numpy as np
    >>> w = bytes([0x38] * 15)  # e4m3 1.0
    >>> s = np.array([[2.0, 0.5]], dtype=np.float32)
    >>> out = dequant_fp8_rows(w, s.tobytes(), Fp8Block(cols=5, block_rows=4, block_cols=4))
    >>> tensor_view(out, "BF16", (3, 5))[0].tolist()
    [2.0, 2.0, 2.0, 2.0, 0.5]
    """
    _check_out(out_dtype)
    if layout.cols == 0:  # a [rows, 0] weight and its [blocks, 0] scale: no values whatever the rows
        _expect(len(weight) + len(scale_inv), 0, "FP8 weight and scale_inv of no columns")
        return memoryview(b"")
    rows = _whole_rows(len(weight), layout.cols, 1, "FP8 weight")
    _expect(len(scale_inv), layout.scale_rows(rows) * layout.scale_cols * 4, "F32 scale_inv rows")
    import numpy as np

    from . import tables

    if tables.fp8_worth_it(layout, rows):
        # NaN bytes and non-finite scales are in the table, its NaNs already the quiet one:
        # no scan of the codes for NaN bytes
        with np_errors_ignored():
            return memoryview(tables.fp8_block(weight, scale_inv, layout, rows, out_dtype)).toreadonly()
    codes = np.frombuffer(weight, dtype=np.uint8)
    nan = None
    if int(codes.max(initial=0)) == 0xFF or int(codes.view(np.int8).max(initial=0)) == 0x7F:  # two fast reductions
        nan = (codes | np.uint8(0x80)) == np.uint8(0xFF)  # the NaN bytes 0x7F/0xFF
    with np_errors_ignored():  # inf and NaN scales make inf and NaN values, not errors
        out = backend().fp8(weight, scale_inv, layout, rows, out_dtype, nan)
    return _canonical_nans(out, out_dtype, nan is not None or not _finite(scale_inv, "F32"))


def dequant_int4_rows(packed: Buffer, scale: Buffer, layout: Int4Groups, *,
                      zero_point: Buffer | None = None, out_dtype: str = "BF16") -> memoryview:
    """The output bytes of the rows of an int4 weight packed in ``packed`` (I32 words,
    whole rows), given the scale rows of the same rows and, for an asymmetric scheme,
    the packed zero-point rows (I32, 8 rows per word; the block must start at a multiple
    of 8 rows).

    >>> import numpy as np
    >>> words = np.array([[0x76543210, 0xFEDCBA98]], dtype="<u4")
    >>> out = dequant_int4_rows(words.tobytes(), np.ones((1, 1), np.float32).tobytes(),
    ...                         Int4Groups(cols=16, group_size=16, scale_dtype="F32"),
    ...                         out_dtype="F32")
    >>> tensor_view(out, "F32", (1, 16))[0].tolist()[:9]
    [-8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0, 0.0]
    """
    rows = _whole_rows(len(packed), layout.words, 4, "packed int4 weight")
    if layout.scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"weight_scale dtype {layout.scale_dtype!r} is not one of {', '.join(SCALE_DTYPES)}")
    _expect(len(scale), rows * layout.groups * DTYPE_SIZES[layout.scale_dtype],
            f"{layout.scale_dtype} weight_scale rows")
    if zero_point is not None:
        _expect(len(zero_point), layout.zero_point_rows(rows) * layout.groups * 4, "I32 weight_zero_point rows")
    _check_out(out_dtype)
    with np_errors_ignored():
        out = _int4_block(packed, scale, layout, rows, zero_point, out_dtype)
    return _canonical_nans(out, out_dtype, not _finite(scale, layout.scale_dtype))


def dequant_fp4_rows(packed: Buffer, scale: Buffer, layout: Fp4Groups, *, out_dtype: str = "BF16") -> memoryview:
    """The output bytes of the rows of an e2m1 weight packed in ``packed`` (whole rows),
    given one F32 scale per group of each row (``nvfp4_scales``).

    >>> import numpy as np
    >>> packed = bytes([0x21, 0x8F] * 8)  # codes 1, 2, 15, 8: 0.5, 1.0, -6.0, -0.0
    >>> scale = np.array([2.0, 0.5], dtype=np.float32).tobytes()
    >>> out = dequant_fp4_rows(packed, scale, Fp4Groups(cols=16, group_size=16), out_dtype="F32")
    >>> tensor_view(out, "F32", (2, 16))[:, :4].tolist()
    [[1.0, 2.0, -12.0, -0.0], [0.25, 0.5, -3.0, -0.0]]
    """
    rows = _whole_rows(len(packed), layout.row_bytes, 1, "packed FP4 weight")
    if layout.cols % layout.group_size or layout.cols % 2:
        raise ValueError(f"{layout.cols} columns are not whole groups of {layout.group_size}")
    _expect(len(scale), rows * layout.groups * 4, "F32 group scale rows")
    _check_out(out_dtype)
    with np_errors_ignored():
        out = backend().fp4(packed, scale, layout, rows, out_dtype)
    return _canonical_nans(out, out_dtype, not _finite(scale, "F32"))


def dequant_nvfp4_rows(packed: Buffer, scale: Buffer, global_scale: float, layout: Fp4Groups, *, divide: bool,
                       out_dtype: str = "BF16") -> memoryview:
    """``dequant_fp4_rows`` of NVFP4 rows given their e4m3 group-scale bytes ``scale`` and the
    tensor's float32 ``global_scale`` (``nvfp4_scales`` combines them), the same bytes: a
    group's scale is one of 256 values per tensor, so every (scale byte, code byte) pair is
    one entry of a 65,536-entry table of output value pairs, and a block is one gather.

    >>> import numpy as np
    >>> out = dequant_nvfp4_rows(bytes([0x21, 0x8F] * 4), bytes([0x38]), 0.5, Fp4Groups(cols=16, group_size=16),
    ...                          divide=True, out_dtype="F32")
    >>> np.frombuffer(out, dtype="<f4")[:4].tolist()
    [1.0, 2.0, -12.0, -0.0]
    """
    rows = _whole_rows(len(packed), layout.row_bytes, 1, "packed FP4 weight")
    if layout.cols % layout.group_size or layout.cols % 2 or layout.group_size % 2:
        raise ValueError(f"{layout.cols} columns are not whole groups of {layout.group_size}")
    _expect(len(scale), rows * layout.groups, "F8_E4M3 group scale rows")
    _check_out(out_dtype)
    import numpy as np

    from . import tables

    with np_errors_ignored():
        table = tables.nvfp4_pair_table(float(global_scale), divide, layout.signed_zero, out_dtype)
        codes = np.frombuffer(packed, dtype=np.uint8).reshape(rows * layout.groups, layout.group_size // 2)
        out = tables.scaled_pairs(table, codes, np.frombuffer(scale, dtype=np.uint8))
    return memoryview(out.reshape(-1).view(np.uint8)).toreadonly()


def nvfp4_largest_scale(scale: Buffer, global_scale: float, *, divide: bool) -> bytes:
    """The F32 bytes of the group scale of largest magnitude that ``nvfp4_scales`` makes of
    ``scale`` (empty for no scales; not finite where any of them is not), which is all a
    finite check needs: an e4m3 magnitude grows with the byte's low 7 bits (0x7F is NaN),
    and dividing or multiplying by one float32 keeps that order, so this is one reduction
    of the bytes where converting every scale took a third of the NVFP4 kernel's time."""
    import numpy as np

    codes = np.frombuffer(scale, dtype=np.uint8)
    if not codes.size:
        return b""
    return nvfp4_scales(bytes([int((codes & np.uint8(0x7F)).max())]), global_scale, divide=divide)


def backend() -> Any:
    """The kernels' module: torch's where torch is installed (faster), numpy's elsewhere
    (or when ``CKPTXFORM_NUMERIC=numpy``); the two give the same bytes."""
    if os.environ.get("CKPTXFORM_NUMERIC") != "numpy":
        try:
            from . import torch_kernels

            return torch_kernels
        except ImportError:
            pass
    from . import numpy_kernels

    return numpy_kernels


def _numpy_kernels() -> Any:
    from . import numpy_kernels

    return numpy_kernels


#: int4 blocks of at most this many values run on numpy's kernels whatever ``backend`` says:
#: torch's per-op cost made a MoE expert of 3,584 values 160 us against numpy's 45 (the
#: same bytes), and a checkpoint of only such modules (a narrow stand-in) never imports torch
SMALL_INT4_VALUES = 1 << 14


def _int4_block(packed: Buffer, scale: Buffer, layout: Int4Groups, rows: int, zero_point: Buffer | None,
                out_dtype: str) -> np.ndarray:
    kernels = _numpy_kernels() if rows * layout.cols <= SMALL_INT4_VALUES else backend()
    if kernels.GATHERS_TABLES:
        from . import tables

        if tables.int4_worth_it(layout):
            return tables.int4_groups(packed, scale, layout, rows, zero_point, out_dtype)
    return kernels.int4(packed, scale, layout, rows, zero_point, out_dtype)


def tensor_view(raw: Buffer, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """A numpy array over ``raw`` (no copy), for tests and callers that need values."""
    import numpy as np

    from ..dtypes import numpy_dtype

    return np.frombuffer(raw, dtype=numpy_dtype(dtype)).reshape(shape)


#: the dtypes a weight_scale of int4 may have
SCALE_DTYPES = ("F32", "F16", "BF16")

def _finite(raw: Buffer, dtype: str) -> bool:
    """Whether every F32/F16/BF16 value in ``raw`` is finite (a scale row: small)."""
    import numpy as np

    view, magnitude, inf, _ = NAN_BITS[dtype]
    return bool(((np.frombuffer(raw, dtype=view) & magnitude) < inf).all())


def _canonical_nans(out: np.ndarray, out_dtype: str, maybe: bool) -> memoryview:
    """The output bytes, read-only, with every NaN the dtype's one quiet NaN: the
    backends' NaN payloads differ (torch's even with the array's length), the values
    not. Only a NaN weight byte or a non-finite scale can make a NaN (``maybe``)."""
    if maybe:
        quiet_nans(out, out_dtype)
    return memoryview(out).toreadonly()


def _check_out(out_dtype: str) -> None:
    if out_dtype not in OUTPUT_DTYPES:
        raise ValueError(f"out_dtype {out_dtype!r} is not one of {', '.join(OUTPUT_DTYPES)}")


def _whole_rows(nbytes: int, row_elems: int, elem_size: int, what: str) -> int:
    width = row_elems * elem_size
    if width == 0 or nbytes % width:
        raise ValueError(f"{what}: {nbytes} bytes are not whole rows of {width} bytes")
    return nbytes // width


def _expect(got: int, want: int, what: str) -> None:
    if got != want:
        raise ValueError(f"{what}: {got} bytes given, {want} expected")
