"""A plan's per-tensor tables on disk: one sqlite database per plan, in a temp file
unlinked as soon as it is open (it can never be left behind), holding its outputs (key ->
``OutputPlan``) and its records (source tensor -> ``TensorRecord``, or the output it is
copied whole into, record_table.py).

Held in RAM they were most of a run's peak: ~400 bytes a tensor for a 200,000-tensor
rename's plan, key strings included. In the database (journal off, no sync, an 8 MB page
cache) a million pickled rows filled at ~9 us a row and a scan took ~5 us a row (a row is
now a marshalled tuple, or names an object the store holds: row_codec.py), and the
process stays at ~39 MB whatever the count. Writes are batched (executemany), reads
fetched in chunks: a round trip a tensor is ~2-3 us.

Keys are stored as their UTF-8 bytes (lone surrogates kept): bytes compare as code points
do, so ``ORDER BY key`` is ``sorted()``'s order.
"""

from __future__ import annotations

import marshal
import os
import sqlite3
import tempfile
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NoReturn, overload

from .recipes import OutputPlan
from .row_codec import decode, encode
from ...errors import TempSpaceError

#: rows a write batches, and a read fetches at a time
BATCH = 4096


def key_bytes(key: str) -> bytes:
    return key.encode("utf-8", "surrogatepass")


class Database:
    """The store's sqlite connection, whose every failure is one ``TempSpaceError`` naming
    the temp directory and the fix. A full directory fails a write with "database or disk
    is full" or, the file left torn with no journal to roll back, a later read with "file
    is not a database": sqlite's words alone do not say which directory or what to do.
    ``execute`` returns the rows, fetched inside the guard (a read fails while stepping)."""

    def __init__(self, connection: sqlite3.Connection, directory: str) -> None:
        self._connection, self.directory = connection, directory

    def execute(self, sql: str, args: Sequence[Any] = ()) -> list[Any]:
        try:
            return self._connection.execute(sql, args).fetchall()
        except sqlite3.Error as err:
            raise self._failed(err) from None

    def first(self, sql: str, args: Sequence[Any] = ()) -> Any:
        """The first row ``sql`` selects, or None."""
        rows = self.execute(sql, args)
        return rows[0] if rows else None

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> int:
        """Run ``sql`` once a row; how many rows it changed."""
        try:
            return self._connection.executemany(sql, rows).rowcount
        except sqlite3.Error as err:
            raise self._failed(err) from None

    def close(self) -> None:
        self._connection.close()

    def _failed(self, err: sqlite3.Error) -> TempSpaceError:
        try:  # the database still holds its space: a directory that filled up shows ~0 free
            stat = os.statvfs(self.directory)
            full = stat.f_bavail * stat.f_frsize < _FULL
        except OSError:
            full = False
        where = (f"the temp directory {self.directory!r} is full" if full
                 else f"the plan's working database in the temp directory {self.directory!r} failed")
        return TempSpaceError(f"{where} (sqlite: {err}); a plan keeps ~630 bytes a tensor there: free space in "
                              "it, or set TMPDIR to a directory with room", path=self.directory)


#: free bytes under which a failing temp directory is called full
_FULL = 1 << 20


class PlanStore:
    """The database of one plan; ``close()`` (or its last reference dropped) frees it."""

    def __init__(self) -> None:
        directory = tempfile.gettempdir()
        try:
            fd, path = tempfile.mkstemp(prefix="ckptxform-plan-", suffix=".sqlite", dir=directory)
        except OSError as err:
            raise TempSpaceError(f"cannot create the plan's working database in the temp directory "
                                 f"{directory!r}: {err.strerror or err}; set TMPDIR to a writable directory "
                                 "with room", path=directory) from None
        os.close(fd)
        try:
            # not checked for its thread: a progress or writer thread may read the plan;
            # sqlite serializes calls on one connection
            connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        finally:
            os.unlink(path)
        self.db = Database(connection, directory)
        self._close = weakref.finalize(self, self.db.close)
        for pragma in ("journal_mode=OFF", "synchronous=OFF", "locking_mode=EXCLUSIVE", "cache_size=-8192"):
            self.db.execute(f"PRAGMA {pragma}")
        self.db.execute("BEGIN")  # one transaction, never committed: the file is gone at close anyway
        #: the items rows name rather than hold (row_codec.py: an op chain's outputs)
        self.held: list[Any] = []

    def dump(self, item: Any) -> bytes:
        """``item`` as its row holds it (row_codec.py)."""
        return encode(item, self.held)

    def load(self, blob: bytes) -> Any:
        """The item of a row."""
        return decode(blob, self.held)

    def close(self) -> None:
        self._close()

    @property
    def closed(self) -> bool:
        return not self._close.alive


