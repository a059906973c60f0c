"""The bytes a row of a plan's store (plan_store.py) holds for an output or a record.

The items nearly every tensor makes (an output copied from one source tensor, a record
whose reason is a text or a ``TargetReason``) are marshalled as a tuple of their fields
(~3 us to write and read back; pickling those frozen dataclasses was ~30 us). Anything
else (an op chain's output) stays an object the store holds, its row naming its place.
"""

from __future__ import annotations

import marshal
from typing import Any

from .recipes import CopyTensor, OutputPlan, TargetReason, TensorRecord

_HELD, _COPY, _RECORD, _TARGETED = range(4)


def encode(item: Any, held: list[Any]) -> bytes:
    """``item``'s row: its fields marshalled (a copied tensor's output, a record), or, for
    anything else (an op chain's output, with its program), its place in ``held``, the
    object itself kept by the store: read back from a row such an output was ~3.8 KB and
    ~14 us a read (60 objects), and a Kimi-shaped INT4's 70,000 dequant outputs are read
    ~10 times a run (1.8x main's CPU, +100 MB at its peak); they are few, held they share
    their parts, and a plan held all of them before."""
    try:
        blob = _marshalled(item)
    except ValueError:  # a field of a type marshal does not take (a str subclass, say)
        blob = None
    if blob is None:
        held.append(item)
        return marshal.dumps((_HELD, len(held) - 1))
    return blob


def _marshalled(item: Any) -> bytes | None:
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
    return None


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


def decode(blob: bytes, held: list[Any]) -> Any:
    row = marshal.loads(blob)
    kind = row[0]
    if kind == _HELD:
        return held[row[1]]
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
    raise ValueError(f"a plan's row of unknown kind {kind!r}")
