"""dequant_mxfp4: an MXFP4 weight's ``*_blocks`` and ``*_scales`` (OCP MX, as gpt-oss
ships its experts) -> one floating-point tensor, exactly, a bounded run of groups at a time
(kernel in quant/mxfp4.py).

It reduces the two tensors over the template variable that names them
(``{X*}_{T:blocks,scales}``): ``blocks`` uint8 ``[..., G, 16]`` (32 e2m1 codes a group),
``scales`` uint8 (or F8_E8M0) ``[..., G]``, one e8m0 exponent per group; the output is
``[..., G * 32]``, the groups of a row one after another, as transformers'
``convert_moe_packed_tensors`` lays them out before its transpose (a rule that wants
transformers' layout adds ``transpose`` after it). Both tensors must be there, of those
dtypes and shapes, in a source whose ``quantization_config`` says ``mxfp4``: anything
else is a plan error naming the key. No inverse: quantizing is not exact.

Output blocks are runs of whole groups, about ``chunk_bytes`` each, a few in flight
(quant/pipeline.py), so memory does not depend on the tensor's size; any range of dim-0
indices can be made, so later ops read it by rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial
from math import prod
from typing import Any

from ..dtypes import DTYPE_SIZES
from ..errors import CheckpointFormatError
from ..quant.finite import first_nonfinite
from ..quant.mxfp4 import (
    GROUP_BYTES,
    GROUP_VALUES,
    dequant_mxfp4_groups,
    first_nonfinite_scale,
)
from ..quant.pipeline import in_order
from ..quant.schemes import Found
from .base import Block, Context, InputTensor, Value, View
from .dequant import _Dequant, _finite_args, _literals

_SCALE_DTYPES = ("U8", "F8_E8M0")


class DequantMxfp4(_Dequant):
    verb = "dequant_mxfp4"
    stands_for = None  # gpt-oss names the module's tensor X_blocks/X_scales: no member is "the weight"
    description = ("MXFP4 (gpt-oss): uint8 blocks [..., G, 16] (two e2m1 codes a byte, low nibble first) "
                   "times 2**(scale - 127), one e8m0 scales byte per 32 values -> bfloat16 (or dtype) "
                   "[..., G*32], as transformers dequantizes it.")

    def reduce(self, args: Any, ctx: Context, members: list[tuple[str, View]]) -> Value:
        names = _literals(args, ctx, members, ("blocks", "scales"))
        blocks, scales = names.get("blocks"), names.get("scales")
        bkey, skey = ctx.key("blocks"), ctx.key("scales")
        if blocks is None:
            raise ctx.error(f"orphan scales: {skey!r} has no {bkey!r} to scale; drop them with a skip rule "
                            "if that is intended", key=skey)
        if scales is None:
            raise ctx.error(f"missing scales: {bkey!r} holds MXFP4 codes but the source has no {skey!r}", key=bkey)
        self._config(ctx, _mxfp4)
        if blocks.dtype != "U8" or scales.dtype not in _SCALE_DTYPES:
            raise ctx.error(f"{bkey!r} is {blocks.dtype} and {skey!r} {scales.dtype}: MXFP4 blocks are U8 "
                            f"and scales U8 or F8_E8M0", key=bkey)
        shape = blocks.shape
        if len(shape) < 3 or shape[-1] != GROUP_BYTES or scales.shape != shape[:-1]:
            raise ctx.error(f"{bkey!r} {list(shape)} with {skey!r} {list(scales.shape)}: MXFP4 needs blocks "
                            f"[..., G, {GROUP_BYTES}] (at least [rows, G, {GROUP_BYTES}]) and scales [..., G] "
                            "of the same leading dims", key=bkey)
        out = self._out_dtype(args)
        return Block(self, {"dtype": out, **_finite_args(args, ctx, bkey)}, (blocks, scales),
                     (*shape[:-2], shape[-2] * GROUP_VALUES), out)

    def blocks(self, block: Block, inputs: Sequence[InputTensor], chunk_bytes: int,
               rows: range | None = None) -> Iterator[bytes | memoryview]:
        blocks, scales = inputs
        out_dtype = block.args["dtype"]
        per_row = prod(blocks.view.shape[1:-1])  # groups of one dim-0 index
        wanted = rows if rows is not None else range(block.shape[0])
        first, stop = wanted.start * per_row, min(wanted.stop, block.shape[0]) * per_row
        step = max(1, chunk_bytes // (GROUP_VALUES * DTYPE_SIZES[out_dtype]))

        def tasks() -> Iterator[Callable[[], memoryview]]:
            for start in range(first, stop, step):
                count = min(step, stop - start)
                s = scales.read(start, count)
                compute = partial(dequant_mxfp4_groups, blocks.read(start * GROUP_BYTES, count * GROUP_BYTES), s,
                                  out_dtype=out_dtype)
                yield _checked(block, compute, s, start * GROUP_VALUES)
        return in_order(tasks())


def _mxfp4(found: Found) -> None:
    found.require_method("mxfp4", "MXFP4 checkpoints (gpt-oss)")


def _checked(block: Block, compute: Callable[[], memoryview], scales: bytes, first: int) -> Callable[[], memoryview]:
    """``compute``, refusing an infinite value (scales from 253 up overflow the large codes)
    unless the rule allows them; only a block holding such a scale is scanned."""
    import numpy as np

    what, dtype = block.args["nonfinite"], block.args["dtype"]
    if what is None or not scales or int(np.frombuffer(scales, dtype=np.uint8).max()) < first_nonfinite_scale(dtype):
        return compute

    def run() -> memoryview:
        out = compute()
        bad = first_nonfinite(out, dtype)
        if bad is not None:
            index, value = bad
            at = _unravel(first + index, block.shape)
            raise CheckpointFormatError(
                f"{what} gives {value} at {at}: its e8m0 scale byte {scales[index // GROUP_VALUES]} makes "
                f"2**{scales[index // GROUP_VALUES] - 127} times the code, beyond {dtype}; fix the source, or add "
                "allow_nonfinite: true to the op to write such values")
        return out
    return run


def _unravel(flat: int, shape: tuple[int, ...]) -> list[int]:
    out = []
    for dim in reversed(shape):
        flat, i = divmod(flat, dim)
        out.append(i)
    return out[::-1]
