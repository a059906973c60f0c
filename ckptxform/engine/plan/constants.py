"""The outputs of a constant ``add`` entry (rules/constants.py), decided at plan time: the
keys ``for_each`` binds among the tensor rules' outputs, each one's shape, dtype and fill
value evaluated and checked, its one element made here (the executor only repeats it).

Rounding: the value is rounded once to the dtype, through float32 below float64, which is
what ``torch.full(shape, value, dtype=...)`` gives (c10 converts the Python float to the
dtype through float). An integer dtype takes an integer in its range, ``bool`` 0 or 1; a
value a float dtype cannot hold (1e5 in float16) is refused, not made infinite.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from math import prod

from ...dtypes import USER_DTYPES, int_range, is_float, nbytes
from ...errors import PlanError
from ...rules.model import AddEntry
from ...rules.templates import expand_from, natural_key
from .recipes import Constant, OutputPlan
from .references import References

_NAMES = {v: k for k, v in USER_DTYPES.items()}
#: a file offset is a signed 64-bit integer
_MAX_FILE_BYTES = 2**63


def plan_constant(entry: AddEntry, outputs: Mapping[str, OutputPlan], refs: References,
                  out_dtype: Callable[[str], str]) -> list[OutputPlan]:
    """One output per binding of ``entry`` (one, for a literal key). ``outputs``: the tensor
    rules' outputs, which ``for_each`` matches; ``out_dtype``: the dtype the output gets
    (``output.dtype`` casts a float constant as it casts every float tensor)."""
    label = f"add.{entry.key} ({entry.where.short})"
    made = []
    for binding, beside in _bindings(entry, outputs, label):
        key = expand_from(entry.template, entry.for_each, binding) if entry.template and entry.for_each else entry.key
        where = f"{label}" + (f" for {beside.key!r}" if beside is not None else "")
        bound = replace(refs, binding=binding)
        shape = tuple(_dim(bound, dim, f"{where}: shape[{i}]") for i, dim in enumerate(entry.shape))
        dtype = out_dtype(_dtype(entry, bound, beside, where))
        if nbytes(dtype, shape) >= _MAX_FILE_BYTES:
            raise PlanError(f"{where}: shape {list(shape)} of {_NAMES.get(dtype, dtype)} is {nbytes(dtype, shape):,} "
                            "bytes, more than a file can hold; check the shape's expressions")
        value = bound.number(entry.fill, f"{where}: fill")
        element = fill_element(value, dtype, f"{where}: fill")
        made.append(OutputPlan(key, dtype, shape, Constant(element.hex(), prod(shape), value), dtype,
                               entry.where.short, loaded=False))
    return made


def _bindings(entry: AddEntry, outputs: Mapping[str, OutputPlan],
              label: str) -> list[tuple[dict[str, str], OutputPlan | None]]:
    if entry.for_each is None:
        return [({}, None)]
    found = [(binding, out) for key, out in outputs.items() if (binding := entry.for_each.match(key)) is not None]
    if not found:
        raise PlanError(f"{label}: for_each {entry.for_each.text!r} matches no output tensor the tensor rules "
                        "write, so no constant would be written; correct the template (it matches output keys, "
                        "after renames) or remove the entry", key=entry.key)
    names = list(entry.for_each.variables)
    return sorted(found, key=lambda item: [natural_key(item[0][n]) for n in names])


def _dim(refs: References, value: int | str, where: str) -> int:
    size = refs.integer(value, where)
    if size < 0:
        raise PlanError(f"{where}: {value!r} is {size}; a dimension is 0 or more")
    return size


def _dtype(entry: AddEntry, refs: References, beside: OutputPlan | None, where: str) -> str:
    if entry.dtype is None:
        assert beside is not None  # the loader asks for a dtype when there is no for_each
        return beside.dtype
    name = refs.evaluate(entry.dtype, f"{where}: dtype")
    if name not in USER_DTYPES:
        raise PlanError(f"{where}: dtype {entry.dtype!r} is {name!r}, not one of {', '.join(USER_DTYPES)}")
    return USER_DTYPES[name]


def fill_element(value: int | float, dtype: str, where: str) -> bytes:
    """One element of ``dtype`` holding ``value``, as torch.full makes it; PlanError when
    the dtype cannot hold it."""
    import numpy as np

    from ...dtypes import numpy_dtype

    name = _NAMES.get(dtype, dtype)
    if not is_float(dtype):
        low, high = int_range(dtype)
        if not (isinstance(value, int) or float(value).is_integer()) or not low <= value <= high:
            raise PlanError(f"{where}: {value!r} is not {'0 or 1' if dtype == 'BOOL' else 'an integer'} "
                            f"{name} holds ({low:,}..{high:,}); give one it does, or a float dtype")
        return np.array([int(value)], dtype=numpy_dtype(dtype)).tobytes()
    with np.errstate(over="ignore"):
        wide = np.array([float(value)], dtype=np.float64 if dtype == "F64" else np.float32)
        made = wide.astype(numpy_dtype(dtype))
    if not math.isfinite(float(made[0])):
        raise PlanError(f"{where}: {value!r} overflows {name} (it would be {float(made[0])}); give a value "
                        f"{name} holds, or a wider dtype")
    return made.tobytes()

