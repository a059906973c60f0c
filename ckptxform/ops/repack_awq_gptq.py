"""repack_awq and repack_gptq: an AutoAWQ (GEMM) or GPTQ module -> compressed-tensors
``pack-quantized`` int4, by moving nibbles: no value is decoded or rounded.

Both split ``X.qweight`` into ``weight_packed`` (int32 ``[out, in/8]``), ``weight_scale``
(``[out, groups]``, the scales' dtype and bytes), ``weight_shape`` (int64 ``[out, in]``) and,
asymmetric, ``weight_zero_point`` (int32 ``[out/8, groups]``), reading the module's
``qzeros``, ``scales`` (and ``g_idx``) beside it (the rule marks those ``consumed``). Why the
nibbles carry over unchanged: compressed-tensors stores a code ``q`` in -8..7 as ``q + 8`` and
dequantizes ``(q - zp) * s``.

- AWQ codes and zero points are 0..15 with ``w = (q - z) * s``: compressed-tensors' ``q - 8``
  and ``z - 8``, whose stored nibbles are AWQ's own; only AWQ's nibble order and its
  ``[in, out]`` layout change (what compressed-tensors' ``AutoAWQConverter`` writes).
- GPTQ v1 stores ``z - 1``: compressed-tensors' zero point nibble is the stored one plus one,
  so a stored 15 (the zero point 16) has no int4 form and is refused; symmetric checkpoints
  (every stored zero 7: the zero point 8) become symmetric ``pack-quantized`` with no zero
  point, and any other stored zero is refused. ``qweight`` is already packed down the rows:
  ``weight_packed`` is its transpose. ``g_idx`` must be ``row // group_size``: a desc_act
  checkpoint whose rows are in activation order has no group layout without reordering,
  and is refused with the fix (dequantize with ``dequant_gptq``).

The run-time checks (zero points, ``g_idx``) are made by the ``weight_shape`` part, which
reads ``qzeros`` and ``g_idx`` whole (1/64 of the weight's bytes at most).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

from ..errors import CheckpointFormatError
from ..quant.awq_gptq_config import AwqConfig, GptqConfig
from .base import Block, BlockOp, Context, InputTensor, NoInverse, Value, View
from .dequant import _Dequant
from .transpose import TRANSPOSE

_PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
_SCALES = ("F16", "BF16", "F32")


class _Repack(BlockOp):
    kind = "split"
    schema = {"type": "object", "additionalProperties": False, "required": ["into"],
              "properties": {"into": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
                             "ignore": {"type": "array", "items": {"type": "string", "minLength": 1}, "default": [],
                                        "description": "the ignore list the rule writes into quantization_config "
                                                       "(checked against the source's modules_to_not_convert)"}}}
    _others: tuple[str, ...]

    def split(self, args: Any, ctx: Context, value: View, names: tuple[str, ...] | None) -> list[tuple[str, Value]]:
        key = ctx.source_key()
        if not key.endswith(".qweight"):
            raise ctx.error(f"{self.verb} splits a module's X.qweight; {key!r} is not one (key: '{{X*}}.qweight')",
                            key=key)
        if names is not None and not set(_PARTS) <= set(names):
            raise ctx.error(f"{self.verb}: 'to' must enumerate {args['into']} with the parts it writes: "
                            f"{{{args['into']}:{','.join(_PARTS)}}}")
        found = ctx.tensor_of(value)
        assert found is not None
        module = key.removesuffix(".qweight")
        parts = {"qweight": value}
        for part in self._others:
            other = f"{module}.{part}"
            if part == "g_idx" and not ctx.has_tensor(found[0], other):
                continue
            if not ctx.has_tensor(found[0], other):
                raise ctx.error(f"incomplete module: {other!r} is missing beside {key!r} ({self.verb} needs "
                                f"{', '.join(('qweight',) + self._others)})", key=other)
            parts[part], _ = ctx.other_tensor(found[0], other, "the module's " + part)
            ctx.lend(found[0], other, "into", f"repacked into {module}.weight_* ({ctx.label})")
        for part, view in parts.items():
            want = _SCALES if part == "scales" else ("I32",)
            if view.dtype not in want:
                raise ctx.error(f"{module}.{part!s} is {view.dtype}; {self.verb} needs {' or '.join(want)}",
                                key=f"{module}.{part}")
        return self._parts(args, ctx, module, parts)

    def _parts(self, args: Any, ctx: Context, module: str, parts: dict[str, View]) -> list[tuple[str, Value]]:
        raise NotImplementedError

    @staticmethod
    def _mismatch(ctx: Context, module: str, parts: dict[str, View], why: str) -> Exception:
        shapes = ", ".join(f"{p} {list(v.shape)}" for p, v in parts.items())
        return ctx.error(f"{module + '.qweight'!r}: {shapes}: {why}; the quantization_config does not match the "
                         "tensors", key=module + ".qweight")

    def _transposed(self, ctx: Context, view: View | Block) -> Value:
        return TRANSPOSE.map([0, 1], ctx, view if isinstance(view, View) else ctx.block_input(view))

    def inverse(self, args: Any) -> tuple[str, Any]:
        raise NoInverse(f"{self.verb} has no inverse op (its source format is not written by ckptxform)")

    def describe(self, args: Any) -> str:
        return f"{self.verb} into {args['into']}"

    def blocks(self, block: Block, inputs: Sequence[InputTensor], chunk_bytes: int,
               rows: range | None = None) -> Iterator[bytes | memoryview]:
        a = block.args
        if a["part"] == "weight_shape":
            import numpy as np

            self._check_whole(a, inputs)
            shape = np.array([a["out"], a["in"]], dtype="<i8")
            return iter([(shape if rows is None else shape[rows.start:rows.stop]).tobytes()])
        (source,) = inputs
        total = block.shape[0]
        first, stop = (0, total) if rows is None else (rows.start, min(rows.stop, total))
        in_row = source.view.row_nbytes * a.get("rows_per", 1)
        step = max(1, chunk_bytes // max(1, in_row))
        return (self._piece(a, source.read(r * in_row, min(step, stop - r) * in_row)) for r in range(first, stop, step))

    def _piece(self, a: dict[str, Any], raw: bytes) -> memoryview:
        raise NotImplementedError

    def _check_whole(self, a: dict[str, Any], inputs: Sequence[InputTensor]) -> None:
        """Run-time checks of the whole module (made once, by the weight_shape part)."""


def _ignore_check(args: Any, ctx: Context, config: AwqConfig) -> None:
    """Each of the source's modules_to_not_convert must be in the ignore list the rule writes
    (compressed-tensors' converter writes ``re:.*NAME.*`` for each)."""
    ignore = args.get("ignore", [])
    for name in config.not_converted:
        entry = f"re:.*{re.escape(name)}.*"
        if entry not in ignore:
            raise ctx.error(f"{config.path}.modules_to_not_convert names {name!r}, which the output's "
                            f"quantization_config must ignore: add {entry!r} to the op's ignore and to "
                            "quantization_config.ignore in the rule's config")


class RepackAwq(_Repack):
    verb = "repack_awq"
    description = ("AutoAWQ GEMM int4 X.qweight (with X.qzeros, X.scales) -> compressed-tensors pack-quantized "
                   "weight_packed, weight_scale, weight_zero_point, weight_shape: nibbles moved, no float round "
                   "trip (compressed-tensors' AutoAWQConverter's bytes).")
    _others = ("qzeros", "scales")

    def _parts(self, args: Any, ctx: Context, module: str, parts: dict[str, View]) -> list[tuple[str, Value]]:
        config = _Dequant._config(ctx, AwqConfig.parse)
        _ignore_check(args, ctx, config)
        if not config.converted(module):
            raise ctx.error(f"{module + '.qweight'!r} is quantized, but {config.path}.modules_to_not_convert names "
                            f"{module!r}; the config does not describe this module", key=module + ".qweight")
        qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
        why = config.problem(qweight.shape, qzeros.shape, scales.shape)
        if why is None and qweight.shape[0] % 8:
            why = "in must be a multiple of 8 (compressed-tensors packs 8 input columns a word)"
        if why is not None:
            raise self._mismatch(ctx, module, parts, why)
        rows_in, cols = qweight.shape[0], scales.shape[1]
        codes = Block(self, {"part": "codes", "cols": cols, "rows_per": 8}, (qweight,), (rows_in // 8, cols), "I32")
        zeros = Block(self, {"part": "zeros", "cols": cols}, (qzeros,), qzeros.shape, "I32")
        shape = Block(self, {"part": "weight_shape", "out": cols, "in": rows_in}, (qweight,), (2,), "I64")
        return [("weight_packed", self._transposed(ctx, codes)), ("weight_scale", self._transposed(ctx, scales)),
                ("weight_shape", shape), ("weight_zero_point", self._transposed(ctx, zeros))]

    def _piece(self, a: dict[str, Any], raw: bytes) -> memoryview:
        from ..quant.awq_gptq import awq_rows_packed_down, awq_zeros_natural  # numpy: only when run

        if a["part"] == "codes":
            return awq_rows_packed_down(raw, a["cols"])
        return awq_zeros_natural(raw, a["cols"])


class RepackGptq(_Repack):
    verb = "repack_gptq"
    description = ("GPTQ v1 int4 X.qweight (with X.qzeros, X.scales, X.g_idx) -> compressed-tensors pack-quantized "
                   "weight_packed, weight_scale, weight_shape (and weight_zero_point when asymmetric): nibbles "
                   "moved, the v1 zero-point offset applied; a desc_act g_idx out of group order is refused.")
    _others = ("qzeros", "scales", "g_idx")

    def _parts(self, args: Any, ctx: Context, module: str, parts: dict[str, View]) -> list[tuple[str, Value]]:
        config = _Dequant._config(ctx, GptqConfig.parse)
        if config.group_size == 0:
            raise ctx.error(f"{config.path}.group_size is -1 (one group a row); this rule writes strategy 'group': "
                            "dequantize with gptq_to_bf16 instead", key=module + ".qweight")
        qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
        g_idx = parts.get("g_idx")
        why = config.problem(qweight.shape, qzeros.shape, scales.shape, None if g_idx is None else g_idx.shape)
        rows_in, cols = qweight.shape[0] * 8, qweight.shape[1]
        if why is None and rows_in % config.group_size:
            why = (f"in={rows_in} is not whole groups of {config.group_size} (compressed-tensors' groups are whole); "
                   "dequantize with gptq_to_bf16 instead")
        if why is not None:
            raise self._mismatch(ctx, module, parts, why)
        shape_args = {"part": "weight_shape", "out": cols, "in": rows_in, "group": config.group_size,
                      "sym": config.sym, "module": module, "label": ctx.label, "g_idx": g_idx is not None}
        checked = (qzeros,) + (() if g_idx is None else (g_idx,))
        out: list[tuple[str, Value]] = [
            ("weight_packed", self._transposed(ctx, qweight)),  # already packed down the rows: bytes moved
            ("weight_scale", self._transposed(ctx, scales)),
            ("weight_shape", Block(self, shape_args, checked, (2,), "I64"))]
        if not config.sym:
            zeros = Block(self, {"part": "zeros", "cols": cols, "module": module, "label": ctx.label}, (qzeros,),
                          qzeros.shape, "I32")
            out.append(("weight_zero_point", self._transposed(ctx, zeros)))
        return out

    def _piece(self, a: dict[str, Any], raw: bytes) -> memoryview:
        from ..quant.awq_gptq import gptq_zeros_offset  # numpy: only when run

        packed, overflow = gptq_zeros_offset(raw, a["cols"])
        if overflow:
            raise _zero_16(a)
        return packed

    def _check_whole(self, a: dict[str, Any], inputs: Sequence[InputTensor]) -> None:
        import numpy as np

        from ..quant.awq_gptq import nibbles

        qzeros = inputs[0]
        codes = nibbles(np.frombuffer(qzeros.read(0, qzeros.view.nbytes), dtype="<u4"))
        if a["sym"] and bool((codes != 7).any()):
            raise CheckpointFormatError(
                f"{a['label']}: {a['module'] + '.qzeros'!r} holds a zero point other than 8 (stored 7), but the "
                "quantization_config says sym: true; the checkpoint is inconsistent: fix sym, or dequantize with "
                "gptq_to_bf16", key=a["module"] + ".qzeros")
        if bool((codes == 15).any()):
            raise _zero_16(a)
        if a["g_idx"]:
            g_idx = inputs[1]
            groups = np.frombuffer(g_idx.read(0, g_idx.view.nbytes), dtype="<i4")
            bad = np.flatnonzero(groups != np.arange(a["in"]) // a["group"])
            if bad.size:
                row = int(bad[0])
                raise CheckpointFormatError(
                    f"{a['label']}: {a['module'] + '.g_idx'!r}[{row}] is {int(groups[row])}, not {row // a['group']}: "
                    "the rows are not in group order (desc_act), and pack-quantized groups are runs of "
                    f"{a['group']} columns; repacking would need the rows reordered: dequantize with gptq_to_bf16 "
                    "instead (then bf16_to_w4a16_asym to re-quantize)", key=a["module"] + ".g_idx")


def _zero_16(a: dict[str, Any]) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{a['label']}: {a['module'] + '.qzeros'!r} stores 15, the zero point 16 (GPTQ v1's offset of one), which "
        "compressed-tensors' int4 zero point (-8..7) cannot hold: dequantize with gptq_to_bf16 instead",
        key=a["module"] + ".qzeros")
