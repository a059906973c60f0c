"""MXFP4 (OCP MX, as gpt-oss ships it) -> floats, exactly, a bounded run of groups at a time.

A *group* is 32 e2m1 codes sharing one e8m0 scale: 16 bytes of ``*_blocks`` (two codes a
byte, the even element in the low nibble, quant/fp4.py) and one byte ``s`` of ``*_scales``.
Its values are what transformers' ``convert_moe_packed_tensors`` (what
``Mxfp4Config(dequantize=True)`` loads with) computes, ``torch.ldexp(e2m1[code], s - 127)``:
the exact product, rounded once to the output dtype. Exact, it has 3 significant bits and
is at least ``2**-128``, so bf16 and f32 hold it unless it reaches ``2**128``: then it is
+-inf (under ``s = 253..255``, the large codes). ``s = 255`` is a scale like any other
there (OCP calls it NaN; the reference does not, so ``0.5`` under it is ``2**127`` and a
zero code stays a zero), and ``-0`` stays ``-0``. Output in f16 rounds as torch rounds.

The product of each (scale, byte) pair, both of its values, is therefore one table entry:
65,536 entries (256 KiB for bf16 and f16 output, 512 KiB for f32) built once per dtype from
that definition, and a block of groups is one gather from it, with no float pass. The
gather is numpy's on every install: the same gather in torch was slower on this vm
(0.21-0.32 against 0.42 GB/s loaded, benchmarks/README.md), so there is no torch variant
to keep bit-identical.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from .float_bits import np_errors_ignored
from .fp4 import e2m1_table
from .kernels import OUTPUT_DTYPES, Buffer

if TYPE_CHECKING:
    import numpy as np

__all__ = ["GROUP_BYTES", "GROUP_VALUES", "dequant_mxfp4_groups", "first_nonfinite_scale"]

#: bytes of ``*_blocks`` per group, and the values they make
GROUP_BYTES = 16
GROUP_VALUES = 32

#: per output dtype: the unsigned type of one value, its exponent bits (all set: inf)
_BITS = {"BF16": ("<u2", 0x7F80), "F16": ("<u2", 0x7C00), "F32": ("<u4", 0x7F800000)}


def dequant_mxfp4_groups(blocks: Buffer, scales: Buffer, *, out_dtype: str = "BF16") -> memoryview:
    """The output bytes of ``len(scales)`` whole groups: ``blocks`` holds their 16 bytes
    each, ``scales`` their e8m0 byte.

    >>> out = dequant_mxfp4_groups(bytes([0x21, 0x8F] + [0] * 14), bytes([128]), out_dtype="F32")
    >>> import numpy as np
    >>> np.frombuffer(out, dtype="<f4")[:4].tolist()
    [1.0, 2.0, -12.0, -0.0]
    """
    import numpy as np

    groups = len(scales)
    if len(blocks) != groups * GROUP_BYTES:
        raise ValueError(f"MXFP4 blocks: {len(blocks)} bytes given for {groups} scales, "
                         f"{groups * GROUP_BYTES} expected")
    from .tables import scaled_pairs

    out = scaled_pairs(pair_table(out_dtype), np.frombuffer(blocks, dtype=np.uint8).reshape(groups, GROUP_BYTES),
                       np.frombuffer(scales, dtype=np.uint8))
    return memoryview(out.reshape(-1).view(np.uint8)).toreadonly()


@functools.cache
def pair_table(out_dtype: str) -> np.ndarray:
    """Entry ``s * 256 + byte``: the two output values of ``byte`` under scale ``s``, the
    low nibble's first (in the low half: little-endian, as safetensors stores them)."""
    import numpy as np

    bits = _code_bits(out_dtype)
    byte = np.arange(256)
    wide = np.uint64 if out_dtype == "F32" else np.uint32
    shift = wide(8 * bits.itemsize)
    return (bits[:, byte & 0xF].astype(wide) | (bits[:, byte >> 4].astype(wide) << shift)).reshape(-1)


@functools.cache
def first_nonfinite_scale(out_dtype: str) -> int:
    """The smallest scale byte under which some code is not finite in ``out_dtype`` (256:
    none): a block whose scales are all below it needs no scan of its output."""
    import numpy as np

    exponent = _BITS[out_dtype][1]
    bad = ((_code_bits(out_dtype) & exponent) == exponent).any(axis=1)
    return int(np.argmax(bad)) if bool(bad.any()) else 256


@functools.cache
def _code_bits(out_dtype: str) -> np.ndarray:
    """[256 scales, 16 codes]: the output dtype's bits of each code under each scale."""
    import numpy as np

    from .numpy_kernels import rounded_array

    if out_dtype not in OUTPUT_DTYPES:
        raise ValueError(f"out_dtype {out_dtype!r} is not one of {', '.join(OUTPUT_DTYPES)}")
    exponents = np.arange(-127, 129, dtype=np.int32)
    exact = np.ldexp(e2m1_table().astype(np.float64)[None, :], exponents[:, None])  # [256 scales, 16 codes]
    with np_errors_ignored():  # what float32 cannot hold (from 2**128 on) is +-inf, as in the reference
        values = exact.astype(np.float32)  # exact otherwise: 3 significant bits, at least 2**-128
        return np.ascontiguousarray(rounded_array(values, out_dtype)).view(_BITS[out_dtype][0])


