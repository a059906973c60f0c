"""The planner's records, one a source tensor, by source and key, in the order first made.

The converted source's records (nearly all of a run's) are keyed by the key alone, the
other sources' by ``(source, key)``: one dict keeps the order of all of them, and the
~200,000 key tuples of a 200,000-tensor source (56 bytes each, held to the end of
planning, its peak) are not made. A str and a tuple never compare equal, so the two kinds
of keys cannot collide.
"""

from __future__ import annotations

from collections.abc import Iterator

from .recipes import TensorRecord


class RecordTable:
    """``table.get(source, key)``, ``table.put(record)``, iteration in first-made order."""

    def __init__(self, convert: str | None) -> None:
        self._convert = convert
        self._records: dict[str | tuple[str, str], TensorRecord] = {}

    def _slot(self, source: str, key: str) -> str | tuple[str, str]:
        return key if source == self._convert else (source, key)

    def get(self, source: str, key: str) -> TensorRecord | None:
        return self._records.get(self._slot(source, key))

    def put(self, record: TensorRecord) -> None:
        """Add ``record``, or replace the one of its source and key (which keeps its place)."""
        self._records[self._slot(record.source, record.key)] = record

    def __iter__(self) -> Iterator[TensorRecord]:
        return iter(self._records.values())

    def __len__(self) -> int:
        return len(self._records)