class StoredRows:
    """Rows 1..n of one of the store's tables, by rowid: ``column`` of row ``i + 1`` is item
    ``i``. O(log n) a lookup; iteration fetches ``BATCH`` rows at a time."""

    def __init__(self, store: PlanStore, table: str, count: int, column: str = "item", where: str = "") -> None:
        self.store, self.table, self.count, self.column = store, table, count, column
        self._where = f" AND {where}" if where else ""

    def _db(self) -> Database:
        """The store's database, while the plan is open."""
        if self.store.closed:
            raise ValueError("the plan is closed: its outputs and records are released")
        return self.store.db

    def _rows(self, sql: str, args: tuple[Any, ...]) -> list[Any]:
        return [row[0] for row in self._db().execute(sql, args)]

    def at(self, index: int) -> Any:
        return self._rows(f"SELECT {self.column} FROM {self.table} WHERE rowid = ?", (index + 1,))[0]

    def span(self, start: int, stop: int) -> list[Any]:
        """Items ``start`` to ``stop - 1``."""
        return self._rows(f"SELECT {self.column} FROM {self.table} WHERE rowid > ? AND rowid <= ? ORDER BY rowid",
                          (start, stop))

    def picked(self, indices: Sequence[int]) -> list[Any]:
        """Items ``indices``, in that order: a query for ``BATCH`` of them at a time (a query
        an item was ~25 us of a 70,000-output shard's specs; its rows come in rowid order)."""
        db = self._db()
        out: list[Any] = []
        for start in range(0, len(indices), BATCH):
            part = indices[start:start + BATCH]
            marks = ",".join("?" * len(part))
            found = dict(db.execute(
                f"SELECT rowid, {self.column} FROM {self.table} WHERE rowid IN ({marks})", [i + 1 for i in part]))
            out.extend(found[i + 1] for i in part)
        return out

    def chunks(self) -> Iterator[list[Any]]:
        last = 0
        sql = f"SELECT rowid, {self.column} FROM {self.table} WHERE rowid > ?{self._where} ORDER BY rowid LIMIT ?"
        while True:
            rows = self._db().execute(sql, (last, BATCH))
            if not rows:
                return
            last = rows[-1][0]
            yield [row[1] for row in rows]

    def lookup(self, sql: str, args: tuple[Any, ...]) -> Any:
        """The first column of the first row ``sql`` selects, or None."""
        rows = self._rows(sql, args)
        return rows[0] if rows else None


def resolve(index: int | slice, count: int) -> range | int:
    """``index`` of a sequence of ``count`` items: a range for a slice, else the int
    (IndexError when out of range)."""
    if isinstance(index, slice):
        return range(count)[index]
    if index < 0:
        index += count
    if not 0 <= index < count:
        raise IndexError("index out of range")
    return index


def same_items(a: Sequence[Any], b: object) -> bool | Any:
    if not isinstance(b, (Sequence)) or isinstance(b, (str, bytes)):
        return NotImplemented
    return len(a) == len(b) and all(x == y for x, y in zip(a, b))


