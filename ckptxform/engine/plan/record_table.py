"""The planner's records, one a source tensor, by source and key, in the order first made.

The converted source's records (nearly all of a run's) are keyed by the key alone, the
other sources' by ``(source, key)``: one dict keeps the order of all of them, and the
~200,000 key tuples of a 200,000-tensor source (56 bytes each, held to the end of
planning, its peak) are not made. A str and a tuple never compare equal, so the two kinds
of keys cannot collide.

A tensor a rule without ops copies whole into one output (a keep, a rename, a cast) is
held as that output's ``OutputPlan``: its record says nothing the output does not
(``copied_record``), and is made when it is read. A ``TensorRecord`` held for each was
~104 bytes a tensor for the whole run (20.8 MB of a 200,000-tensor rename's plan).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

from .recipes import CopyTensor, OutputPlan, TargetReason, TensorRecord
from ...sources.base import TensorInfo

#: the reasons of a rule's tensors, made from their targets when the audit is written
RENAMED_TO = TargetReason("matched, renamed to ")
MATCHED_TO = TargetReason("matched -> ")


def copy_wording(template: bool, key: str, outs: list[str], dtype: str, out_dtype: str) -> tuple[str, str | TargetReason]:
    """The action and reason of source tensor ``key`` (``dtype``) that a rule without ops
    (a ``key`` template rule when ``template``, else a ``match`` rule) writes as ``outs``
    in ``out_dtype``; a cast's own words (``, cast A -> B``) are the caller's to add."""
    action = "renamed" if outs != [key] else "loaded"
    if template:
        return action, MATCHED_TO
    if action != "renamed":  # a match rule's wording, as the audit has always put it
        return ("cast" if dtype != out_dtype else action), "matched"
    return action, RENAMED_TO if len(outs) == 1 else f"matched, renamed to {outs[0]!r}"


def cast_words(dtype: str, out_dtype: str) -> str:
    """What a record's reason adds when its tensor is written in another dtype."""
    return f", cast {dtype} -> {out_dtype}" if dtype != out_dtype else ""


def copied_record(out: OutputPlan, template: bool) -> TensorRecord:
    """The record of the source tensor ``out`` copies (a ``CopyTensor``), written by a rule
    without ops (a ``key`` template rule when ``template``) as ``out`` alone."""
    recipe = out.recipe
    assert type(recipe) is CopyTensor
    action, why = copy_wording(template, recipe.key, [out.key], out.input_dtype, out.dtype)
    more = cast_words(out.input_dtype, out.dtype)
    if more:
        why = (why.text(out.key) if isinstance(why, TargetReason) else why) + more
    return TensorRecord(recipe.source, recipe.key, action, out.key, out.shape, out.input_dtype, out.rule, why)


def _action(item: TensorRecord | OutputPlan, matched_to: frozenset[str]) -> str:
    """``_made(item, matched_to).action``, without making the record."""
    if type(item) is TensorRecord:
        return item.action
    recipe = item.recipe
    assert type(recipe) is CopyTensor and type(item) is OutputPlan
    return copy_wording(item.rule in matched_to, recipe.key, [item.key], item.input_dtype, item.dtype)[0]


def _made(item: TensorRecord | OutputPlan, matched_to: frozenset[str]) -> TensorRecord:
    return item if type(item) is TensorRecord else copied_record(item, item.rule in matched_to)  # type: ignore[union-attr, arg-type]


