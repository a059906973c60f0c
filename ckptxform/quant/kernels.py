"""Exact dequantization of one block of weight rows (torch on CPU, vectorised).

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

torch is imported inside the functions: importing this module costs nothing to
``validate`` or ``plan``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..dtypes import DTYPE_SIZES

if TYPE_CHECKING:
    import torch

__all__ = ["Fp8Block", "Int4Groups", "dequant_fp8_rows", "dequant_int4_rows", "tensor_view"]

Buffer = bytes | bytearray | memoryview

#: output dtypes a dequantization may produce (safetensors names)
OUTPUT_DTYPES = ("BF16", "F16", "F32")


@dataclass(frozen=True)
class Fp8Block:
    """An FP8 weight of ``cols`` columns scaled per ``block_rows x block_cols`` block."""

    cols: int
    block_rows: int
    block_cols: int

    @property
    def scale_cols(self) -> int:
        return -(-self.cols // self.block_cols)

    def scale_rows(self, rows: int) -> int:
        return -(-rows // self.block_rows)


@dataclass(frozen=True)
class Int4Groups:
    """An int4 weight of ``cols`` columns packed 8 per int32 word, one scale per
    ``group_size`` columns of a row, scales of dtype ``scale_dtype`` (safetensors name)."""

    cols: int
    group_size: int
    scale_dtype: str

    @property
    def words(self) -> int:
        return -(-self.cols // 8)

    @property
    def groups(self) -> int:
        return -(-self.cols // self.group_size)

    @staticmethod
    def zero_point_rows(rows: int) -> int:
        return -(-rows // 8)


def dequant_fp8_rows(weight: Buffer, scale_inv: Buffer, layout: Fp8Block, *,
                     out_dtype: str = "BF16") -> memoryview:
    """The output bytes of the rows of an F8_E4M3 weight in ``weight`` (whole rows,
    starting at a block boundary), given the F32 scale rows covering them.

    >>> import torch
    >>> w = torch.ones(3, 5, dtype=torch.float8_e4m3fn)
    >>> s = torch.tensor([[2.0, 0.5]])
    >>> out = dequant_fp8_rows(bytes(w.view(torch.uint8).numpy()), bytes(s.numpy()),
    ...                        Fp8Block(cols=5, block_rows=4, block_cols=4))
    >>> tensor_view(out, "BF16", (3, 5))[0].tolist()
    [2.0, 2.0, 2.0, 2.0, 0.5]
    """
    import torch

    rows = _whole_rows(len(weight), layout.cols, 1, "FP8 weight")
    blocks = layout.scale_rows(rows)
    _expect(len(scale_inv), blocks * layout.scale_cols * 4, "F32 scale_inv rows")
    s = _as_tensor(scale_inv, torch.float32).view(blocks, layout.scale_cols)
    out = _decode_e4m3(_as_tensor(weight, torch.int8), rows * layout.cols).view(rows, layout.cols)
    # The decoded values are the weights times 2**-120. Folding 2**120 into the scales
    # saves a pass and changes no bit: both factors are exact, so their product is the
    # same real number, rounded once, as long as the scaled scales do not overflow.
    if bool(s.abs().max() < 2.0 ** 8):
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


def dequant_int4_rows(packed: Buffer, scale: Buffer, layout: Int4Groups, *,
                      zero_point: Buffer | None = None, out_dtype: str = "BF16") -> memoryview:
    """The output bytes of the rows of an int4 weight packed in ``packed`` (I32 words,
    whole rows), given the scale rows of the same rows and, for an asymmetric scheme,
    the packed zero-point rows (I32, 8 rows per word; the block must start at a multiple
    of 8 rows).

    >>> import torch
    >>> words = torch.tensor([[0x76543210, 0xFEDCBA98]], dtype=torch.int64).to(torch.int32)
    >>> out = dequant_int4_rows(bytes(words.numpy()), bytes(torch.ones(1, 1).numpy()),
    ...                         Int4Groups(cols=16, group_size=16, scale_dtype="F32"),
    ...                         out_dtype="F32")
    >>> tensor_view(out, "F32", (1, 16))[0].tolist()[:9]
    [-8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0, 0.0]
    """
    import torch

    from ..dtypes import torch_dtype

    rows = _whole_rows(len(packed), layout.words, 4, "packed int4 weight")
    ssize = DTYPE_SIZES[layout.scale_dtype]
    _expect(len(scale), rows * layout.groups * ssize, f"{layout.scale_dtype} weight_scale rows")
    sdtype = torch_dtype(layout.scale_dtype)
    nibbles = _nibbles(_as_tensor(packed, torch.uint8).view(rows, layout.words * 4))[:, :layout.cols]
    if zero_point is None:
        # q = nibble - 8, wrapped in uint8 and read as int8: exact, and half the bytes of
        # subtracting in the scale's dtype
        values = nibbles.sub_(8).view(torch.int8).to(sdtype)
    else:
        values = nibbles.to(sdtype)
        zp_rows = layout.zero_point_rows(rows)
        _expect(len(zero_point), zp_rows * layout.groups * 4, "I32 weight_zero_point rows")
        zp_bytes = _as_tensor(zero_point, torch.uint8).view(zp_rows, layout.groups, 4)
        # words hold 8 consecutive rows: nibble k of word [w, g] is row 8w + k
        zp = _nibbles(zp_bytes).view(zp_rows, layout.groups, 8).transpose(1, 2)
        zp = zp.reshape(zp_rows * 8, layout.groups)[:rows]
        # (q + 8) - (zp + 8): the stored offsets cancel; the difference is exact
        _per_group(values, layout).sub_(zp.to(sdtype)[:, :, None])
    s = _as_tensor(scale, sdtype).view(rows, layout.groups)
    _per_group(values, layout).mul_(s[:, :, None])  # one rounding in the scale's dtype, as compressed-tensors
    return _to_bytes(values, out_dtype, copy=False)


def tensor_view(raw: Buffer, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over ``raw`` (no copy), for tests and callers that need values."""
    from ..dtypes import torch_dtype

    return _as_tensor(raw, torch_dtype(dtype)).view(shape)


