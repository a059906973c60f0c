"""The bytes a row of a plan's store (plan_store.py) holds for an output or a record.

The items nearly every tensor makes (an output copied from one source tensor, a record
whose reason is a text or a ``TargetReason``) are marshalled as a tuple of their fields;
anything else is pickled, a dataclass with slots as a call of its class (``_Pickler``).
Pickled as they are, those frozen dataclasses went through ``dataclasses.fields`` for
each: ~30 us a copied tensor's output to write and read back (~3 us marshalled).
"""

from __future__ import annotations

import dataclasses
import io
import marshal
import pickle
from typing import Any

from ...ops.base import OpDef
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
    buffer = io.BytesIO()
    _Pickler(buffer, pickle.HIGHEST_PROTOCOL).dump(item)
    return marshal.dumps((_PICKLED, buffer.getvalue()))


#: a frozen dataclass with slots -> its fields' names (None: not one, or one not made by
#: its fields alone), looked up once a class
_FIELDS: dict[type, tuple[str, ...] | None] = {}


def _init_fields(kind: type) -> tuple[str, ...] | None:
    if kind not in _FIELDS:
        fields = dataclasses.fields(kind) if dataclasses.is_dataclass(kind) and "__slots__" in vars(kind) else ()
        _FIELDS[kind] = (tuple(field.name for field in fields)
                         if fields and all(field.init for field in fields) else None)
    return _FIELDS[kind]


#: the ops a row names, by id(): the registry's instances, alive for the process (what
#: reads a plan, the run plan's codec say, knows an op by its identity)
_OPS: dict[int, OpDef] = {}


def _op(number: int) -> OpDef:
    return _OPS[number]


class _Pickler(pickle.Pickler):
    """Pickles a dataclass with slots (``OutputPlan``, a recipe's ``TensorRef``s) as a call
    of its class on its field values: its own ``__getstate__`` and ``__setstate__`` call
    ``dataclasses.fields`` each time, most of the ~60 us an op chain's output took to read
    back (~20 us so). Other dataclasses (no slots) pickle their ``__dict__``, in C."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, OpDef):  # an op is its registered instance, read back as itself
            _OPS.setdefault(id(obj), obj)
            return _op, (id(obj),)
        names = _init_fields(type(obj))
        if names is None:
            return NotImplemented
        return type(obj), tuple(getattr(obj, name) for name in names)


#: one object for equal small values read back (dtypes, shapes, rule positions, sources):
#: an item read is held by its reader, and each its own copy of them was ~200 bytes
_SHARED: dict[Any, Any] = {}
_SHARED_MOST = 1 << 16


#: a rule's reason of its tensors, by its fixed text (one a rule)
_REASONS: dict[str, TargetReason] = {}


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
    if kind == _RECORD:  # a record is read to be written out, seldom held: its fields as read
        return TensorRecord(*row[1:])
    if kind == _TARGETED:
        reason = _REASONS.get(row[8])
        if reason is None:
            reason = _REASONS[row[8]] = TargetReason(row[8])
        return TensorRecord(row[1], row[2], row[3], row[4], row[5], row[6], row[7], reason, row[9])
    return pickle.loads(row[1])
