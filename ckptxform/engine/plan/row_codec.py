"""The bytes a row of a plan's store (plan_store.py) holds for an output or a record.

The items nearly every tensor makes (an output copied from one source tensor, a record
whose reason is a text or a ``TargetReason``) are marshalled as a tuple of their fields;
anything else is pickled. Pickling those frozen dataclasses went through
``dataclasses.fields`` for each: ~30 us an item to write and read back, against ~3 us
marshalled (a 20,000-tensor plan writes and reads ~100,000 items).
"""

from __future__ import annotations

import marshal
import pickle
from typing import Any

from .recipes import CopyTensor, OutputPlan, TargetReason, TensorRecord

_PICKLED, _COPY, _RECORD, _TARGETED = range(4)


def encode(item: Any) -> bytes:
    try:
        return _marshalled(item)
    except ValueError:  # a field of a type marshal does not take (a str subclass, say)
        return _pickled(item)


def _marshalled(item: Any) -> bytes:
    kind = type(item)
    if kind is OutputPlan and type(item.recipe) is CopyTensor:
        recipe = item.recipe
        return marshal.dumps((_COPY, item.key, item.dtype, item.shape, recipe.source, recipe.key,
                              item.input_dtype, item.rule, item.loaded))
    if kind is TensorRecord:
        why = item.why
        if type(why) is str or type(why) is TargetReason:
            return marshal.dumps((_RECORD if type(why) is str else _TARGETED, item.source, item.key, item.action,
                                  item.target, item.shape, item.dtype, item.rule,
                                  why if type(why) is str else why.prefix, item.unread_file))
    return _pickled(item)


def _pickled(item: Any) -> bytes:
    return marshal.dumps((_PICKLED, pickle.dumps(item, pickle.HIGHEST_PROTOCOL)))


#: one object for equal small values read back (dtypes, shapes, rule positions, sources):
#: an item read is held by its reader, and each its own copy of them was ~200 bytes
_SHARED: dict[Any, Any] = {}
_SHARED_MOST = 1 << 16


def _shared(value: Any) -> Any:
    found = _SHARED.get(value)
    if found is None:
        if len(_SHARED) >= _SHARED_MOST:  # values a tensor (reasons, say) fill it: start over
            _SHARED.clear()
        found = _SHARED[value] = value
    return found


def decode(blob: bytes) -> Any:
    row = marshal.loads(blob)
    kind = row[0]
    if kind == _COPY:
        return OutputPlan(row[1], _shared(row[2]), _shared(row[3]), CopyTensor(_shared(row[4]), row[5]),
                          _shared(row[6]), _shared(row[7]), row[8])
    if kind == _RECORD or kind == _TARGETED:
        why = _shared(row[8])
        return TensorRecord(_shared(row[1]), row[2], _shared(row[3]), row[4], _shared(row[5]), _shared(row[6]),
                            _shared(row[7]), why if kind == _RECORD else _shared(TargetReason(why)), row[9])
    return pickle.loads(row[1])
