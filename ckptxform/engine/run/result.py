"""What ``apply`` returns: ``ApplyResult`` and the ``WrittenTensor`` records in it."""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, overload

from ...tensor_digest import DEFAULT_DIGEST, NO_DIGEST, recorded_digest
from ..output.copied_files import CopiedFile
from ..plan.planner import Plan


@dataclass(frozen=True, slots=True)  # one a tensor: no __dict__ each
class WrittenTensor:
    key: str
    file: str
    shape: tuple[int, ...]
    dtype: str
    #: hex digest of the tensor's bytes, by ``algorithm`` (one of ckptxform.tensor_digest.DIGESTS;
    #: "" for NO_DIGEST)
    digest: str
    origin: dict[str, Any]
    algorithm: str = DEFAULT_DIGEST
    #: ``[start, end)`` of its bytes in ``file``: recorded when there is no digest, so the
    #: audit still says where every tensor is
    span: tuple[int, int] | None = None
    #: how its bytes reached the file: ``{"cloned": n, "copied": n, "written": n}`` (shared
    #: extents, a kernel copy, from memory); absent in audits older than the field
    moved: dict[str, int] | None = None

    def to_event(self) -> dict[str, Any]:
        # the record names its algorithm and holds the digest under that name (see ckptxform.digest)
        if self.algorithm == NO_DIGEST:
            event = {"event": "written", "key": self.key, "file": self.file, "shape": list(self.shape),
                     "dtype": self.dtype, "digest": NO_DIGEST, "bytes": list(self.span or ()), "from": self.origin}
        else:
            event = {"event": "written", "key": self.key, "file": self.file, "shape": list(self.shape),
                     "dtype": self.dtype, "digest": self.algorithm, self.algorithm: self.digest, "from": self.origin}
        if self.moved is not None:
            event["moved"] = self.moved
        return event

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> WrittenTensor:
        """The tensor a ``written`` record (checked by ckptxform.engine.output.verify.read_audit) describes."""
        recorded = recorded_digest(event) or (NO_DIGEST, "")
        return cls(event["key"], event["file"], tuple(event["shape"]), event["dtype"], recorded[1], event["from"],
                   recorded[0], tuple(event["bytes"]) if recorded[0] == NO_DIGEST else None, event.get("moved"))


#: every this many ``written`` lines the audit's byte offset is kept: a record is found by
#: reading at most this many lines (~100 us), for 8 bytes a mark (~0.03 bytes a tensor)
MARK_EVERY = 256


class WrittenInAudit(Sequence[WrittenTensor]):
    """The ``written`` records of a run's audit log (``path``), in its order (key order),
    read from the file when asked for: held, they were ~450 bytes a tensor (as
    ``WrittenTensor`` objects), or the shard records' digests until the run returned.
    ``marks[m]``: the byte offset of written record ``m * MARK_EVERY``. The log must stay
    where the run left it (OUT's ``ckptxform_audit.jsonl``)."""

    def __init__(self, path: Path, count: int, marks: array[int]) -> None:
        if len(marks) != -(-count // MARK_EVERY):
            raise ValueError(f"{len(marks)} marks for {count} written records")
        self.path, self._count, self._marks = path, count, marks

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[WrittenTensor]:
        return self._read(0, self._count)

    @overload
    def __getitem__(self, i: int) -> WrittenTensor: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[WrittenTensor, ...]: ...

    def __getitem__(self, i: int | slice) -> WrittenTensor | tuple[WrittenTensor, ...]:
        if isinstance(i, slice):
            start, stop, step = i.indices(self._count)
            if step == 1:
                return tuple(self._read(start, max(start, stop)))
            return tuple(self[j] for j in range(start, stop, step))
        if not -self._count <= i < self._count:
            raise IndexError(i)
        return next(self._read(i % self._count, i % self._count + 1))

    def _read(self, start: int, stop: int) -> Iterator[WrittenTensor]:
        """Written records ``start`` to ``stop`` (they are consecutive lines of the log)."""
        if start >= stop:
            return
        with self.path.open("rb") as file:
            file.seek(self._marks[start // MARK_EVERY])
            lines = islice(file, start % MARK_EVERY, start % MARK_EVERY + stop - start)
            read = 0
            for line in lines:
                event = json.loads(line)
                if not isinstance(event, dict) or event.get("event") != "written":
                    break
                read += 1
                yield WrittenTensor.from_event(event)
            if read < stop - start:
                raise ValueError(f"{str(self.path)!r} changed since the run wrote it: its written record "
                                 f"{start + read} is not where the run left it")


@dataclass(frozen=True)
class ApplyResult:
    """What ``apply`` wrote."""

    out: Path
    plan: Plan
    #: in key order (after a run, ``WrittenInAudit``: read from the audit log when asked for)
    written: Sequence[WrittenTensor]
    audit_path: Path
    bytes_written: int
    stale_removed: tuple[Path, ...] = ()
    #: True when ``out`` already held this exact conversion and nothing was written
    up_to_date: bool = False
    #: the rule's ``files`` copied into ``out``
    copied: tuple[CopiedFile, ...] = ()
    #: shards an interrupted run of the same plan had finished, kept instead of written
    shards_kept: int = 0
    #: ``apply --shard-of RANK/WORLD``: this rank, its shards, the job directory they are in
    #: (``out`` is then not written: ``ckptxform finalize`` does that)
    shard_of: tuple[int, int] | None = None
    shards_of_rank: int = 0
    job_path: Path | None = None