class PlanOutputs(Sequence[OutputPlan]):
    """A plan's outputs in key order, each made when read (from the store while the plan is
    open; from a tuple once unpickled). ``output(key)`` looks one up."""

    def __init__(self, rows: StoredRows | tuple[OutputPlan, ...], total_bytes: int) -> None:
        self._rows = rows
        self.total_bytes = total_bytes

    def __len__(self) -> int:
        return len(self._rows) if isinstance(self._rows, tuple) else self._rows.count

    @overload
    def __getitem__(self, index: int) -> OutputPlan: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[OutputPlan, ...]: ...

    def __getitem__(self, index: int | slice) -> OutputPlan | tuple[OutputPlan, ...]:
        rows = self._rows
        if isinstance(rows, tuple):
            return rows[index]
        where = resolve(index, rows.count)
        if isinstance(where, int):
            return rows.store.load(rows.at(where))
        if where.step == 1:
            return tuple(map(rows.store.load, rows.span(where.start, where.stop)))
        return tuple(rows.store.load(rows.at(i)) for i in where)

    def picked(self, ranks: Sequence[int]) -> tuple[OutputPlan, ...]:
        """The outputs of ``ranks``, in that order (a shard's, when the layout follows a
        source's files): fetched in batches, not a query each."""
        rows = self._rows
        if isinstance(rows, tuple):
            return tuple(rows[r] for r in ranks)
        return tuple(map(rows.store.load, rows.picked(ranks)))

    def __iter__(self) -> Iterator[OutputPlan]:
        if isinstance(self._rows, tuple):
            yield from self._rows
            return
        for chunk in self._rows.chunks():
            yield from map(self._rows.store.load, chunk)

    def output(self, key: str) -> OutputPlan | None:
        rows = self._rows
        if isinstance(rows, tuple):
            import bisect
            i = bisect.bisect_left(rows, key, key=lambda o: o.key)
            return rows[i] if i < len(rows) and rows[i].key == key else None
        item = rows.lookup(f"SELECT item FROM {rows.table} WHERE key = ?", (key_bytes(key),))
        return None if item is None else rows.store.load(item)

    def __contains__(self, value: object) -> bool:
        return isinstance(value, OutputPlan) and self.output(value.key) == value

    def close(self) -> None:
        if isinstance(self._rows, StoredRows):
            self._rows.store.close()

    def __eq__(self, other: object) -> bool | Any:
        return same_items(self, other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PlanOutputs({len(self)} outputs)"

    def __reduce__(self) -> tuple[Any, ...]:
        # a pickled plan is a value held whole: its outputs go with it
        return PlanOutputs, (tuple(self), self.total_bytes)


class OutputTable(Mapping[str, OutputPlan]):
    """The planner's outputs as they grow: ``add`` batches them into the store; a key
    already there is ``on_duplicate(key, producer)``'s to say (it raises), when its batch is
    written or, for a key twice in one batch, at once (``producer`` is what the caller
    holds to name what writes it, None when the output says it). Iterates in key order;
    ``finish()`` makes the plan's ``PlanOutputs``."""

    def __init__(self, store: PlanStore, on_duplicate: Callable[[OutputPlan, object | None], NoReturn]) -> None:
        self.store = store
        self.on_duplicate = on_duplicate
        # the item last: a read of the columns before it does not walk over its bytes (a config
        # check's pass over keys and shapes took ~18 us a row with it first, on op chains' outputs)
        store.db.execute("CREATE TABLE outputs(key BLOB PRIMARY KEY, nbytes INTEGER NOT NULL, input_dtype TEXT NOT NULL, "
                         "shape BLOB NOT NULL, item BLOB NOT NULL)")
        #: key -> (output, what writes it when it does not say it): the batch not yet written
        self._pending: dict[str, tuple[OutputPlan, object | None]] = {}
        self._count = 0

    def add(self, out: OutputPlan, producer: object | None) -> None:
        if out.key in self._pending:
            self.on_duplicate(out, producer)
        self._pending[out.key] = (out, producer)
        if len(self._pending) >= BATCH:
            self.flush()

    def flush(self) -> None:
        """Write the batch; a key already written says so (``on_duplicate``)."""
        pending = self._pending
        if not pending:
            return
        before = self._count
        rows = [(key_bytes(key), self.store.dump(out), out.nbytes, out.input_dtype, marshal.dumps(tuple(map(int, out.shape))))
                for key, (out, _) in pending.items()]
        added = self.store.db.executemany(
            "INSERT OR IGNORE INTO outputs(key, item, nbytes, input_dtype, shape) VALUES (?, ?, ?, ?, ?)", rows)
        self._count += added
        if added != len(rows):
            for key, (out, producer) in pending.items():  # the first of the batch already written before it
                rowid = self._value("SELECT rowid FROM outputs WHERE key = ?", key)
                if rowid is not None and rowid <= before:
                    self._pending = {}
                    self.on_duplicate(out, producer)
        self._pending = {}

    def _value(self, sql: str, key: str) -> Any:
        row = self.store.db.first(sql, (key_bytes(key),))
        return None if row is None else row[0]

    def __getitem__(self, key: str) -> OutputPlan:
        out = self.get(key)
        if out is None:
            raise KeyError(key)
        return out

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        held = self._pending.get(key)
        if held is not None:
            return held[0]
        item = self._value("SELECT item FROM outputs WHERE key = ?", key)
        return default if item is None else self.store.load(item)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and (key in self._pending or
                                         self._value("SELECT 1 FROM outputs WHERE key = ?", key) is not None)

    def __len__(self) -> int:
        return self._count + len(self._pending)

    def _scan(self, columns: str, order: str = "key", bound: int | None = None,
              cond: str = "") -> Iterator[tuple[Any, ...]]:
        self.flush()
        last: Any = b"" if order == "key" else 0
        if bound is not None:
            cond += f" AND rowid <= {int(bound)}"
        sql = f"SELECT {order}, {columns} FROM outputs WHERE {order} > ?{cond} ORDER BY {order} LIMIT {BATCH}"
        if order == "key":
            # the empty key sorts first, and '> ?' would leave it out
            rows = self.store.db.execute(f"SELECT key, {columns} FROM outputs WHERE key = ?{cond}", (b"",))
            yield from (row[1:] for row in rows)
        while True:
            rows = self.store.db.execute(sql, (last,))
            if not rows:
                return
            last = rows[-1][0]
            yield from (row[1:] for row in rows)

    def __iter__(self) -> Iterator[str]:
        """The keys, in key order."""
        return (key.decode("utf-8", "surrogatepass") for key, in self._scan("key"))

    def items(self) -> Iterator[tuple[str, OutputPlan]]:  # type: ignore[override]
        """(key, output), in key order, read a batch at a time."""
        return ((out.key, out) for out in self.values())

    def made_from(self, input_dtypes: Iterable[str]) -> Iterator[OutputPlan]:
        """The outputs whose recipe makes one of ``input_dtypes``, in key order (the others
        are not read)."""
        names = sorted(input_dtypes)
        assert all(name.isalnum() or name.replace("_", "").isalnum() for name in names)
        cond = " AND input_dtype IN (" + ", ".join(f"'{name}'" for name in names) + ")"
        return (self.store.load(item) for item, in self._scan("item", cond=cond))

    def values(self) -> Iterator[OutputPlan]:  # type: ignore[override]
        """The outputs, in key order, read a batch at a time."""
        return (self.store.load(item) for item, in self._scan("item"))

    def in_made_order(self) -> Iterator[OutputPlan]:
        """The outputs in the order they were added."""
        return (self.store.load(item) for item, in self._scan("item", order="rowid"))

    def so_far(self) -> Mapping[str, OutputPlan]:
        """The outputs added until now, not those added later (read-only, in key order)."""
        self.flush()
        return _OutputsUntil(self, self._count)

    def finish(self) -> PlanOutputs:
        """The outputs in key order, as a plan holds them: the table is renumbered so that
        a row's rowid is its rank (an item by index is one lookup)."""
        self.flush()
        db = self.store.db
        db.execute("CREATE TABLE ranked(key BLOB PRIMARY KEY, nbytes INTEGER NOT NULL, item BLOB NOT NULL)")
        db.execute("INSERT INTO ranked(rowid, key, nbytes, item) "
                   "SELECT row_number() OVER (ORDER BY key), key, nbytes, item FROM outputs ORDER BY key")
        db.execute("DROP TABLE outputs")
        total = db.first("SELECT coalesce(sum(nbytes), 0) FROM ranked")[0]
        return PlanOutputs(StoredRows(self.store, "ranked", self._count), total)


def keys_in_order(outputs: Mapping[str, Any]) -> Iterable[str]:
    """The keys of ``outputs`` in key order, read again on each pass (an ``OutputTable``'s
    are streamed from the store; another mapping's sorted once)."""
    return outputs if isinstance(outputs, OutputTable) else sorted(outputs)


class _Shapes:
    """(key, shape) of each output of an ``OutputTable``, in key order, on each pass read from
    its columns (no output made: an op chain's takes ~25 us)."""

    def __init__(self, table: OutputTable) -> None:
        self._table = table

    def __iter__(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        return ((key.decode("utf-8", "surrogatepass"), marshal.loads(shape))
                for key, shape in self._table._scan("key, shape"))


def shapes_in_order(outputs: Mapping[str, Any]) -> Iterable[tuple[str, tuple[int, ...]]]:
    """(key, shape) of ``outputs`` (anything with a ``shape``) in key order, read again on
    each pass (streamed from an ``OutputTable``)."""
    if isinstance(outputs, OutputTable):
        return _Shapes(outputs)
    return [(key, outputs[key].shape) for key in sorted(outputs)]


def made_from(outputs: Mapping[str, OutputPlan], input_dtypes: Iterable[str]) -> Iterable[OutputPlan]:
    """The outputs of ``outputs`` whose recipe makes one of ``input_dtypes``, in key order
    (streamed from an ``OutputTable``, the others not read)."""
    if isinstance(outputs, OutputTable):
        return outputs.made_from(input_dtypes)
    wanted = set(input_dtypes)
    return (outputs[key] for key in sorted(outputs) if outputs[key].input_dtype in wanted)


class _OutputsUntil(Mapping[str, OutputPlan]):
    """An ``OutputTable`` as it stood when it held ``count`` outputs."""

    def __init__(self, table: OutputTable, count: int) -> None:
        self._table, self._count = table, count

    def __getitem__(self, key: str) -> OutputPlan:
        item = self._table._value(f"SELECT item FROM outputs WHERE key = ? AND rowid <= {self._count}", key)
        if item is None:
            raise KeyError(key)
        return self._table.store.load(item)

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[str]:
        return (key.decode("utf-8", "surrogatepass") for key, in self._table._scan("key", bound=self._count))

    def items(self) -> Iterator[tuple[str, OutputPlan]]:  # type: ignore[override]
        return ((out.key, out) for out in (self._table.store.load(item) for item, in self._table._scan("item", bound=self._count)))
