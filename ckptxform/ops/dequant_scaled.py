"""dequant_scaled: a module stored FP8 with a ``weight_scale`` (per tensor, per channel or
per block) or NVFP4 (compressed-tensors or ModelOpt) -> one floating-point weight, each
module by the scheme its own ``quantization_config`` group gives it
(quant/group_schemes.py), so a checkpoint mixing groups is dequantized group by group.

- FP8: ``weight`` (e4m3) times ``weight_scale``, computed as compressed-tensors'
  decompress does: the product in the scale's dtype (float32 scales stay float32; a bf16
  scale rounds the product to bf16 once), then the output dtype.
- NVFP4: e2m1 codes (two a byte, low nibble first) times a float32 group scale: the e4m3
  ``weight_scale`` divided by compressed-tensors' reciprocal ``weight_global_scale``, or
  multiplied by ModelOpt's ``weight_scale_2``. The global scale is in every value. Code 8
  is ``-0.0`` in compressed-tensors' reading and ``+0.0`` in ModelOpt's (its table).
- Activation scales (``input_scale``, ``input_global_scale``) are consumed and dropped: a
  floating-point model has no use for them.

A module stored unquantized is copied; a weight without its scale or global scale, a
scale without its weight, a part of another scheme, or a module whose group this op
cannot read (named) is a plan error naming the key. No inverse: quantizing is not exact.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial
from math import prod
from typing import Any

from ..dtypes import DTYPE_SIZES
from ..errors import QuantizationConfigError
from ..quant.group_schemes import NVFP4_GROUP, GroupSchemes, SchemeGroup, WeightScheme
from ..quant.kernels import Fp4Groups, Fp8Block, dequant_fp8_rows, dequant_nvfp4_rows, nvfp4_largest_scale
from ..quant.pipeline import in_order
from .base import Block, Context, InputTensor, Value, View
from .decode import cast_bytes
from .dequant import _aligned, _checked, _Dequant, _finite_args, _literals, _trimmed

_MEMBERS = ("weight", "weight_packed", "weight_scale", "weight_global_scale", "weight_scale_2", "input_scale",
            "input_global_scale")
#: activation scales: consumed, not written
_DROPPED = frozenset({"input_scale", "input_global_scale"})
#: the parts of a module per (kind, convention), the activation scales aside
_PARTS = {("fp8", "compressed-tensors"): ("weight", "weight_scale"),
          ("fp8", "modelopt"): ("weight", "weight_scale"),
          ("nvfp4", "compressed-tensors"): ("weight_packed", "weight_scale", "weight_global_scale"),
          ("nvfp4", "modelopt"): ("weight", "weight_scale", "weight_scale_2")}
_SCALE_DTYPES = ("F32", "BF16", "F16")


class DequantScaled(_Dequant):
    verb = "dequant_scaled"
    description = ("FP8 e4m3 weight x weight_scale (per tensor, channel or block) or NVFP4 (compressed-tensors "
                   "nvfp4-pack-quantized, ModelOpt NVFP4; the global scale included) -> bfloat16 (or dtype), each "
                   "module by its quantization_config group; activation scales dropped; unquantized weights copied.")

    def reduce(self, args: Any, ctx: Context, members: list[tuple[str, View]]) -> Value:
        names = _literals(args, ctx, members, _MEMBERS)
        module = ctx.key("weight").removesuffix(".weight")
        stored = sorted(set(names) - _DROPPED)
        if not stored:
            key = ctx.key(min(names))
            raise ctx.error(f"orphan scale: {key!r} has no weight {ctx.key('weight')!r}; drop it with a skip rule "
                            "if that is intended", key=key)
        config = self._config(ctx, GroupSchemes.parse)
        weight = names.get("weight")
        if stored == ["weight"] and weight is not None and weight.dtype not in ("F8_E4M3", "U8"):
            group = config.group_for(module, stored_quantized=False)
            if group is not None:
                raise ctx.error(f"{ctx.key('weight')!r} is stored unquantized ({weight.dtype}), but {group.path} "
                                f"targets {module!r}; the config does not describe this tensor", key=ctx.key("weight"))
            return weight  # not quantized: copied unchanged
        first = ctx.key(stored[0])
        group = config.group_for(module, stored_quantized=True)
        if group is None:
            ignored = config.ignored(module)
            why = f"{config.path}.ignore lists {ignored!r}" if ignored else f"no group of {config.path} targets it"
            raise ctx.error(f"{first!r} is quantized but {why}: the config does not describe this module", key=first)
        try:
            scheme = group.readable()
        except QuantizationConfigError as err:
            raise ctx.error(f"{first!r}: {err}", key=first) from None
        self._check_parts(ctx, names, scheme, group)
        if scheme.kind == "fp8":
            return self._fp8(args, ctx, names, scheme, group)
        return self._nvfp4(args, ctx, names, scheme, group)

    @staticmethod
    def _check_parts(ctx: Context, names: dict[str, View], scheme: WeightScheme, group: SchemeGroup) -> None:
        parts = _PARTS[(scheme.kind, scheme.convention)]
        what = f"{scheme.convention} {scheme.kind.upper()} ({group.path})"
        for part in sorted(set(names) - _DROPPED - set(parts)):
            raise ctx.error(f"{ctx.key(part)!r} is not part of a {what} module, whose parts are "
                            f"{', '.join(parts)}: the checkpoint is inconsistent", key=ctx.key(part))
        for part in parts:
            if part not in names:
                kind = ("missing global scale" if part in ("weight_global_scale", "weight_scale_2") else
                        "missing scale" if part == "weight_scale" else "incomplete module")
                raise ctx.error(f"{kind}: {ctx.key(part)!r} is missing beside {ctx.key(min(names))!r} "
                                f"({what} needs {', '.join(parts)}; the rule's key must enumerate them all)",
                                key=ctx.key(part))

    def _fp8(self, args: Any, ctx: Context, names: dict[str, View], scheme: WeightScheme,
             group: SchemeGroup) -> Block:
        weight, scale = names["weight"], names["weight_scale"]
        wkey, skey = ctx.key("weight"), ctx.key("weight_scale")
        if weight.dtype != "F8_E4M3" or len(weight.shape) != 2 or scale.dtype not in _SCALE_DTYPES:
            raise ctx.error(f"{wkey!r} {weight.dtype} {list(weight.shape)} with {skey!r} {scale.dtype}: {group.path} "
                            "is FP8, which needs a 2-D F8_E4M3 weight and a F32, BF16 or F16 scale", key=wkey)
        rows, cols = weight.shape
        block = {"tensor": (1, cols), "channel": (1, cols)}.get(scheme.strategy) or scheme.block
        assert block is not None  # group_schemes gives a block size to every block strategy
        want = {"tensor": [1], "channel": [rows, 1]}.get(scheme.strategy) or [-(-rows // block[0]),
                                                                               -(-cols // block[1])]
        fits = prod(scale.shape) == 1 if scheme.strategy == "tensor" else list(scale.shape) == want
        if not fits:
            raise ctx.error(f"{skey!r} has shape {list(scale.shape)}, but {group.path} is FP8 per {scheme.strategy}"
                            f", which for {wkey!r} {[rows, cols]} needs {want}: the quantization_config does not "
                            "match the tensors", key=skey)
        out = self._out_dtype(args)
        return Block(self, {"kind": "fp8", "block": block, "per_tensor": scheme.strategy == "tensor",
                            "scale_dtype": scale.dtype, "dtype": out, **_finite_args(args, ctx, wkey)},
                     (weight, scale, *_dropped(names)), (rows, cols), out)

    def _nvfp4(self, args: Any, ctx: Context, names: dict[str, View], scheme: WeightScheme,
               group: SchemeGroup) -> Block:
        modelopt = scheme.convention == "modelopt"
        pkey, gkey = ("weight", "weight_scale_2") if modelopt else ("weight_packed", "weight_global_scale")
        packed, scale, global_scale = names[pkey], names["weight_scale"], names[gkey]
        if (packed.dtype, len(packed.shape), scale.dtype, global_scale.dtype) != ("U8", 2, "F8_E4M3", "F32") or \
                prod(global_scale.shape) != 1:
            raise ctx.error(f"{ctx.key(pkey)!r} {packed.dtype} {list(packed.shape)}, weight_scale {scale.dtype} "
                            f"{list(scale.shape)}, {gkey} {global_scale.dtype} {list(global_scale.shape)}: "
                            f"{group.path} is NVFP4, which needs U8 [rows, cols/2], F8_E4M3 [rows, cols/16] and one "
                            "F32 value", key=ctx.key(pkey))
        rows, cols = packed.shape[0], packed.shape[1] * 2
        if cols % NVFP4_GROUP or list(scale.shape) != [rows, cols // NVFP4_GROUP]:
            raise ctx.error(f"{ctx.key('weight_scale')!r} has shape {list(scale.shape)}, but {ctx.key(pkey)!r} "
                            f"{list(packed.shape)} holds {rows} rows of {cols} codes, which need "
                            f"{[rows, cols // NVFP4_GROUP]} (one scale per {NVFP4_GROUP}): the quantization_config "
                            "does not match the tensors", key=ctx.key("weight_scale"))
        out = self._out_dtype(args)
        return Block(self, {"kind": "nvfp4", "modelopt": modelopt, "dtype": out,
                            **_finite_args(args, ctx, ctx.key(pkey))},
                     (packed, scale, global_scale, *_dropped(names)), (rows, cols), out)

    def blocks(self, block: Block, inputs: Sequence[InputTensor], chunk_bytes: int,
               rows: range | None = None) -> Iterator[bytes | memoryview]:
        program = _fp8_blocks if block.args["kind"] == "fp8" else _nvfp4_blocks
        total, cols = block.shape
        out_row = cols * DTYPE_SIZES[block.args["dtype"]]
        align = block.args["block"][0] if block.args["kind"] == "fp8" else 1
        step = align * max(1, chunk_bytes // max(1, align * out_row))
        first, stop = _aligned(rows, total, align)
        return _trimmed(in_order(program(block, inputs, range(first, stop), step)), rows, first, out_row)


def _dropped(names: dict[str, View]) -> tuple[View, ...]:
    """The activation scales, as inputs the block programs never read: the op consumes
    them (the audit lists them as its inputs), it does not leave them unread."""
    return tuple(names[n] for n in sorted(_DROPPED & set(names)))


def _fp8_blocks(block: Block, inputs: Sequence[InputTensor], rows: range,
                step: int) -> Iterator[Callable[[], memoryview]]:
    weight, scale = inputs[:2]
    cols = block.shape[1]
    layout = Fp8Block(cols, *block.args["block"])
    sdtype, out = block.args["scale_dtype"], block.args["dtype"]
    # compressed-tensors multiplies in the scale's dtype: a 16-bit scale rounds the (exact)
    # product to it first, and that is then cast to the output dtype
    product = out if sdtype in ("F32", out) else sdtype

    def widened(raw: bytes) -> bytes:
        return raw if sdtype == "F32" else bytes(cast_bytes(raw, sdtype, "F32"))

    whole = widened(scale.read(0, scale.view.nbytes)) if block.args["per_tensor"] else b""
    scale_row = layout.scale_cols * DTYPE_SIZES[sdtype]
    for start in range(rows.start, rows.stop, step):
        count = min(step, rows.stop - start)
        w = weight.read(start * cols, count * cols)
        s = whole * count if whole else widened(scale.read(start // layout.block_rows * scale_row,
                                                           layout.scale_rows(count) * scale_row))
        yield _checked(block, partial(_fp8_product, w, s, layout, product, out), start, scale=s, scale_dtype="F32",
                       largest_code=448.0, e4m3_codes=w)


def _fp8_product(weight: bytes, scale: bytes, layout: Fp8Block, product: str, out: str) -> memoryview:
    values = dequant_fp8_rows(weight, scale, layout, out_dtype=product)
    return values if product == out else memoryview(cast_bytes(values, product, out)).toreadonly()


def _nvfp4_blocks(block: Block, inputs: Sequence[InputTensor], rows: range,
                  step: int) -> Iterator[Callable[[], memoryview]]:
    import numpy as np

    packed, scale, global_scale = inputs[:3]
    cols = block.shape[1]
    modelopt = block.args["modelopt"]
    layout = Fp4Groups(cols, NVFP4_GROUP, signed_zero=not modelopt)
    g = float(np.frombuffer(global_scale.read(0, 4), dtype="<f4")[0])
    for start in range(rows.start, rows.stop, step):
        count = min(step, rows.stop - start)
        p = packed.read(start * layout.row_bytes, count * layout.row_bytes)
        e4m3 = scale.read(start * layout.groups, count * layout.groups)
        compute = partial(dequant_nvfp4_rows, p, e4m3, g, layout, divide=not modelopt, out_dtype=block.args["dtype"])
        # the finite check needs the largest group scale only, not the output
        yield _checked(block, compute, start, scale=nvfp4_largest_scale(e4m3, g, divide=not modelopt),
                       scale_dtype="F32", largest_code=6.0)
