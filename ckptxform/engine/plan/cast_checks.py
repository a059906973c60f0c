"""A cast of a quantized weight without its scale, refused at plan time.

A float8 or integer weight of a source whose config declares quantization
(``quantization_config``, quant/schemes.py) holds ``value / scale``: casting it to a
float writes values off by the scale (up to 448x for e4m3). Such a cast is refused when
the source holds the weight's scale; the message names the dequant op that consumes the
scale (an op chain that dequantizes produces a float, so its outputs are not casts of
quantized bytes and pass).
"""

from __future__ import annotations

from collections.abc import Mapping

from ...dtypes import is_float
from ...errors import PlanError, printable
from ...quant.schemes import dequant_op_for, find_quantization_config, scale_of
from ...rules.model import RuleSet
from ...sources.base import Checkpoint
from .plan_store import made_from
from .recipes import OutputPlan
from .references import MISSING, get_path

#: dtypes a quantized weight is stored in (packed int4 is I32 or U8; float8 as such)
_QUANTIZED_STORAGE = {"F8_E4M3", "F8_E5M2", "I8", "U8", "I32"}


def check_quantized_casts(rules: RuleSet, ckpts: Mapping[str, Checkpoint], outputs: Mapping[str, OutputPlan],
                          producers: Mapping[str, object]) -> None:
    for out in made_from(outputs, _QUANTIZED_STORAGE):
        key = out.key
        if out.dtype == out.input_dtype or not is_float(out.dtype):
            continue
        for ref in out.recipe.inputs:
            ckpt = ckpts[ref.source]
            info = ckpt.tensors.get(ref.key)
            if info is None or info.dtype != out.input_dtype:
                continue
            config = ckpt.config(rules.sources[ref.source].config_file)
            found = None if config is None else find_quantization_config(
                lambda path: None if (v := get_path(config, path)) is MISSING else v)
            scale = None if found is None else scale_of(ref.key, ckpt.tensors)
            if found is None or scale is None:
                continue
            op = dequant_op_for(found, info.dtype, scale)
            fix = (f"dequantize it with {op} (a key: rule over the weight and its scale, ops: [{op}: {{over: T}}]) "
                   "instead of casting" if op else "ckptxform has no dequant op for this scheme: keep "
                   f"{info.dtype} (drop the cast)")
            raise PlanError(f"{producers[key]}: cast {info.dtype} -> {out.dtype} of {printable(ref.key)!r} would "
                            f"drop its scale: the source's {found.path} (quant_method "
                            f"{found.value.get('quant_method')!r}) declares it quantized and {scale!r} scales it; "
                            f"{fix}", source=ref.source, key=ref.key)
