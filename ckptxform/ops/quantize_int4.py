"""quantize_w4a16: a floating-point weight -> compressed-tensors ``pack-quantized`` int4
(W4A16, or W4A16_ASYM with ``symmetric: false``), exactly as its CPU path computes them
(every rounding in ``ckptxform/quant/int4_quantize.py``).

``X.weight`` becomes ``weight_packed`` int32 ``[rows, ceil(cols/8)]`` (eight 4-bit codes a
word), ``weight_scale`` ``[rows, cols/group_size]`` in the weight's dtype, ``weight_shape``
int64 ``[rows, cols]`` and, asymmetric, ``weight_zero_point`` int32
``[ceil(rows/8), cols/group_size]`` (eight rows' zero points a word). ``strategy: channel``
is one scale (and zero point) per row: ``weight_scale`` ``[rows, 1]``. Which modules are
quantized is ``targets``/``ignore`` as for the other quantize ops (ops/quantize.py). A
targeted weight whose row is not whole groups is a plan error naming the key (compressed-tensors
refuses it too). No inverse: dequantizing (``dequant_int4``) gives the rounded values back.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

from ..dtypes import DTYPE_SIZES
from ..quant.int4_quantize import int4_rows, int4_scale_rows, int4_zero_point_rows
from ..quant.pipeline import in_order
from .base import Block, Context, InputTensor, Value, View
from .quantize import _COMMON, _guarded, _Quantize, _row_tasks

#: rows a zero-point word holds
_ZP_ROWS = 8


class QuantizeW4A16(_Quantize):
    verb = "quantize_w4a16"
    description = ("Weight -> weight_packed (int4, eight a int32), weight_scale (the weight's dtype, one per "
                   "group), weight_shape and, asymmetric, weight_zero_point: compressed-tensors pack-quantized "
                   "(W4A16, W4A16_ASYM); other tensors unchanged.")
    schema = {"type": "object", "additionalProperties": False, "required": ["into"],
              "properties": {**_COMMON,
                             "group_size": {"type": "integer", "minimum": 1, "default": 128,
                                            "description": "columns per scale (compressed-tensors' group_size)"},
                             "symmetric": {"type": "boolean", "default": True,
                                           "description": "false: a zero point per group (W4A16_ASYM)"},
                             "strategy": {"enum": ["group", "channel"], "default": "group",
                                          "description": "channel: one scale per row (group_size unused)"}}}
    parts = ("weight_packed", "weight_scale", "weight_shape")

    def part_names(self, args: Any) -> tuple[str, ...]:
        return self.parts if args.get("symmetric", True) else (*self.parts, "weight_zero_point")

    def _parts(self, args: Any, ctx: Context, key: str, value: View) -> list[tuple[str, Value]]:
        rows, cols = value.shape
        group = cols if args.get("strategy", "group") == "channel" else args.get("group_size", 128)
        if cols % group:
            raise ctx.error(f"{key!r} has {cols} columns: {self.verb} scales groups of {group} and {group} does not "
                            f"divide the row; add {key.rpartition('.')[0]!r} to ignore", key=key)
        common = {"dtype": value.dtype, "cols": cols, "group_size": group, "symmetric": args.get("symmetric", True),
                  "what": f"{ctx.label}: {key!r}", "key": key}
        groups = cols // group
        out: list[tuple[str, Value]] = [
            ("weight_packed", Block(self, {**common, "part": "weight_packed"}, (value,), (rows, -(-cols // 8)), "I32")),
            ("weight_scale", Block(self, {**common, "part": "weight_scale"}, (value,), (rows, groups), value.dtype)),
            ("weight_shape", Block(self, {**common, "part": "weight_shape", "rows": rows}, (value,), (2,), "I64"))]
        if not common["symmetric"]:
            out.append(("weight_zero_point", Block(self, {**common, "part": "weight_zero_point"}, (value,),
                                                   (-(-rows // _ZP_ROWS), groups), "I32")))
        return out

    def blocks(self, block: Block, inputs: Sequence[InputTensor], chunk_bytes: int,
               rows: range | None = None) -> Iterator[bytes | memoryview]:
        a = block.args
        dtype, cols, part = a["dtype"], a["cols"], a["part"]
        if part == "weight_shape":
            import numpy as np

            shape = np.array([a["rows"], cols], dtype="<i8")
            return iter([(shape if rows is None else shape[rows.start:rows.stop]).tobytes()])
        (weight,) = inputs
        total = weight.view.shape[0]
        per_task = max(1, chunk_bytes // max(1, cols * DTYPE_SIZES[dtype]))
        params = {"dtype": dtype, "cols": cols, "group_size": a["group_size"]}
        if part == "weight_zero_point":  # output row r: the zero points of rows 8r .. 8r + 7
            first, stop = (0, total) if rows is None else (rows.start * _ZP_ROWS, min(rows.stop * _ZP_ROWS, total))
            step = _ZP_ROWS * max(1, per_task // _ZP_ROWS)
            kernel = partial(int4_zero_point_rows, **params)
        else:
            first, stop = (0, total) if rows is None else (rows.start, min(rows.stop, total))
            step = per_task
            kernel = partial(int4_rows if part == "weight_packed" else int4_scale_rows, **params,
                             symmetric=a["symmetric"])
        return _guarded(block, in_order(_row_tasks(weight, dtype, cols, first, stop, step, kernel)))
