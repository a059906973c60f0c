"""quantize_fp8_block, quantize_fp8_channel, quantize_nvfp4: a floating-point weight ->
the tensors compressed-tensors stores for it, exactly as its CPU path computes them
(kernels and every rounding in ``ckptxform/quant/quantize_kernels.py``).

Each splits ``X.weight`` into the parts of its format (``into`` names them in ``to``):

- ``quantize_fp8_block`` (``float-quantized``, FP8_BLOCK): ``weight`` e4m3 and
  ``weight_scale`` [ceil(rows/128), ceil(cols/128)] in the weight's dtype;
- ``quantize_fp8_channel`` (``float-quantized``, FP8_DYNAMIC's weights): ``weight`` e4m3
  and ``weight_scale`` [rows, 1] in the weight's dtype;
- ``quantize_nvfp4`` (``nvfp4-pack-quantized``, NVFP4A16): ``weight_packed`` uint8
  [rows, cols/2], ``weight_scale`` e4m3 [rows, cols/16], ``weight_global_scale`` f32 [1].
  With ``fuse: M`` (a variable of ``key``), the global scale is shared by the tensors
  that differ only in ``M`` (q/k/v, gate/up: vLLM serves them fused): its block program
  first reads every member's rows for their absolute maximum (a bounded pass, remembered
  per process for local files, so the members' other parts do not repeat it), then
  quantizes its own rows.

Which modules are quantized follows compressed-tensors' ``match_quantizable_tensors``:
``targets`` (module names, ``re:`` patterns matched at the start; ``Linear`` or an empty
list: every module) and ``ignore`` (the same), a module whose name ends in ``norm`` never,
and only a parameter named ``weight``. Any other tensor passes through unchanged, the reason
in its audit record. A targeted weight that is not 2-D, not BF16/F16/F32, or (NVFP4) whose
row is not whole groups of 16 is a plan error naming the key. None has an inverse:
dequantizing gives back the rounded values, not the weight.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any, ClassVar

import regex

from ..dtypes import DTYPE_SIZES
from ..errors import CheckpointFormatError
from ..quant.layouts import Fp8Block
from ..quant.pipeline import in_order
from ..quant.quantize_kernels import (
    NVFP4_GROUP,
    WEIGHT_DTYPES,
    NonFiniteWeight,
    UnscalableWeight,
    absmax,
    fp8_rows,
    fp8_scale_rows,
    nvfp4_global_scale,
    nvfp4_rows,
    nvfp4_scale_rows,
)
from .base import Block, BlockOp, Context, InputTensor, NoInverse, Value, View
from .dequant import _aligned, _trimmed

_VAR = {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"}
_NAMES = {"type": "array", "items": {"type": "string", "minLength": 1}}
_COMMON = {
    "into": _VAR,
    "targets": {**_NAMES, "default": ["Linear"],
                "description": "module names or 're:' patterns (compressed-tensors' targets); Linear: all"},
    "ignore": {**_NAMES, "default": [],
               "description": "module names or 're:' patterns left unquantized (compressed-tensors' ignore)"},
}
#: a pattern that runs longer than this is refused (a crafted pattern cannot hang a plan)
_MATCH_TIMEOUT_S = 1.0


def matches(entry: str, module: str) -> bool:
    """compressed-tensors' ``match_name``: ``re:`` + a regex matched at the start, else equality."""
    if entry.startswith("re:"):
        return regex.match(entry[3:], module, timeout=_MATCH_TIMEOUT_S) is not None
    return entry == module


def kept(args: Any, key: str) -> str | None:
    """Why ``key`` is not quantized under ``targets``/``ignore``, or None when it is."""
    module, _, param = key.rpartition(".")
    if module.endswith("norm"):
        return f"not quantized: {module!r} is a norm (compressed-tensors never quantizes a module named *norm)"
    if param != "weight":
        return f"not quantized: {param!r} is not a weight"
    targets = args.get("targets", ["Linear"])
    if targets and "Linear" not in targets and not any(matches(t, module) for t in targets):
        return f"not quantized: no entry of targets {targets} names {module!r}"
    hit = next((entry for entry in args.get("ignore", []) if matches(entry, module)), None)
    if hit is not None:
        return f"not quantized: ignore entry {hit!r} names {module!r}"
    return None


