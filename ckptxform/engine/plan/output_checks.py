"""What the planner asks of each output tensor beyond its shape: can its key name a
tensor, can the values it decodes be made exactly, and does a tensor tied to it match it."""

from __future__ import annotations

import re

from ...dtypes import cast_problem, decodable, is_float
from ...errors import quote
from ...sources.base import TensorInfo
from .recipes import OutputPlan

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def key_problem(key: str) -> str | None:
    """Why ``key`` cannot name a tensor in a safetensors file (None when it can)."""
    if not key:
        return "it is empty"
    if key == "__metadata__":
        return "safetensors reserves '__metadata__' for the file's metadata"
    if _CONTROL.search(key):
        return "it contains a control character"
    if len(key) > 1024:
        return f"it is {len(key)} characters long, more than 1024"
    return None


def value_problem(out: OutputPlan) -> str | None:
    """Why the values ``out`` decodes (a cast, a numeric fill) cannot be made exactly or
    at all; None when they can, or when it moves bytes only. Decided here, never mid-apply."""
    if out.dtype != out.input_dtype:
        why = cast_problem(out.input_dtype, out.dtype)
        if why is not None:
            return (f"cast {out.input_dtype} -> {out.dtype} of {quote(out.key)} cannot be exact: {why}; "
                    f"drop the cast and keep {out.input_dtype}")
    account = out.recipe.row_account()
    init = account.init if account is not None else None
    if init is None:
        return None
    if init in ("mean", "normal") and not (is_float(out.input_dtype) and decodable(out.input_dtype)):
        return (f"missing_rows init: {init} makes float values and {quote(out.key)} is {out.input_dtype}; "
                "use init: zeros, or rows_of a tensor that has the rows")
    if init == "zeros" and out.input_dtype == "F8_E8M0":
        return (f"missing_rows init: zeros cannot fill {quote(out.key)}: F8_E8M0 (a power-of-two scale) has no "
                "zero; use rows_of a tensor that has the rows")
    return None


def tie_problem(source: str, info: TensorInfo, target: str, out: OutputPlan | None) -> str | None:
    """Why ``source``'s tensor ``info`` cannot be tied to output ``target`` (``out``, None when
    no rule writes it); None when it can: apply then checks that the bytes agree."""
    if out is None:
        return (f"{source}:{info.key} is to be tied to output {target!r}, which no rule writes; name an output "
                "key of this rule file")
    if (out.shape, out.dtype) != (info.shape, info.dtype):
        return (f"{source}:{info.key} is {info.dtype} {list(info.shape)} but output {target!r} is {out.dtype} "
                f"{list(out.shape)}; tied tensors must be identical")
    return None
