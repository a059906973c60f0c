"""dequant_awq and dequant_gptq: an AutoAWQ (GEMM) or GPTQ module's tensors -> its
``weight`` ``[out, in]`` in bfloat16 (or dtype), exactly as their reference kernels compute it
on the CPU (quant/awq_gptq.py), a bounded band of output rows at a time.

Both reduce ``{X*}.{T:qweight,qzeros,scales,...,weight}``: a module stored unquantized
(``weight``) is copied; a quantized one must have each part, with the dtypes and shapes the
source's ``quantization_config`` (quant/awq_gptq_config.py) gives, or the plan fails naming
the key. Both formats store ``[in, out]``: a band of ``nn.Linear``'s rows is a band of their
columns, read once (ops/column_reads.py) and decoded straight into the output's layout, no
transposing op after it. No inverse: quantizing is not exact.
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
from .column_reads import read_columns
from .dequant import _aligned, _checked, _Dequant, _finite_args, _literals, _trimmed

_SCALES = ("F16", "BF16", "F32")
#: the largest |q - z| of 4-bit codes and zero points (GPTQ's v1 zero point reaches 16)
_LARGEST_DIFF = 16.0
#: (first output row, rows, their scales' bytes) -> the band's computation
_Band = Callable[[int, int, bytearray], Callable[[], memoryview]]


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
        return self._block(args, ctx, names)

    def _block(self, args: Any, ctx: Context, names: dict[str, View]) -> Block:
        raise NotImplementedError

    def _bands(self, block: Block, inputs: Sequence[InputTensor]) -> _Band:
        """What decodes output rows ``start .. start + count`` (count a multiple of 8) given
        their scales' columns."""
        raise NotImplementedError

    def blocks(self, block: Block, inputs: Sequence[InputTensor], chunk_bytes: int,
               rows: range | None = None) -> Iterator[bytes | memoryview]:
        total, width = block.shape  # [out, in]: the source's columns are the output's rows
        row_bytes = width * DTYPE_SIZES[block.args["dtype"]]
        step = 8 * max(1, chunk_bytes // max(1, 8 * row_bytes))
        first, stop = _aligned(rows, total, 8)  # 8 columns a packed word
        scales = inputs[2]
        sdtype, scale_row = scales.view.dtype, scales.view.row_nbytes

        def tasks() -> Iterator[Callable[[], memoryview]]:
            band = self._bands(block, inputs)
            for start in range(first, stop, step):
                count = min(step, stop - start)
                whole = -(-count // 8) * 8  # whole words of columns (total is a multiple of 8), cut after
                s = read_columns(scales, rows=scales.view.shape[0], row_bytes=scale_row,
                                 start=start * DTYPE_SIZES[sdtype], length=whole * DTYPE_SIZES[sdtype])
                compute = band(start, whole, s)
                if whole != count:
                    compute = partial(_first_rows, count * row_bytes, compute)
                yield _checked(block, compute, start, scale=s, scale_dtype=sdtype, largest_code=_LARGEST_DIFF)
        return _trimmed(in_order(tasks()), rows, first, row_bytes)

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
                            **_finite_args(args, ctx, ctx.key("qweight") + " ([out, in] index)")},
                     (qweight, qzeros, scales), (cols, rows), out)

    def _bands(self, block: Block, inputs: Sequence[InputTensor]) -> _Band:
        qweight, qzeros, scales = inputs
        cols, rows = block.shape
        word_row = qweight.view.row_nbytes
        from ..quant.awq_gptq import dequant_awq_columns  # numpy: not imported by a plan or a rename

        def band(start: int, count: int, s: bytearray) -> Callable[[], memoryview]:
            words = partial(read_columns, rows=rows, row_bytes=word_row, start=start // 8 * 4, length=count // 8 * 4)
            return partial(dequant_awq_columns, words(qweight), words(qzeros, rows=qzeros.view.shape[0]), s,
                           rows=rows, cols=count, group=block.args["group"], scale_dtype=scales.view.dtype,
                           out_dtype=block.args["dtype"])
        return band


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
                            **_finite_args(args, ctx, ctx.key("qweight") + " ([out, in] index)")},
                     inputs, (cols, rows), out)

    def _bands(self, block: Block, inputs: Sequence[InputTensor]) -> _Band:
        qweight, qzeros, scales = inputs[:3]
        cols, rows = block.shape
        groups = row_groups(block, inputs[3] if len(inputs) > 3 else None, rows)
        from ..quant.awq_gptq import dequant_gptq_columns  # numpy: not imported by a plan or a rename

        def band(start: int, count: int, s: bytearray) -> Callable[[], memoryview]:
            return partial(dequant_gptq_columns,
                           read_columns(qweight, rows=rows // 8, row_bytes=qweight.view.row_nbytes, start=start * 4,
                                        length=count * 4),
                           read_columns(qzeros, rows=qzeros.view.shape[0], row_bytes=qzeros.view.row_nbytes,
                                        start=start // 8 * 4, length=count // 8 * 4),
                           s, groups, rows=rows, cols=count, scale_dtype=scales.view.dtype,
                           out_dtype=block.args["dtype"])
        return band


def _first_rows(nbytes: int, compute: Callable[[], memoryview]) -> memoryview:
    return compute()[:nbytes]


def row_groups(block: Block, g_idx: InputTensor | None, rows: int) -> Any:
    """Each input row's group (int64 ``[rows]``: ``g_idx``'s, each checked to be a group the
    scales have), or the rows a group spans where the groups are ``row // group`` and the
    rows whole groups (the kernel then broadcasts a group's scale, no gather)."""
    import numpy as np

    group = block.args["group"]
    in_order = np.arange(rows, dtype=np.int64) // group
    if g_idx is None:
        return group if rows % group == 0 else in_order
    groups = np.frombuffer(g_idx.read(0, rows * 4), dtype="<i4").astype(np.int64)
    bad = np.flatnonzero((groups < 0) | (groups >= block.args["groups"]))
    if bad.size:
        row = int(bad[0])
        raise CheckpointFormatError(f"{block.args['label']}: {block.args['g_idx_key']!r}[{row}] is "
                                    f"{int(groups[row])}, but the module has {block.args['groups']} groups of "
                                    "scales; the checkpoint is corrupt", key=block.args["g_idx_key"])
    return group if rows % group == 0 and np.array_equal(groups, in_order) else groups