class _Quantize(BlockOp):
    kind = "split"
    yields = "either"  # a module left unquantized is its weight's bytes
    parts: ClassVar[tuple[str, ...]]

    def split(self, args: Any, ctx: Context, value: View, names: tuple[str, ...] | None) -> list[tuple[str, Value]]:
        key = ctx.source_key()
        if "{" in key.rpartition(".")[2]:
            raise ctx.error(f"{self.verb}: which parameter of {key.rpartition('.')[0]!r} the tensor is "
                            f"({key!r}) was consumed by an earlier op that names none of its members; "
                            "quantize only X.weight (put the quantize in a rule whose key names it)", key=key)
        try:
            if kept(args, key) is not None:
                return [("weight", value)]
        except (regex.error, TimeoutError) as err:
            raise ctx.error(f"{self.verb}: a targets/ignore pattern is not a usable regex ({err}); fix it") from None
        parts = self.part_names(args)
        if names is not None and not set(parts) <= set(names):
            raise ctx.error(f"{self.verb}: 'to' must enumerate {args['into']} with the parts it writes: "
                            f"{{{args['into']}:{','.join(('weight',) + tuple(p for p in parts if p != 'weight'))}}}")
        if value.dtype not in WEIGHT_DTYPES or len(value.shape) != 2 or value.shape[1] == 0:
            raise ctx.error(f"{key!r} is {value.dtype} {list(value.shape)}: {self.verb} quantizes 2-D BF16, F16 or "
                            f"F32 weights with columns; add {key.rpartition('.')[0]!r} to ignore (or narrow targets)", key=key)
        return self._parts(args, ctx, key, value)

    def _parts(self, args: Any, ctx: Context, key: str, value: View) -> list[tuple[str, Value]]:
        raise NotImplementedError

    def part_names(self, args: Any) -> tuple[str, ...]:
        """The tensors a quantized weight becomes (``to`` must name each)."""
        return self.parts

    def kept_reason(self, args: Any, key: str) -> str | None:
        return kept(args, key)

    def inverse(self, args: Any) -> tuple[str, Any]:
        raise NoInverse(f"{self.verb} cannot be undone exactly: dequantizing gives the rounded values back")

    def describe(self, args: Any) -> str:
        return f"{self.verb} into {args['into']}"


