"""FP8 quantization of a block of weight rows on torch: what ``quantize_kernels`` runs
where torch is installed (the same backend choice as dequantization, ``kernels.backend``),
bit-identical to its numpy kernels (tests/test_quantize_backends.py).

This is compressed-tensors' own CPU arithmetic, op for op: the block absmax in the
weight's dtype, ``absmax / 448`` and ``x / scale`` in the weight's dtype (torch computes
a BF16/F16 quotient in float32 and rounds it once, to nearest even), the clamp to +-448,
and the cast to e4m3 (to nearest even, the sign of zero kept). numpy has no BF16
arithmetic and spends most of its time on the casts around it (measured on a
[128, 14336] BF16 band, one thread: 8.5 ms torch, 11.5 ms numpy).
"""

from __future__ import annotations

import torch

from ..dtypes import torch_dtype
from .layouts import Fp8Block
from .quantize_shared import FP8_MAX, NonFiniteWeight, eps
from .torch_buffers import as_tensor

Buffer = bytes | bytearray | memoryview


def fp8_scale_rows(weight: Buffer, dtype: str, layout: Fp8Block) -> bytes:
    """The scale rows (in ``dtype``) of whole block rows of a weight."""
    scales = _scales(_blocks(_values(weight, dtype, layout.cols), layout), dtype)
    if not scales.numel():
        return b""
    return scales.contiguous().view(torch.uint8).numpy().tobytes()  # numpy has no BF16


def fp8_rows(weight: Buffer, dtype: str, layout: Fp8Block) -> memoryview:
    """The e4m3 codes of whole block rows of a weight (each block by its own scale)."""
    x = _values(weight, dtype, layout.cols)
    blocks = _blocks(x, layout)
    q = blocks / _scales(blocks, dtype)[:, None, :, None]
    q.clamp_(-FP8_MAX, FP8_MAX)
    sr, bh, sc, bw = q.shape
    codes = q.to(torch.float8_e4m3fn).view(torch.uint8).view(sr * bh, sc * bw)[:x.shape[0], :layout.cols]
    return memoryview(codes.contiguous().numpy().reshape(-1))


def _values(weight: Buffer, dtype: str, cols: int) -> torch.Tensor:
    """``[rows, cols]`` of the weight's bytes in its own dtype (a view, no copy)."""
    flat = as_tensor(weight, torch_dtype(dtype))
    if cols == 0 or flat.numel() % cols:
        raise ValueError(f"{flat.numel()} values are not whole rows of {cols}")
    return flat.view(-1, cols)


def _blocks(x: torch.Tensor, layout: Fp8Block) -> torch.Tensor:
    """``x`` as [block rows, bh, block cols, bw], zero-padded where an edge block is
    partial (zeros change no absmax, and their codes are cut off again)."""
    rows, cols = x.shape
    bh, bw = layout.block_rows, layout.block_cols
    sr, sc = layout.scale_rows(rows), layout.scale_cols
    if rows % bh or cols % bw:
        padded = x.new_zeros((sr * bh, sc * bw))
        padded[:rows, :cols] = x
        x = padded
    return x.view(sr, bh, sc, bw)


def _scales(blocks: torch.Tensor, dtype: str) -> torch.Tensor:
    """``[block rows, block cols]`` in the weight's dtype: each block's scale."""
    if dtype in _INF_BITS:
        # the magnitude bits of a BF16/F16 value order as the values do (NaN above inf):
        # an integer max is the absmax, exactly, at half the cost of abs() then amax()
        bits = (blocks.view(torch.int16) & 0x7FFF).amax(dim=(1, 3))
        if bool((bits >= _INF_BITS[dtype]).any()):
            raise NonFiniteWeight("the weight holds NaN or infinite values")
        amax = bits.view(blocks.dtype)
    else:
        amax = blocks.abs().amax(dim=(1, 3))
        if not bool(torch.isfinite(amax).all()):
            raise NonFiniteWeight("the weight holds NaN or infinite values")
    scale = amax / FP8_MAX
    return scale.masked_fill_(scale == 0, eps(dtype))


#: the bits of +inf in the 16-bit weight dtypes (a larger magnitude is NaN)
_INF_BITS = {"BF16": 0x7F80, "F16": 0x7C00}