def _decode_e4m3(raw: torch.Tensor, n: int) -> torch.Tensor:
    """float32 values of ``n`` e4m3fn bytes (given as int8) TIMES 2**-120, exactly, in a
    per-thread scratch buffer. torch's own float8 -> float32 conversion is a scalar loop
    here (~5x slower); this is three vectorised integer passes.

    Sign-extended to int32 and shifted left by 20, a byte's sign lands in bit 31 (bits
    27-31 are copies of it) and its exponent and mantissa in bits 23-26 and 20-22: masked,
    that is the float32 of the same value times 2**-120 (subnormals included, as the two
    formats' subnormals differ by the same power of two). The NaN bytes 0x7F/0xFF would
    come out as +-480: they are made NaN, as torch's float8_e4m3fn (and OCP's FP8
    definition) decode them.
    """
    import torch

    bits = _scratch(n)
    bits.copy_(raw)
    bits.bitwise_left_shift_(20).bitwise_and_(_E4M3_MASK)
    # 0x7F is int8's largest value and 0xFF uint8's: two reductions find them, no mask
    if n and (int(raw.max()) == 0x7F or int(raw.view(torch.uint8).max()) == 0xFF):
        bits[raw.bitwise_and(0x7F) == 0x7F] = _F32_NAN
    return bits.view(torch.float32)


#: sign bit and the 7 bits of exponent+mantissa, after the shift (as a signed int32)
_E4M3_MASK = 0x87F00000 - (1 << 32)
#: float32's quiet NaN, as an int32
_F32_NAN = 0x7FC00000

_local = threading.local()


def _scratch(n: int) -> torch.Tensor:
    """An int32 buffer of ``n`` elements owned by this thread, reused across blocks: a
    fresh allocation per block would page-fault its way through every byte again."""
    import torch

    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < n:
        buf = _local.buf = torch.empty(n, dtype=torch.int32)
    return buf[:n]


def _nibbles(raw: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> uint8 [..., 2n]: low nibble first (little-endian words)."""
    import torch

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
    import warnings

    import torch

    if not len(raw):
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(raw, dtype=dtype)


def _to_bytes(values: torch.Tensor, out_dtype: str, *, copy: bool) -> memoryview:
    """The bytes of ``values`` cast to ``out_dtype`` (round to nearest even); ``copy``
    when ``values`` will be overwritten, since the caller may hold the bytes a while."""
    import torch

    from ..dtypes import torch_dtype

    if out_dtype not in OUTPUT_DTYPES:
        raise ValueError(f"out_dtype {out_dtype!r} is not one of {', '.join(OUTPUT_DTYPES)}")
    out = values.to(torch_dtype(out_dtype), copy=copy).contiguous()
    return memoryview(out.view(torch.uint8).numpy()).cast("B").toreadonly()


def _whole_rows(nbytes: int, row_elems: int, elem_size: int, what: str) -> int:
    width = row_elems * elem_size
    if width == 0 or nbytes % width:
        raise ValueError(f"{what}: {nbytes} bytes are not whole rows of {width} bytes")
    return nbytes // width


def _expect(got: int, want: int, what: str) -> None:
    if got != want:
        raise ValueError(f"{what}: {got} bytes given, {want} expected")
