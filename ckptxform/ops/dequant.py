"""dequant_fp8_block and dequant_int4: a quantized module's tensors -> one floating-point
weight, exactly, a bounded block of rows at a time (kernels in ``ckptxform/quant``).

Both reduce the module's tensors over the template variable that names them
(``{X*}.{T:weight,weight_scale_inv}``) and judge each group themselves, from the
members' dtypes and the source's ``quantization_config`` (quant/schemes.py):
a module stored unquantized is copied as it is; a quantized weight without its scale,
a scale without its weight, or a module the config does not describe is a plan error
naming the key. Neither has an inverse: quantizing is not exact.

Output blocks: FP8, whole blocks of ``block_rows`` weight rows plus their scale row;
int4, rows (a multiple of 8 for the packed zero point). Each block is at most about
``chunk_bytes`` of output, a few are in flight (quant/pipeline.py), so memory does not
depend on the tensor's size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any, ClassVar, TypeVar

from ..dtypes import DTYPE_SIZES, USER_DTYPES
from ..errors import QuantizationConfigError
from ..quant.kernels import Fp8Block, Int4Groups, dequant_fp8_rows, dequant_int4_rows
from ..quant.finite import checked
from ..quant.pipeline import in_order
from ..quant.schemes import CompressedConfig, Found, Fp8BlockConfig, find_quantization_config
from .base import Block, BlockOp, Context, InputTensor, NoInverse, Value, View

_OUT_DTYPES = ("bfloat16", "float16", "float32")
#: an FP8 block's output at most (one block row where a row block is larger): the writer
#: hashes and writes it while it is still in cache; 1 GB of FP8 (2.64 GB of bf16) took
#: ~2.0 system seconds and 85 MB at 2 MiB against ~3.0 s and 180-190 MB at the plan's
#: 16 MiB (benchmarks/README.md, "FP8 dequant end to end")
FP8_CHUNK_BYTES = 2 << 20
#: FP8 blocks decoded at once by ``blocks`` (rows of the output read by an op chain): one.
#: A whole output is decoded by ``block_tasks`` on the pipeline's workers, each block hashed
#: and written by the thread that decoded it (engine/run/stream.py): 0.95-0.97 of the time
#: of one decoder handing its blocks to a write thread (1 GB of FP8, benchmarks/README.md,
#: "FP8 dequant end to end, fifth pass")
FP8_WORKERS = 1
_Parsed = TypeVar("_Parsed")
_ARGS = {"type": "object", "additionalProperties": False, "required": ["over"],
         "properties": {"over": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
                        "dtype": {"enum": list(_OUT_DTYPES), "default": "bfloat16"},
                        "allow_nonfinite": {"type": "boolean", "default": False,
                                            "description": "write NaN/inf values a NaN or inf scale or a NaN "
                                                           "byte makes (default: refuse them)"}}}


class _Dequant(BlockOp):
    kind = "reduce"
    partial_groups = True
    stands_for: ClassVar[str | None] = "weight"
    schema = _ARGS
    yields = "either"  # a module stored unquantized is its weight's bytes

    def inverse(self, args: Any) -> tuple[str, Any]:
        raise NoInverse(f"{self.verb} cannot be undone: quantizing again is not exact")

    def describe(self, args: Any) -> str:
        return f"{self.verb} over {args['over']} to {args.get('dtype', 'bfloat16')}"

    @staticmethod
    def _out_dtype(args: Any) -> str:
        return USER_DTYPES[args.get("dtype", "bfloat16")]

    #: (parse, the quantization_config object, its path, what parse made of it): the last
    #: config parsed, since every module of a checkpoint asks for the same one
    _parsed: ClassVar[tuple[Any, Any, str, Any] | None] = None

    @staticmethod
    def _config(ctx: Context, parse: Callable[[Found], _Parsed]) -> _Parsed:
        try:
            found = find_quantization_config(ctx.config)
            if found is None:
                raise QuantizationConfigError("the converted source's config has no quantization_config "
                                              "(nor text_config.quantization_config); this rule needs one")
            last = _Dequant._parsed
            if last is not None and last[0] == parse and last[1] is found.value and last[2] == found.path:
                return last[3]  # type: ignore[no-any-return]
            parsed = parse(found)
            _Dequant._parsed = (parse, found.value, found.path, parsed)
            return parsed
        except QuantizationConfigError as err:
            raise ctx.error(str(err)) from None


class DequantFp8Block(_Dequant):
    verb = "dequant_fp8_block"
    fresh_blocks = True  # each block a new array (quant/tables.py, quant/kernels.py): block_tasks
    description = ("FP8 e4m3 weight x float32 weight_scale_inv per quantization_config.weight_block_size "
                   "block -> bfloat16 (or dtype), round to nearest even; unquantized weights copied.")

    def reduce(self, args: Any, ctx: Context, members: list[tuple[str, View]]) -> Value:
        names = _literals(args, ctx, members, ("weight", "weight_scale_inv"))
        weight, scale = names.get("weight"), names.get("weight_scale_inv")
        wkey, skey = ctx.key("weight"), ctx.key("weight_scale_inv")
        if weight is None:
            raise ctx.error(f"orphan scale: {skey!r} has no weight {wkey!r} to scale; drop the scale with a "
                            "skip rule if that is intended", key=skey)
        if weight.dtype != "F8_E4M3":
            if scale is not None:
                raise ctx.error(f"{wkey!r} is {weight.dtype}, not F8_E4M3, yet {skey!r} scales it; the "
                                "checkpoint is inconsistent", key=skey)
            return weight  # not quantized: copied unchanged
        if scale is None:
            raise ctx.error(f"missing scale: {wkey!r} is F8_E4M3 but the source has no {skey!r}", key=wkey)
        config = self._config(ctx, Fp8BlockConfig.parse)
        module = wkey.removesuffix(".weight")
        if not config.converts(module):
            raise ctx.error(f"{wkey!r} is F8_E4M3 but quantization_config.modules_to_not_convert names "
                            f"{module!r}; the config does not describe this tensor", key=wkey)
        if len(weight.shape) != 2 or scale.dtype != "F32":
            raise ctx.error(f"{wkey!r} {list(weight.shape)} with {skey!r} {scale.dtype} {list(scale.shape)}: "
                            "block dequantization needs a 2-D weight and a float32 scale", key=skey)
        rows, cols = weight.shape
        (bh, bw) = config.block
        want = (-(-rows // bh), -(-cols // bw))
        if scale.shape != want:
            raise ctx.error(f"{skey!r} has shape {list(scale.shape)}, but weight_block_size {list(config.block)} "
                            f"of {wkey!r} {[rows, cols]} needs {list(want)}: the quantization_config does not "
                            "match the tensors", key=skey)
        return Block(self, {"block": config.block, "dtype": self._out_dtype(args), **_finite_args(args, ctx, wkey)},
                     (weight, scale), (rows, cols), self._out_dtype(args))

    def blocks(self, block: Block, inputs: Sequence[InputTensor], chunk_bytes: int,
               rows: range | None = None) -> Iterator[bytes | memoryview]:
        first, stop = _aligned(rows, block.shape[0], block.args["block"][0])
        row_bytes = block.shape[1] * DTYPE_SIZES[block.args["dtype"]]
        return _trimmed(in_order(self._tasks(block, inputs, chunk_bytes, first, stop), FP8_WORKERS),
                        rows, first, row_bytes)

    def block_tasks(self, block: Block, inputs: Sequence[InputTensor],
                    chunk_bytes: int) -> Iterator[Callable[[], memoryview]]:
        return self._tasks(block, inputs, chunk_bytes, 0, block.shape[0])

    def _tasks(self, block: Block, inputs: Sequence[InputTensor], chunk_bytes: int, first: int,
               stop: int) -> Iterator[Callable[[], memoryview]]:
        """Rows ``first`` (a block boundary) to ``stop`` as tasks of whole blocks of rows,
        their bytes read as the iterator advances."""
        weight, scale = inputs
        cols = block.shape[1]
        bh, bw = block.args["block"]
        layout = Fp8Block(cols=cols, block_rows=bh, block_cols=bw)
        out_dtype = block.args["dtype"]
        chunk_bytes = min(chunk_bytes, FP8_CHUNK_BYTES)
        step = bh * max(1, chunk_bytes // max(1, bh * cols * DTYPE_SIZES[out_dtype]))
        scale_row = layout.scale_cols * 4
        for start in range(first, stop, step):
            count = min(step, stop - start)
            w = weight.read(start * cols, count * cols)
            s = scale.read(start // bh * scale_row, layout.scale_rows(count) * scale_row)
            yield _checked(block, partial(dequant_fp8_rows, w, s, layout, out_dtype=out_dtype), start,
                           scale=s, scale_dtype="F32", largest_code=448.0, e4m3_codes=w)


class DequantInt4(_Dequant):
    verb = "dequant_int4"
    description = ("compressed-tensors pack-quantized int4 (weight_packed, weight_scale, weight_shape, "
                   "weight_zero_point when asymmetric) -> bfloat16 (or dtype); unquantized weights copied.")

    _MEMBERS = ("weight", "weight_packed", "weight_scale", "weight_shape", "weight_zero_point")

    def reduce(self, args: Any, ctx: Context, members: list[tuple[str, View]]) -> Value:
        names = _literals(args, ctx, members, self._MEMBERS)
        module = ctx.key("weight").removesuffix(".weight")
        parts = set(names) - {"weight"}
        config = self._config(ctx, CompressedConfig.parse)
        if not parts:  # a plain weight: copied, unless the config names this module as quantized
            group = config.group_for(module, stored_quantized=False)
            if group is not None:
                raise ctx.error(f"{ctx.key('weight')!r} is stored unquantized, but {config.path}.config_groups."
                                f"{group.name} targets {module!r}; the config does not describe this tensor",
                                key=ctx.key("weight"))
            return names["weight"]
        if "weight" in names:
            raise ctx.error(f"{ctx.key('weight')!r} and {ctx.key(sorted(parts)[0])!r} are both present: a module "
                            "is either quantized or not", key=ctx.key("weight"))
        group = config.group_for(module, stored_quantized=True)
        if group is None:
            ignored = config.ignored(module)  # only for the message: a scan of the list per module
            why = f"{config.path}.ignore lists {ignored!r}" if ignored else f"no group of {config.path} targets it"
            raise ctx.error(f"{ctx.key(sorted(parts)[0])!r} is quantized but {why}: the config does not "
                            "describe this module", key=ctx.key(sorted(parts)[0]))
        needed = ["weight_packed", "weight_scale", "weight_shape"] + ([] if group.symmetric else ["weight_zero_point"])
        for part in needed:
            if part not in names:
                kind = "missing scale" if part == "weight_scale" else "incomplete module"
                raise ctx.error(f"{kind}: {ctx.key(part)!r} is missing beside {ctx.key(sorted(parts)[0])!r} "
                                f"({config.path}.config_groups.{group.name} needs {', '.join(needed)})",
                                key=ctx.key(part))
        if "weight_zero_point" in names and group.symmetric:
            raise ctx.error(f"{ctx.key('weight_zero_point')!r}: {config.path}.config_groups.{group.name} is "
                            "symmetric, so the module has no zero point", key=ctx.key("weight_zero_point"))
        return self._block(args, ctx, names, group.group_size, config.path)

    def _block(self, args: Any, ctx: Context, names: dict[str, View], group: int, path: str) -> Block:
        packed, scale, shape = names["weight_packed"], names["weight_scale"], names["weight_shape"]
        if (packed.dtype, len(packed.shape), len(scale.shape), shape.shape) != ("I32", 2, 2, (2,)) or \
                shape.dtype not in ("I32", "I64") or scale.dtype not in ("BF16", "F16", "F32"):
            raise ctx.error(f"{ctx.key('weight_packed')!r} {packed.dtype} {list(packed.shape)}, weight_scale "
                            f"{scale.dtype} {list(scale.shape)}, weight_shape {shape.dtype} {list(shape.shape)}: "
                            "pack-quantized int4 needs I32 [rows, cols/8], a float [rows, cols/group] and an "
                            "integer [2]", key=ctx.key("weight_packed"))
        rows, words = packed.shape
        if group == 0:  # per channel: one group the row's width, whole words (weight_shape checks it when run)
            group = words * 8
        cols = scale.shape[1] * group
        if scale.shape[0] != rows or words != -(-cols // 8):
            raise ctx.error(f"{ctx.key('weight_scale')!r} {list(scale.shape)} with group_size {group} ({path}) "
                            f"means {cols} columns, but {ctx.key('weight_packed')!r} {list(packed.shape)} holds "
                            f"{words * 8} columns: the quantization_config does not match the tensors",
                            key=ctx.key("weight_scale"))
        inputs = [packed, scale, shape]
        if "weight_zero_point" in names:
            zp = names["weight_zero_point"]
            if zp.dtype != "I32" or zp.shape != (-(-rows // 8), scale.shape[1]):
                raise ctx.error(f"{ctx.key('weight_zero_point')!r} {zp.dtype} {list(zp.shape)}: expected I32 "
                                f"{[-(-rows // 8), scale.shape[1]]}", key=ctx.key("weight_zero_point"))
            inputs.append(zp)
        out = self._out_dtype(args)
        # weight_shape's two integers are read when the block runs (a plan reads headers only)
        return Block(self, {"group": group, "dtype": out, "shape_key": ctx.key("weight_shape"), "label": ctx.label,
                            **_finite_args(args, ctx, ctx.key("weight_packed"))}, tuple(inputs), (rows, cols), out)

    def blocks(self, block: Block, inputs: Sequence[InputTensor], chunk_bytes: int,
               rows: range | None = None) -> Iterator[bytes | memoryview]:
        packed, scale, shape = inputs[:3]
        zero_point = inputs[3] if len(inputs) > 3 else None
        total, cols = block.shape
        _check_shape(shape, (total, cols), block.args["shape_key"], block.args["label"])
        layout = Int4Groups(cols=cols, group_size=block.args["group"], scale_dtype=scale.view.dtype)
        out_dtype = block.args["dtype"]
        step = 8 * max(1, chunk_bytes // max(1, 8 * cols * DTYPE_SIZES[out_dtype]))
        packed_row, scale_row = layout.words * 4, layout.groups * DTYPE_SIZES[layout.scale_dtype]
        zp_row = layout.groups * 4
        first, stop = _aligned(rows, total, 8)  # the zero point packs 8 rows per word

        def tasks() -> Iterator[Callable[[], memoryview]]:
            for start in range(first, stop, step):
                count = min(step, stop - start)
                zp = None
                if zero_point is not None:
                    zp = zero_point.read(start // 8 * zp_row, layout.zero_point_rows(count) * zp_row)
                s = scale.read(start * scale_row, count * scale_row)
                yield _checked(block, partial(dequant_int4_rows, packed.read(start * packed_row, count * packed_row),
                                              s, layout, zero_point=zp, out_dtype=out_dtype), start,
                               scale=s, scale_dtype=layout.scale_dtype, largest_code=15.0)
        return _trimmed(in_order(tasks()), rows, first, cols * DTYPE_SIZES[out_dtype])


def _aligned(rows: range | None, total: int, align: int) -> tuple[int, int]:
    """The rows to decode for output rows ``rows`` (all when None): from the block
    boundary at or before the first (a kernel starts at one) to the last."""
    if rows is None:
        return 0, total
    return rows.start // align * align, min(rows.stop, total)


def _trimmed(pieces: Iterator[memoryview], rows: range | None, first: int,
             row_bytes: int) -> Iterator[memoryview]:
    """``pieces`` (rows from ``first`` on) without the rows before ``rows.start``."""
    skip = (rows.start - first) * row_bytes if rows is not None else 0
    for piece in pieces:
        if skip:
            cut = min(skip, len(piece))
            piece, skip = piece[cut:], skip - cut
        if len(piece):
            yield piece


def _finite_args(args: Any, ctx: Context, key: str) -> dict[str, Any]:
    """What the block needs to refuse non-finite output values: None when they are allowed."""
    return {"nonfinite": None if args.get("allow_nonfinite", False) else f"{ctx.label}: {key!r} dequantized"}


def _checked(block: Block, compute: Callable[[], memoryview], first_row: int, **inputs: Any) -> Callable[[], memoryview]:
    """``compute``, refusing a non-finite value unless the rule allows them (quant/finite.py)."""
    what = block.args["nonfinite"]
    if what is None:
        return compute
    return checked(compute, dtype=block.args["dtype"], cols=block.shape[1], first_row=first_row, what=what, **inputs)


def _literals(args: Any, ctx: Context, members: list[tuple[str, View]], allowed: tuple[str, ...]) -> dict[str, View]:
    names = dict(members)
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        raise ctx.error(f"{args['over']} takes {', '.join(allowed)}; {ctx.key(unknown[0])!r} is none of them; "
                        f"enumerate them in the key: '{{{args['over']}:{','.join(allowed)}}}'")
    return names


def _check_shape(shape: InputTensor, want: tuple[int, int], key: str, label: str) -> None:
    """``weight_shape`` holds the logical shape (two integers); it must agree with the
    shape the packed words and the scales make."""
    raw = shape.read(0, shape.view.nbytes)
    size = shape.view.itemsize
    got = tuple(int.from_bytes(raw[i * size:(i + 1) * size], "little", signed=True) for i in range(2))
    if got != want:
        raise QuantizationConfigError(f"{label}: {key!r} says {list(got)}, but weight_packed and weight_scale "
                                      f"make {list(want)}: the quantization_config does not match the tensors",
                                      key=key)
