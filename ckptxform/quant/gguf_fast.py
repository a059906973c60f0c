"""Faster numpy decoders of the GGUF block formats gguf-py decodes slowest (Q8_0, Q4_K):
the same float32 operations in the same order as gguf-py's ``dequantize_blocks`` (so the
same bytes: tests/test_gguf_dequant.py compares them on every format), without its
intermediate splits and concatenations (measured on 4M values: Q8_0 0.36 -> 3.0 GB/s,
Q4_K 0.11 -> 1.4 GB/s; benchmarks/gguf_bench.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def _f16(column: np.ndarray) -> np.ndarray:
    """``[n, 2]`` uint8 holding one float16 a row -> float32 ``[n, 1]``."""
    return np.ascontiguousarray(column).view(np.float16).astype(np.float32)


def dequant_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Q8_0 ``[n, 34]``: float16 d, 32 int8 -> ``[n, 32]`` float32 ``q * d``."""
    out = blocks[:, 2:].view(np.int8).astype(np.float32)
    out *= _f16(blocks[:, :2])
    return out


def dequant_q4_k(blocks: np.ndarray) -> np.ndarray:
    """Q4_K ``[n, 144]``: float16 d, dmin, 12 bytes of eight 6-bit scales and mins, 128
    bytes of nibbles (low nibbles: sub-block 2j, high: 2j+1) -> ``[n, 256]`` float32
    ``(d * scale) * q - (dmin * min)``."""
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    packed = blocks[:, 4:16].reshape(n, 3, 4)
    low, mid, high = packed[:, 0], packed[:, 1], packed[:, 2]
    scale = np.concatenate([low & 0x3F, (high & 0x0F) | ((low >> 2) & 0x30)], axis=1)
    least = np.concatenate([mid & 0x3F, (high >> 4) | ((mid >> 2) & 0x30)], axis=1)
    step = (d * scale.astype(np.float32))[:, :, None]
    offset = (dmin * least.astype(np.float32))[:, :, None]
    codes = blocks[:, 16:].reshape(n, 4, 32)
    nibbles = np.empty((n, 4, 2, 32), np.uint8)
    np.bitwise_and(codes, 0x0F, out=nibbles[:, :, 0])
    np.right_shift(codes, 4, out=nibbles[:, :, 1])
    out = nibbles.reshape(n, 8, 32).astype(np.float32)
    out *= step
    out -= offset
    return out.reshape(n, 256)


#: GGUF type name -> a decoder of ``[n, type_size]`` uint8 blocks to ``[n, block_size]`` float32
FAST: dict[str, Callable[[np.ndarray], np.ndarray]] = {"Q8_0": dequant_q8_0, "Q4_K": dequant_q4_k}