class RecordTable:
    """``table.get(source, key)``, ``table.put(record)``, ``table.put_copied(...)``,
    iteration in first-made order. ``matched_to``: the positions of the ``key`` template
    rules (their copied tensors' reason is ``matched -> ...``); the planner puts a copied
    tensor only for a rule whose position names no other rule."""

    def __init__(self, convert: str | None, matched_to: frozenset[str] = frozenset()) -> None:
        self._convert = convert
        self._matched_to = matched_to
        self._records: dict[str | tuple[str, str], TensorRecord | OutputPlan] = {}

    def _slot(self, source: str, key: str) -> str | tuple[str, str]:
        return key if source == self._convert else (source, key)

    def get(self, source: str, key: str) -> TensorRecord | None:
        item = self._records.get(self._slot(source, key))
        return None if item is None else _made(item, self._matched_to)

    def has(self, source: str, key: str) -> bool:
        return self._slot(source, key) in self._records

    def put(self, record: TensorRecord) -> None:
        """Add ``record``, or replace the one of its source and key (which keeps its place)."""
        self._records[self._slot(record.source, record.key)] = record

    def put_copied(self, source: str, info: TensorInfo, out: OutputPlan) -> bool:
        """Record ``source``'s tensor ``info`` as copied whole into ``out`` (held as ``out``),
        when it has no record yet and ``out`` is its bytes as they are, at the rule's
        position; False (nothing done) otherwise."""
        recipe = out.recipe
        slot = self._slot(source, info.key)
        if (type(recipe) is not CopyTensor or recipe.key != info.key or recipe.source != source
                or out.shape != info.shape or out.input_dtype != info.dtype or slot in self._records):
            return False
        self._records[slot] = out
        return True

    def stored(self) -> Iterator[TensorRecord]:
        """The records held as records (none of them copied whole by a rule without ops)."""
        return (item for item in self._records.values() if type(item) is TensorRecord)  # type: ignore[misc]

    def take(self) -> Records:
        """The records as they stand, for the plan, leaving the table empty: its dict (~40
        bytes a tensor) is freed before the plan's next tuple is made, not kept beside it
        to the planner's end."""
        records = Records(tuple(self._records.values()), self._matched_to)
        self._records = {}
        return records

    def __iter__(self) -> Iterator[TensorRecord]:
        matched_to = self._matched_to
        return (_made(item, matched_to) for item in self._records.values())

    def __len__(self) -> int:
        return len(self._records)


class Records(Sequence[TensorRecord]):
    """A plan's records, in order: each ``TensorRecord`` made when read (from its output,
    for a tensor copied whole by a rule without ops). Equal to another ``Records`` or a
    tuple of the same records."""

    __slots__ = ("_items", "_matched_to")

    def __init__(self, items: tuple[TensorRecord | OutputPlan, ...], matched_to: frozenset[str] = frozenset()) -> None:
        self._items = items
        self._matched_to = matched_to

    def __len__(self) -> int:
        return len(self._items)

    @overload
    def __getitem__(self, index: int) -> TensorRecord: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[TensorRecord, ...]: ...

    def __getitem__(self, index: int | slice) -> TensorRecord | tuple[TensorRecord, ...]:
        if isinstance(index, slice):
            return tuple(_made(item, self._matched_to) for item in self._items[index])
        return _made(self._items[index], self._matched_to)

    def __iter__(self) -> Iterator[TensorRecord]:
        matched_to = self._matched_to
        return (_made(item, matched_to) for item in self._items)

    def actions(self) -> Iterator[str]:
        """Each record's action, in order (made from its output without the record: counting
        a 200,000-tensor plan's actions, twice an apply, was ~0.3 s each making them)."""
        matched_to = self._matched_to
        return (_action(item, matched_to) for item in self._items)

    def stored(self) -> Iterator[TensorRecord]:
        """The records held as records: every one but those of tensors copied whole (loaded,
        renamed or cast) by a rule without ops."""
        return (item for item in self._items if type(item) is TensorRecord)  # type: ignore[misc]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (Records, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Records({len(self)} records)"

    def __getstate__(self) -> tuple[tuple[TensorRecord | OutputPlan, ...], frozenset[str]]:
        return self._items, self._matched_to

    def __setstate__(self, state: tuple[tuple[TensorRecord | OutputPlan, ...], frozenset[str]]) -> None:
        self._items, self._matched_to = state
