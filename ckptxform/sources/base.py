"""What every source looks like to the planner and the executor.

A ``Checkpoint`` is an index built from headers only (key -> dtype, shape, file, byte
range) plus the means to read byte ranges of one tensor. Local files, ``pytorch_model.bin``
and Hub repos all implement it, so the planner never knows where bytes come from.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import SourceNotFoundError, UsageError
from .pins import FilePin


@dataclass(frozen=True, slots=True)  # one a tensor: no __dict__ each
class TensorInfo:
    """One tensor as its header describes it. ``offset`` is the absolute position of the
    tensor's first data byte in ``file`` (a name relative to the checkpoint root)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    offset: int
    nbytes: int

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row (one index of the first dimension)."""
        if not self.shape or self.shape[0] == 0:
            return self.nbytes
        return self.nbytes // self.shape[0]


@dataclass(frozen=True)
class ShardInfo(TensorInfo):
    """Model-parallel shard ``shard``'s piece of tensor ``key`` (of a source whose files
    each hold a piece of every tensor: ``sources/model_parallel.py``)."""

    shard: int = 0


@dataclass(frozen=True)
class Unread:
    """An entry of a checkpoint that is no model weight (a trainer's optimizer state, a
    pickled object): never read; the audit lists it as skipped, with ``reason``."""

    key: str
    dtype: str  # a safetensors dtype name, torch's name when it has none, "object" for a pickle
    shape: tuple[int, ...]
    reason: str


class Checkpoint(ABC):
    """A checkpoint whose headers have been read. Subclasses read bytes on demand."""

    #: what the user wrote (path, ``ORG/NAME@REV``...)
    location: str
    #: ``tensors`` ordered by file, then offset
    tensors: Mapping[str, TensorInfo]
    #: every weight file of the checkpoint (relative names), whether or not it is read
    files: tuple[str, ...]
    #: the revision asked for and the commit it resolved to (Hub sources only)
    revision: str | None = None
    commit: str | None = None
    #: entries that are not model weights (DCP training checkpoints), never read
    unread: tuple[Unread, ...] = ()

    @abstractmethod
    def config(self, name: str = "config.json") -> dict[str, Any] | None:
        """The checkpoint's config file ``name`` (``params.json`` of a Meta/Mistral
        consolidated checkpoint), or None when it has none."""

    @abstractmethod
    def read(self, info: TensorInfo, start: int = 0, length: int | None = None) -> bytes:
        """``length`` bytes of tensor ``info`` from ``start`` (relative to its first byte)."""

    def _checked_range(self, info: TensorInfo, start: int, length: int | None) -> int:
        """``length`` (None: to the end), after checking the range lies inside ``info``."""
        if length is None:
            length = info.nbytes - start
        if start < 0 or length < 0 or start + length > info.nbytes:
            raise UsageError(
                f"{self.location}: bytes [{start}, {start + length}) are outside tensor "
                f"{info.key!r}, which has {info.nbytes} bytes",
                key=info.key,
            )
        return length

    def shard_tensors(self, key: str) -> tuple[TensorInfo, ...]:
        """Tensor ``key`` as each model-parallel shard holds it, in rank order: the tensor
        itself for a checkpoint that is not split across shard files."""
        return (self.tensors[key],)

    def read_runs(self, info: TensorInfo, runs: Sequence[tuple[int, int]]) -> list[bytes]:
        """The bytes of each ``(first, count)`` run of adjacent rows of ``info``, in the
        order given; remote sources override this to batch range requests."""
        width = info.row_nbytes
        return [self.read(info, first * width, count * width) for first, count in runs]

    def read_runs_into(self, info: TensorInfo, runs: Sequence[tuple[int, int]], out: memoryview,
                       at: Sequence[int]) -> None:
        """Read each ``(first, count)`` run of rows of ``info`` into ``out`` from row ``at[i]``
        on (``out``'s rows as wide as ``info``'s); local files read straight into ``out``."""
        width = info.row_nbytes
        for (_, count), pos, blob in zip(runs, at, self.read_runs(info, runs), strict=True):
            out[pos * width:(pos + count) * width] = blob

    def read_rows(self, info: TensorInfo, rows: Sequence[int]) -> dict[int, bytes]:
        """The bytes of each requested row; runs of adjacent rows are read at once."""
        out: dict[int, bytes] = {}
        width = info.row_nbytes
        runs = row_runs(rows)
        for (first, count), blob in zip(runs, self.read_runs(info, runs), strict=True):
            for i in range(count):
                out[first + i] = blob[i * width : (i + 1) * width]
        return out

    def tensors_of_file(self, file: str) -> list[TensorInfo]:
        """Every tensor stored in ``file`` (its header is read if it was not yet)."""
        return [info for info in self.tensors.values() if info.file == file]

    def file_of(self, key: str) -> str:
        """The file holding tensor ``key`` (KeyError if none); a sharded checkpoint answers
        from its index, without reading a header."""
        return self.tensors[key].file

    def tensor_keys(self) -> list[str]:
        """Every tensor key, without reading a header that was not read yet (a sharded
        checkpoint's: from its index)."""
        return list(self.tensors)

    def raw_header(self, file: str) -> bytes:
        """Safetensors ``file``'s first bytes as it holds them: the 8-byte length and the
        header (what an output laid out like this source copies for a file it leaves
        unchanged); the header of a file whose tensors were listed."""
        raise UsageError(f"{self.location}: {file!r} is not a safetensors file; an output can be laid out only "
                         "like a safetensors source")

    def unread_header_keys(self, file: str) -> Sequence[str] | None:
        """The keys the index assigns to ``file`` when its header has not been read
        (sorted: their offsets are not known), else None. Reading one of its tensors, or
        ``tensors_of_file``, reads it."""
        return None

    def read_headers(self, files: Sequence[str]) -> None:
        """Read the headers of ``files`` now, the plan being about to need them all (a
        source that reads them over the network reads them at once; by default, nothing:
        each is read when first needed)."""

    def fingerprint(self) -> str | None:
        """The audit's ``fingerprint`` of a source: the commit of a Hub source; for local
        files, a digest of each weight file's name, size and mtime. (Whether a rerun is up
        to date is decided from ``pins``, see ``ckptxform.engine.output.digest``.)"""
        if self.commit is not None:
            return self.commit
        digest = hashlib.sha256()
        for file in sorted(self.files):
            path = self.local_path(file)
            if path is None:
                return None
            stat = path.stat()
            digest.update(f"{file}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
        return digest.hexdigest()

    def local_path(self, file: str) -> Path | None:
        """A local path holding ``file``'s exact bytes (for streaming copies), or None."""
        return None

    def local_segments(self, info: TensorInfo, start: int, length: int) -> list[tuple[Path, int, int]] | None:
        """Where bytes ``[start, start + length)`` of tensor ``info`` lie in local files, in
        order, as ``(path, offset, length)``: what a kernel copy reads; None where they do not
        (a Hub source, a ``.bin`` tensor). A tensor stored in one place is one segment; a
        source that keeps a tensor in pieces (DCP chunks) says where each piece is."""
        if info.offset < 0:
            return None
        path = self.local_path(info.file)
        return None if path is None else [(path, info.offset + start, length)]

    def list_files(self) -> tuple[str, ...]:
        """Every file of the checkpoint's folder or repo, weights included, as sorted
        relative ``/``-separated paths (what a rule's ``files`` globs match)."""
        return tuple(sorted(self.files))

    def file_path(self, name: str) -> Path:
        """A local path holding the bytes of ``name`` (one of ``list_files()``); Hub
        sources download that one file."""
        path = self.local_path(name)
        if path is None:
            raise SourceNotFoundError(f"{self.location}: cannot read file {name!r}", path=name)
        return path

    def pins(self) -> tuple[FilePin, ...]:
        """Every local file read so far, as it stood when it was read (local sources)."""
        return ()

    def local_paths(self) -> tuple[Path, ...]:
        """Where this source lies on the local disk (resolved): an output must not overlap it."""
        return ()

    def prefetch(self, files: Iterable[str], *, tensors: Iterable[str] = (),
                 rows: Mapping[str, Sequence[int]] | None = None) -> None:
        """Get ready to read ``files`` whole, the tensors named by ``tensors`` whole and
        ``rows`` (tensor key -> row indices) of others (Hub sources fetch them now, by
        ranges or a download)."""

    def audit_notes(self) -> list[dict[str, Any]]:
        """Audit records of what the source holds besides tensors and files that no output
        carries (a GGUF's tokenizer metadata), without ``source``: the run adds it."""
        return []

    def fetch_events(self) -> list[dict[str, Any]]:
        """Audit ``fetch`` events: how ``prefetch`` fetched each file and why (Hub sources)."""
        return []

    def first_etags(self) -> dict[str, str]:
        """File -> the ETag of the first bytes served of it so far (Hub sources): what a
        worker process of the same run must be served too (``expect_etags``)."""
        return {}

    def expect_etags(self, etags: Mapping[str, str]) -> None:
        """Refuse bytes of ``etags``' files from any other object than the ETag given
        (a worker holding to what its run read first)."""

    def close(self) -> None:
        """Release open files and connections."""

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def row_runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted unique ``rows`` as ``(first, count)`` runs of adjacent indices."""
    runs: list[tuple[int, int]] = []
    for row in sorted(set(rows)):
        if runs and runs[-1][0] + runs[-1][1] == row:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((row, 1))
    return runs
