"""dequant_awq and dequant_gptq: an AutoAWQ (GEMM) or GPTQ module's tensors -> its
``weight`` ``[out, in]`` in bfloat16 (or dtype), exactly as their reference kernels compute it
on the CPU (quant/awq_gptq.py), a bounded block of rows at a time.

Both reduce ``{X*}.{T:qweight,qzeros,scales,...,weight}``: a module stored unquantized
(``weight``) is copied; a quantized one must have each part, with the dtypes and shapes the
source's ``quantization_config`` (quant/awq_gptq_config.py) gives, or the plan fails naming
the key. Both formats store ``[in, out]``: the op decodes blocks of its rows (contiguous
reads of every part) and hands them to ``transpose`` (ops/transpose.py), which makes the
``nn.Linear`` layout in bounded tiles. No inverse: quantizing is not exact.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

from ..dtypes import DTYPE_SIZES
from ..errors import CheckpointFormatError
from ..quant.awq_gptq_config import AwqConfig, GptqConfig
from ..quant.pipeline import in_order
from .base import Block, Context, InputTensor, Value, View
from .dequant import _aligned, _checked, _Dequant, _finite_args, _literals, _trimmed
from .transpose import TRANSPOSE

_SCALES = ("F16", "BF16", "F32")
#: the largest |q - z| of 4-bit codes and zero points (GPTQ's v1 zero point reaches 16)
_LARGEST_DIFF = 16.0


class _QuantizedModule(_Dequant):
    """What both ops share: the members, the plain-weight case, the part checks."""

    members: tuple[str, ...]
    needed: tuple[str, ...] = ("qweight", "qzeros", "scales")

    def reduce(self, args: Any, ctx: Context, members: list[tuple[str, View]]) -> Value:
        names = _literals(args, ctx, members, self.members)
        parts = set(names) - {"weight"}
        if not parts:
            return names["weight"]  # stored unquantized: copied
        first = ctx.key(sorted(parts)[0])
        if "weight" in names:
            raise ctx.error(f"{ctx.key('weight')!r} and {first!r} are both present: a module is either quantized "
                            "or not", key=ctx.key("weight"))
        for part in self.needed:
            if part not in names:
                raise ctx.error(f"incomplete module: {ctx.key(part)!r} is missing beside {first!r} ({self.verb} "
                                f"needs {', '.join(self.needed)})", key=ctx.key(part))
        for part, view in names.items():
            want = _SCALES if part == "scales" else ("I32",)
            if view.dtype not in want:
                raise ctx.error(f"{ctx.key(part)!r} is {view.dtype}; {self.verb} needs {' or '.join(want)}",
                                key=ctx.key(part))
        inner = self._block(args, ctx, names)
        # the formats store [in, out]; the output is nn.Linear's [out, in]
        return TRANSPOSE.map([0, 1], ctx, ctx.block_input(inner))

    def _block(self, args: Any, ctx: Context, names: dict[str, View]) -> Block:
        raise NotImplementedError

    def _mismatch(self, ctx: Context, names: dict[str, View], why: str) -> Exception:
        shapes = ", ".join(f"{p} {list(names[p].shape)}" for p in self.members if p in names)
        return ctx.error(f"{ctx.key('qweight')!r}: {shapes}: {why}; the quantization_config does not match the "
                         "tensors", key=ctx.key("qweight"))


class DequantAwq(_QuantizedModule):
    verb = "dequant_awq"
    description = ("AutoAWQ GEMM int4 (qweight, qzeros, scales; AWQ's nibble order) -> weight [out, in] in "
                   "bfloat16 (or dtype), as awq's dequantize_gemm computes it; unquantized weights copied.")
    members = ("qweight", "qzeros", "scales", "weight")

    def _block(self, args: Any, ctx: Context, names: dict[str, View]) -> Block:
        config = self._config(ctx, AwqConfig.parse)
        module = ctx.key("qweight").removesuffix(".qweight")
        if not config.converted(module):
            raise ctx.error(f"{ctx.key('qweight')!r} is quantized, but {config.path}.modules_to_not_convert names "
                            f"{module!r}; the config does not describe this module", key=ctx.key("qweight"))
        qweight, qzeros, scales = names["qweight"], names["qzeros"], names["scales"]
        why = config.problem(qweight.shape, qzeros.shape, scales.shape)
        if why is not None:
            raise self._mismatch(ctx, names, why)
        rows, cols = qweight.shape[0], scales.shape[1]
        out = self._out_dtype(args)
        return Block(self, {"group": config.group_size, "dtype": out,
                            **_finite_args(args, ctx, ctx.key("qweight") + " ([in, out] index)")},
                     (qweight, qzeros, scales), (rows, cols), out)

    def blocks(self, block: Block, inputs: Sequence[InputTensor], chunk_bytes: int,
               rows: range | None = None) -> Iterator[bytes | memoryview]:
        qweight, qzeros, scales = inputs
        total, cols = block.shape
        group, out_dtype, sdtype = block.args["group"], block.args["dtype"], scales.view.dtype
        step = group * max(1, chunk_bytes // max(1, group * cols * DTYPE_SIZES[out_dtype]))
        word_row, scale_row = cols // 8 * 4, cols * DTYPE_SIZES[sdtype]
        first, stop = _aligned(rows, total, group)

        from ..quant.awq_gptq import dequant_awq_rows  # numpy: not imported by a plan or a rename

        def tasks() -> Iterator[Callable[[], memoryview]]:
            for start in range(first, stop, step):
                count = min(step, stop - start)
                g0, g1 = start // group, -(-(start + count) // group)
                s = scales.read(g0 * scale_row, (g1 - g0) * scale_row)
                compute = partial(dequant_awq_rows, qweight.read(start * word_row, count * word_row),
                                  qzeros.read(g0 * word_row, (g1 - g0) * word_row), s, first=start, cols=cols,
                                  group=group, scale_dtype=sdtype, out_dtype=out_dtype)
                yield _checked(block, compute, start, scale=s, scale_dtype=sdtype, largest_code=_LARGEST_DIFF)
        return _trimmed(in_order(tasks()), rows, first, cols * DTYPE_SIZES[out_dtype])


class DequantGptq(_QuantizedModule):
    verb = "dequant_gptq"
    description = ("GPTQ v1 int4 (qweight, qzeros, scales, g_idx; desc_act or not, symmetric or not) -> weight "
                   "[out, in] in bfloat16 (or dtype), as auto-gptq's QuantLinear computes it on the CPU; "
                   "unquantized weights copied.")
    members = ("qweight", "qzeros", "scales", "g_idx", "weight")

    def _block(self, args: Any, ctx: Context, names: dict[str, View]) -> Block:
        config = self._config(ctx, GptqConfig.parse)
        if config.desc_act and "g_idx" not in names:
            raise ctx.error(f"incomplete module: {ctx.key('g_idx')!r} is missing beside {ctx.key('qweight')!r}, and "
                            f"{config.path}.desc_act is true: the rows' groups are only known from it",
                            key=ctx.key("g_idx"))
        qweight, qzeros, scales = names["qweight"], names["qzeros"], names["scales"]
        g_idx = names.get("g_idx")
        why = config.problem(qweight.shape, qzeros.shape, scales.shape, None if g_idx is None else g_idx.shape)
        if why is not None:
            raise self._mismatch(ctx, names, why)
        rows, cols = qweight.shape[0] * 8, qweight.shape[1]
        out = self._out_dtype(args)
        inputs = (qweight, qzeros, scales) + (() if g_idx is None else (g_idx,))
        return Block(self, {"group": config.group_of(rows), "groups": scales.shape[0], "dtype": out,
                            "g_idx_key": ctx.key("g_idx"), "label": ctx.label,
                            **_finite_args(args, ctx, ctx.key("qweight") + " ([in, out] index)")},
                     inputs, (rows, cols), out)

    def blocks(self, block: Block, inputs: Sequence[InputTensor], chunk_bytes: int,
               rows: range | None = None) -> Iterator[bytes | memoryview]:
        qweight, qzeros, scales = inputs[:3]
        g_idx = inputs[3] if len(inputs) > 3 else None
        total, cols = block.shape
        out_dtype, sdtype = block.args["dtype"], scales.view.dtype
        step = 8 * max(1, chunk_bytes // max(1, 8 * cols * DTYPE_SIZES[out_dtype]))
        word_row, zero_row, scale_row = cols * 4, cols // 8 * 4, cols * DTYPE_SIZES[sdtype]
        first, stop = _aligned(rows, total, 8)

        from ..quant.awq_gptq import dequant_gptq_rows  # numpy: not imported by a plan or a rename

        def tasks() -> Iterator[Callable[[], memoryview]]:
            for start in range(first, stop, step):
                count = min(step, stop - start)
                whole = -(-count // 8) * 8  # rows of whole words (total is a multiple of 8), cut after
                groups = row_groups(block, g_idx, start, whole)
                g0, g1 = int(groups.min()), int(groups.max()) + 1
                s = scales.read(g0 * scale_row, (g1 - g0) * scale_row)
                compute = partial(_first_rows, count * cols * DTYPE_SIZES[out_dtype], partial(
                    dequant_gptq_rows, qweight.read(start // 8 * word_row, whole // 8 * word_row),
                    qzeros.read(g0 * zero_row, (g1 - g0) * zero_row), s, groups, first_group=g0, cols=cols,
                    scale_dtype=sdtype, out_dtype=out_dtype))
                yield _checked(block, compute, start, scale=s, scale_dtype=sdtype, largest_code=_LARGEST_DIFF)
        return _trimmed(in_order(tasks()), rows, first, cols * DTYPE_SIZES[out_dtype])


def _first_rows(nbytes: int, compute: Callable[[], memoryview]) -> memoryview:
    return compute()[:nbytes]


def row_groups(block: Block, g_idx: InputTensor | None, start: int, count: int) -> Any:
    """The groups of input rows ``start .. start + count`` (int64): ``g_idx``'s, each checked
    to be a group the scales have, or ``row // group`` where the checkpoint has no ``g_idx``."""
    import numpy as np

    if g_idx is None:
        return np.arange(start, start + count, dtype=np.int64) // block.args["group"]
    groups = np.frombuffer(g_idx.read(start * 4, count * 4), dtype="<i4").astype(np.int64)
    bad = np.flatnonzero((groups < 0) | (groups >= block.args["groups"]))
    if bad.size:
        row = int(bad[0])
        raise CheckpointFormatError(f"{block.args['label']}: {block.args['g_idx_key']!r}[{start + row}] is "
                                    f"{int(groups[row])}, but the module has {block.args['groups']} groups of "
                                    "scales; the checkpoint is corrupt", key=block.args["g_idx_key"])
    return groups
