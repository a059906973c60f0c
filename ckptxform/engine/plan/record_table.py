"""The planner's records, one a source tensor, by source and key, in the order first made.

They live in the plan's store (plan_store.py), a row each keyed by (source number, key),
numbered in the order first made; only a batch not yet written is held in RAM.

A tensor a rule without ops copies whole into one output (a keep, a rename, a cast) is
held as that output's ``OutputPlan``: its record says nothing the output does not
(``copied_record``), and is made when it is read.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

from .plan_store import BATCH, PlanStore, StoredRows, key_bytes, resolve
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


#: keys a lookup of ``unrecorded`` asks at once (sqlite takes up to 32,766 parameters)
_LOOKED_UP = 500


class RecordTable:
    """``table.get(source, key)``, ``table.put(record)``, ``table.put_copied(...)``,
    iteration in first-made order, in the plan's store (plan_store.py): written a batch at
    a time, a record put again keeping its place. ``matched_to``: the positions of the
    ``key`` template rules (their copied tensors' reason is ``matched -> ...``); the
    planner puts a copied tensor only for a rule whose position names no other rule."""

    def __init__(self, store: PlanStore, convert: str | None, matched_to: frozenset[str] = frozenset()) -> None:
        self._store = store
        self._matched_to = matched_to
        #: source -> its number in the table (the converted source's, nearly every row, is 0)
        self._source_ids: dict[str | None, int] = {convert: 0}
        store.db.execute("CREATE TABLE records(src INTEGER NOT NULL, key BLOB NOT NULL, action TEXT NOT NULL, "
                         "copied INTEGER NOT NULL, item BLOB NOT NULL, PRIMARY KEY(src, key))")
        #: (source number, key) -> record or copied output: the batch not yet written
        self._pending: dict[tuple[int, str], TensorRecord | OutputPlan] = {}
        self._count = 0

    def _slot(self, source: str, key: str) -> tuple[int, str]:
        number = self._source_ids.get(source)
        if number is None:
            number = self._source_ids[source] = len(self._source_ids)
        return number, key

    def _stored(self, slot: tuple[int, str], column: str) -> object:
        row = self._store.db.first(f"SELECT {column} FROM records WHERE src = ? AND key = ?",
                                   (slot[0], key_bytes(slot[1])))
        return None if row is None else row[0]

    def get(self, source: str, key: str) -> TensorRecord | None:
        slot = self._slot(source, key)
        item = self._pending.get(slot)
        if item is None:
            blob = self._stored(slot, "item")
            if blob is None:
                return None
            item = self._store.load(blob)  # type: ignore[arg-type]
        return _made(item, self._matched_to)

    def has(self, source: str, key: str) -> bool:
        slot = self._slot(source, key)
        return slot in self._pending or self._stored(slot, "1") is not None

    def unrecorded(self, source: str, infos: list[TensorInfo]) -> Iterator[TensorInfo]:
        """Those of ``source``'s tensors ``infos`` without a record, a batch of keys looked up
        at a time (a lookup a tensor was ~3 us)."""
        number = self._slot(source, "")[0]
        db, pending = self._store.db, self._pending
        for start in range(0, len(infos), _LOOKED_UP):
            batch = infos[start:start + _LOOKED_UP]
            marks = ", ".join("?" * len(batch))
            found = {row[0] for row in db.execute(f"SELECT key FROM records WHERE src = ? AND key IN ({marks})",
                                                  (number, *(key_bytes(info.key) for info in batch)))}
            yield from (info for info in batch
                        if key_bytes(info.key) not in found and (number, info.key) not in pending)

    def _put(self, slot: tuple[int, str], item: TensorRecord | OutputPlan) -> None:
        self._pending[slot] = item
        if len(self._pending) >= BATCH:
            self.flush()

    def put(self, record: TensorRecord) -> None:
        """Add ``record``, or replace the one of its source and key (which keeps its place)."""
        self._put(self._slot(record.source, record.key), record)

    def put_copied(self, source: str, info: TensorInfo, out: OutputPlan, new: bool = False) -> bool:
        """Record ``source``'s tensor ``info`` as copied whole into ``out`` (held as ``out``),
        when it has no record yet (``new``: the caller knows, not looked up) and ``out`` is
        its bytes as they are, at the rule's position; False (nothing done) otherwise."""
        recipe = out.recipe
        if (type(recipe) is not CopyTensor or recipe.key != info.key or recipe.source != source
                or out.shape != info.shape or out.input_dtype != info.dtype
                or (not new and self.has(source, info.key))):
            return False
        self._put(self._slot(source, info.key), out)
        return True

    def flush(self) -> None:
        """Write the batch: a new record after every other, one put again in its place."""
        if not self._pending:
            return
        matched_to = self._matched_to
        rows = [(src, key_bytes(key), _action(item, matched_to), type(item) is OutputPlan, self._store.dump(item))
                for (src, key), item in self._pending.items()]
        self._pending = {}
        self._store.db.executemany(
            "INSERT INTO records(src, key, action, copied, item) VALUES (?, ?, ?, ?, ?) ON CONFLICT(src, key) "
            "DO UPDATE SET action = excluded.action, copied = excluded.copied, item = excluded.item", rows)
        # an upsert that updates takes no rowid, and none is deleted: rows are numbered 1..n
        # in first-made order (the last is the count, one lookup; count(*) is a scan)
        self._count = self._store.db.first("SELECT coalesce(max(rowid), 0) FROM records")[0]

    def _rows(self) -> StoredRows:
        self.flush()
        return StoredRows(self._store, "records", self._count)

    def stored(self) -> Iterator[TensorRecord]:
        """The records held as records (none of them copied whole by a rule without ops)."""
        return Records(self._rows(), self._matched_to).stored()

    def take(self) -> Records:
        """The records as they stand, for the plan."""
        return Records(self._rows(), self._matched_to)

    def __iter__(self) -> Iterator[TensorRecord]:
        return iter(Records(self._rows(), self._matched_to))

    def __len__(self) -> int:
        self.flush()
        return self._count


class Records(Sequence[TensorRecord]):
    """A plan's records, in order: each ``TensorRecord`` made when read (from its output,
    for a tensor copied whole by a rule without ops), from the plan's store (a tuple once
    unpickled). Equal to another ``Records`` or a tuple of the same records."""

    __slots__ = ("_items", "_matched_to")

    def __init__(self, items: StoredRows | tuple[TensorRecord | OutputPlan, ...],
                 matched_to: frozenset[str] = frozenset()) -> None:
        self._items = items
        self._matched_to = matched_to

    def __len__(self) -> int:
        items = self._items
        return len(items) if isinstance(items, tuple) else items.count

    def _raw(self) -> Iterator[TensorRecord | OutputPlan]:
        items = self._items
        if isinstance(items, tuple):
            yield from items
            return
        for chunk in items.chunks():
            yield from map(items.store.load, chunk)

    @overload
    def __getitem__(self, index: int) -> TensorRecord: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[TensorRecord, ...]: ...

    def __getitem__(self, index: int | slice) -> TensorRecord | tuple[TensorRecord, ...]:
        items, matched_to = self._items, self._matched_to
        if isinstance(items, tuple):
            if isinstance(index, slice):
                return tuple(_made(item, matched_to) for item in items[index])
            return _made(items[index], matched_to)
        where = resolve(index, items.count)
        if isinstance(where, int):
            return _made(items.store.load(items.at(where)), matched_to)
        blobs = items.span(where.start, where.stop) if where.step == 1 else [items.at(i) for i in where]
        return tuple(_made(items.store.load(blob), matched_to) for blob in blobs)

    def __iter__(self) -> Iterator[TensorRecord]:
        matched_to = self._matched_to
        return (_made(item, matched_to) for item in self._raw())

    def actions(self) -> Iterator[str]:
        """Each record's action, in order (a column of the store: no record made; counting a
        200,000-tensor plan's actions, twice an apply, was ~0.3 s each making them)."""
        items, matched_to = self._items, self._matched_to
        if isinstance(items, tuple):
            return (_action(item, matched_to) for item in items)
        column = StoredRows(items.store, items.table, items.count, column="action")
        return (action for chunk in column.chunks() for action in chunk)

    def stored(self) -> Iterator[TensorRecord]:
        """The records held as records: every one but those of tensors copied whole (loaded,
        renamed or cast) by a rule without ops."""
        items = self._items
        if isinstance(items, tuple):
            return (item for item in items if type(item) is TensorRecord)  # type: ignore[misc]
        held = StoredRows(items.store, items.table, items.count, where="copied = 0")
        return (items.store.load(blob) for chunk in held.chunks() for blob in chunk)

    def close(self) -> None:
        if isinstance(self._items, StoredRows):
            self._items.store.close()

    def __eq__(self, other: object) -> bool | Any:
        if isinstance(other, (Records, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Records({len(self)} records)"

    def __reduce__(self) -> tuple[Any, ...]:
        # a pickled plan is a value held whole: its records go with it
        return Records, (tuple(self._raw()), self._matched_to)