class QuantizeFp8Block(_Quantize):
    verb = "quantize_fp8_block"
    description = ("Weight -> float8_e4m3fn weight and weight_scale (the weight's dtype) per block "
                   "(compressed-tensors FP8_BLOCK, float-quantized); other tensors unchanged.")
    schema = {"type": "object", "additionalProperties": False, "required": ["into"],
              "properties": {**_COMMON, "block": {"type": "array", "items": {"type": "integer", "minimum": 1},
                                                  "minItems": 2, "maxItems": 2, "default": [128, 128]}}}
    parts = ("weight", "weight_scale")

    def layout(self, args: Any, cols: int) -> Fp8Block:
        rows, width = args.get("block", [128, 128])
        return Fp8Block(cols=cols, block_rows=rows, block_cols=width)

    def _parts(self, args: Any, ctx: Context, key: str, value: View) -> list[tuple[str, Value]]:
        rows, cols = value.shape
        layout = self.layout(args, cols)
        common = {"layout": (layout.cols, layout.block_rows, layout.block_cols), "dtype": value.dtype,
                  "what": f"{ctx.label}: {key!r}", "key": key}
        scale_shape = (layout.scale_rows(rows), layout.scale_cols)
        return [("weight", Block(self, {**common, "part": "weight"}, (value,), (rows, cols), "F8_E4M3")),
                ("weight_scale", Block(self, {**common, "part": "weight_scale"}, (value,), scale_shape, value.dtype))]

    def blocks(self, block: Block, inputs: Sequence[InputTensor], chunk_bytes: int,
               rows: range | None = None) -> Iterator[bytes | memoryview]:
        (weight,) = inputs
        layout = Fp8Block(*block.args["layout"])
        dtype, bh = block.args["dtype"], layout.block_rows
        total = weight.view.shape[0]
        step = bh * max(1, chunk_bytes // max(1, bh * layout.cols * DTYPE_SIZES[dtype]))
        if block.args["part"] == "weight_scale":  # output rows are block rows
            first_block, stop_block = (0, block.shape[0]) if rows is None else (rows.start, min(rows.stop, block.shape[0]))
            kernel = partial(fp8_scale_rows, dtype=dtype, layout=layout)
            return _guarded(block, in_order(_row_tasks(weight, dtype, layout.cols, first_block * bh,
                                                       min(total, stop_block * bh), step, kernel)))
        first, stop = _aligned(rows, total, bh)
        pieces = in_order(_row_tasks(weight, dtype, layout.cols, first, stop, step,
                                     partial(fp8_rows, dtype=dtype, layout=layout)))
        return _trimmed(_guarded(block, pieces), rows, first, layout.cols)


class QuantizeFp8Channel(QuantizeFp8Block):
    verb = "quantize_fp8_channel"
    description = ("Weight -> float8_e4m3fn weight and weight_scale [rows, 1] (the weight's dtype), one "
                   "scale per output channel (compressed-tensors FP8_DYNAMIC's weights); others unchanged.")
    schema = {"type": "object", "additionalProperties": False, "required": ["into"], "properties": dict(_COMMON)}

    def layout(self, args: Any, cols: int) -> Fp8Block:
        return Fp8Block(cols=cols, block_rows=1, block_cols=max(1, cols))


class QuantizeNvfp4(_Quantize):
    verb = "quantize_nvfp4"
    description = ("Weight -> weight_packed (e2m1, two a byte), weight_scale (e4m3 per 16) and "
                   "weight_global_scale (f32; shared over `fuse`), compressed-tensors nvfp4-pack-quantized.")
    schema = {"type": "object", "additionalProperties": False, "required": ["into"],
              "properties": {**_COMMON, "fuse": {**_VAR, "description": "a variable of key: the tensors differing "
                                                 "only in it share one global scale (q/k/v, gate/up)"}}}
    parts = ("weight_packed", "weight_scale", "weight_global_scale")

    def _parts(self, args: Any, ctx: Context, key: str, value: View) -> list[tuple[str, Value]]:
        rows, cols = value.shape
        if cols % NVFP4_GROUP:
            raise ctx.error(f"{key!r} has {cols} columns: NVFP4 scales groups of {NVFP4_GROUP} and {NVFP4_GROUP} "
                            f"does not divide the row; add {key.rpartition('.')[0]!r} to ignore", key=key)
        members: list[tuple[str, View]] = [(key, value)]
        if "fuse" in args:
            members = [(k, v) for _, k, v in ctx.siblings(args["fuse"])]
            for other, view in members:
                why = kept(args, other)
                if why is not None or view.dtype not in WEIGHT_DTYPES or len(view.shape) != 2 or view.shape[1] != cols:
                    raise ctx.error(f"{self.verb} fuse {args['fuse']}: {key!r} shares its global scale with {other!r}, "
                                    f"which {why or f'is {view.dtype} {list(view.shape)}'}; quantize the set alike "
                                    "(ignore all of it or none)", key=other)
        own = [k for k, _ in members].index(key)
        views = tuple(v for _, v in members)
        common = {"dtype": value.dtype, "cols": cols, "own": own, "what": f"{ctx.label}: {key!r}", "key": key}
        return [("weight_packed", Block(self, {**common, "part": "weight_packed"}, views, (rows, cols // 2), "U8")),
                ("weight_scale", Block(self, {**common, "part": "weight_scale"}, views,
                                       (rows, cols // NVFP4_GROUP), "F8_E4M3")),
                ("weight_global_scale", Block(self, {**common, "part": "weight_global_scale"}, views, (1,), "F32"))]

    def blocks(self, block: Block, inputs: Sequence[InputTensor], chunk_bytes: int,
               rows: range | None = None) -> Iterator[bytes | memoryview]:
        dtype, cols, part = block.args["dtype"], block.args["cols"], block.args["part"]
        try:
            scale = nvfp4_global_scale(_fused_absmax(inputs, dtype, chunk_bytes), dtype)
        except NonFiniteWeight:
            raise _nonfinite(block) from None
        except UnscalableWeight as err:
            fused = " (with the tensors it shares its global scale with)" if len(inputs) > 1 else ""
            raise CheckpointFormatError(f"{block.args['what']}{fused}: its largest magnitude is too small for an "
                                        f"NVFP4 global scale ({err}), so every value would dequantize to 0 or a "
                                        "wrong scale; add its module to ignore", key=block.args["key"]) from None
        if part == "weight_global_scale":
            import numpy as np

            return iter([np.array([scale], dtype="<f4").tobytes()] if rows is None or 0 in rows else [])
        weight = inputs[block.args["own"]]
        total = weight.view.shape[0]
        first, stop = (0, total) if rows is None else (rows.start, min(rows.stop, total))
        step = max(1, chunk_bytes // max(1, cols * DTYPE_SIZES[dtype]))
        kernel = nvfp4_rows if part == "weight_packed" else nvfp4_scale_rows
        return _guarded(block, in_order(_row_tasks(weight, dtype, cols, first, stop, step,
                                                   partial(kernel, dtype=dtype, cols=cols, global_scale=scale))))


def _row_tasks(weight: InputTensor, dtype: str, cols: int, first: int, stop: int, step: int,
               kernel: Callable[[bytes], bytes | memoryview]) -> Iterator[Callable[[], bytes | memoryview]]:
    """One task per ``step`` rows of ``weight`` in ``[first, stop)``: read here, computed on a worker."""
    row = cols * DTYPE_SIZES[dtype]
    for start in range(first, stop, step):
        count = min(step, stop - start)
        yield partial(kernel, weight.read(start * row, count * row))


def _guarded(block: Block, pieces: Iterator[bytes | memoryview]) -> Iterator[bytes | memoryview]:
    """``pieces``, a non-finite weight value turned into the error naming the tensor."""
    try:
        yield from pieces
    except NonFiniteWeight:
        raise _nonfinite(block) from None


def _nonfinite(block: Block) -> CheckpointFormatError:
    return CheckpointFormatError(f"{block.args['what']} holds NaN or infinite values, which cannot be quantized; "
                                 "fix the checkpoint, or add its module to ignore", key=block.args["key"])


#: absmax of a fused set of local tensors, by (file, offset, bytes) of each member: the
#: parts of every member need it, and it is the same whichever program asks
_ABSMAX: dict[tuple[Any, ...], float] = {}
_ABSMAX_LOCK = threading.Lock()


def _fused_absmax(inputs: Sequence[InputTensor], dtype: str, chunk_bytes: int) -> float:
    key = tuple((i.local, i.view.nbytes) for i in inputs) if all(i.local for i in inputs) else None
    if key is not None:
        with _ABSMAX_LOCK:
            if key in _ABSMAX:
                return _ABSMAX[key]
    best = 0.0
    for tensor in inputs:
        cols = tensor.view.shape[1]
        step = max(1, chunk_bytes // max(1, cols * DTYPE_SIZES[dtype]))
        tasks = _row_tasks(tensor, dtype, cols, 0, tensor.view.shape[0], step,
                           partial(absmax, dtype=dtype, cols=cols))
        best = max([best, *in_order(tasks)])
    if key is not None:
        with _ABSMAX_LOCK:
            if len(_ABSMAX) > 4096:
                _ABSMAX.clear()
            _ABSMAX[key] = best
    return best
