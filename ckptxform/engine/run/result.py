"""What ``apply`` returns: ``ApplyResult`` and the ``WrittenTensor`` records in it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


@dataclass(frozen=True)
class ApplyResult:
    """What ``apply`` wrote."""

    out: Path
    plan: Plan
    #: in key order (a sequence that makes each record when asked for, after a run)
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
