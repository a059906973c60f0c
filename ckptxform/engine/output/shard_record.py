"""A finished shard's record (``FILE.record.json`` in the job directory) and its file format.

JSON lines: the first is an object (file, size, header digest, algorithm, inode, mtime,
fetch events, cloned bytes, how many tensors), then one ``[key, place, digest, cloned,
copied]`` a tensor, in key order (``place``: its index in the file's data order). In key
order, a record is already a sorted run: the run's commit merges every shard's records
into the key order of the audit and the index reading a few lines of each at a time
(``tensor_lines``). Holding every shard's record until then was ~50 bytes a tensor;
reading back records in file order and sorting each one held ~300 bytes a tensor of a
shard at once. A rerun reads a whole record (``read_record``) to check and keep its shard.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from .digest_table import TensorDigests
from ..plan.layout import ShardLayout

#: the first line's fields, in the order written
_HEAD = ("file", "size", "header_sha256", "algorithm", "inode", "mtime_ns", "fetches", "cloned", "tensors")


@dataclass(frozen=True)
class ShardRecord:
    """One finished shard: what a rerun checks before keeping it, and the digests the audit records."""

    file: str
    size: int
    header_sha256: str
    algorithm: str
    #: ``(key, hex digest)`` of every tensor, in file order (held binary)
    digests: TensorDigests
    #: the shard file's inode and modification time when it was committed
    inode: int
    mtime_ns: int
    #: the audit's ``fetch`` events of the Hub bytes the task read (by whichever process ran it)
    fetches: tuple[dict[str, Any], ...]
    #: of its data bytes, those cloned from a source file (shared extents), not copied
    cloned: int = 0
    #: ``(cloned, copied)`` bytes of every tensor, in file order (the rest were written from
    #: memory): how each reached the file, for the audit
    moved: tuple[tuple[int, int], ...] = ()

    def head(self) -> dict[str, Any]:
        """The first line's object."""
        return {"file": self.file, "size": self.size, "header_sha256": self.header_sha256,
                "algorithm": self.algorithm, "inode": self.inode, "mtime_ns": self.mtime_ns,
                "fetches": list(self.fetches), "cloned": self.cloned, "tensors": len(self.digests)}

    def write(self, file: IO[str]) -> None:
        """Write the record's lines (the tensors sorted by key here: a list of their places,
        ~40 bytes a tensor of the shard, while it is written)."""
        if len(self.moved) != len(self.digests):
            raise ValueError(f"the record of {self.file} has {len(self.moved)} moved pairs "
                             f"for {len(self.digests)} digests")
        file.write(json.dumps(self.head()) + "\n")
        keys, digests, moved = self.digests.keys, self.digests, self.moved
        for j in sorted(range(len(keys)), key=keys.__getitem__):
            cloned, copied = moved[j]
            file.write(f'[{json.dumps(keys[j])}, {j}, "{digests.raw(j).hex()}", {cloned}, {copied}]\n')

    def matches(self, shard: ShardLayout, algorithm: str) -> bool:
        return (self.file == shard.file and self.size == shard.file_nbytes and self.algorithm == algorithm
                and self.header_sha256 == hashlib.sha256(shard.header).hexdigest()
                and list(self.digests.keys) == [spec.key for spec in shard.specs])


def read_record(path: Path) -> ShardRecord | None:
    """The record in ``path``, or None when it cannot be read or is not a well-formed
    record (a field missing or of another type, the tensors not in key order or not each
    at one place, a digest not lowercase hex of the record's one width)."""
    try:
        with path.open("rb") as file:
            head = _head(file.readline())
            items = json.loads(b"[" + b",".join(file.readlines()) + b"]")
        if head is None or len(items) != head["tensors"]:
            return None
        return _record(head, items)
    except (OSError, ValueError, TypeError, LookupError):
        return None


def record_head(path: Path) -> dict[str, Any] | None:
    """The first line of the record in ``path`` (the tensors are not read), or None when
    it cannot be read or is not well formed."""
    try:
        with path.open("rb") as file:
            return _head(file.readline())
    except (OSError, ValueError):
        return None


def tensor_lines(path: Path, chunk_bytes: int) -> Iterator[list[Any]]:
    """The record's ``[key, place, digest, cloned, copied]`` lines in order (key order),
    read ``chunk_bytes`` at a time (the file is opened again for each chunk: a merge of
    thousands of records holds no file open)."""
    with path.open("rb") as file:
        file.readline()
        at = file.tell()
    while True:
        with path.open("rb") as file:
            file.seek(at)
            lines = file.readlines(chunk_bytes)
            at = file.tell()
        if not lines:
            return
        items = json.loads(b"[" + b",".join(lines) + b"]")
        del lines  # the text is not held while its items are
        yield from items


def _head(line: bytes) -> dict[str, Any] | None:
    head = json.loads(line)
    if not isinstance(head, dict) or tuple(head) != _HEAD:
        return None
    types = (str, int, str, str, int, int, list, int, int)
    if not all(type(head[name]) is kind for name, kind in zip(_HEAD, types)):
        return None
    if not all(isinstance(event, dict) for event in head["fetches"]):
        return None
    return head


def _record(head: dict[str, Any], items: list[Any]) -> ShardRecord | None:
    """The record of ``head`` and its tensor lines ``items`` (put back in file order)."""
    count = len(items)
    keys: list[str | None] = [None] * count
    raw: list[bytes] = [b""] * count
    moved: list[tuple[int, int]] = [(0, 0)] * count
    width = len(items[0][2]) // 2 if items else 0
    previous = None
    for key, j, digest, cloned, copied in items:
        if type(key) is not str or (previous is not None and key <= previous):
            return None
        if type(j) is not int or not 0 <= j < count or keys[j] is not None:
            return None
        if type(cloned) is not int or type(copied) is not int:
            return None
        binary = bytes.fromhex(digest)
        if len(binary) != width or binary.hex() != digest:
            return None
        keys[j], raw[j], moved[j], previous = key, binary, (cloned, copied), key
    digests = TensorDigests.from_raw(keys, raw)  # type: ignore[arg-type]  # every place was filled
    return ShardRecord(head["file"], head["size"], head["header_sha256"], head["algorithm"], digests,
                       head["inode"], head["mtime_ns"], tuple(head["fetches"]), head["cloned"], tuple(moved))
