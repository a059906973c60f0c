"""The shard writer: creates each output file at its full size and streams tensors into place.

``ShardWriter`` writes the header from the layout, then the executor streams each
tensor's bytes to its offset chunk by chunk (``pwrite``) or has the kernel copy them from
a source file (``copy_runs``), so memory stays bounded by a chunk. Every tensor is hashed
(BLAKE3, or sha256 on request: ckptxform.tensor_digest): a chunk given to ``write`` from
the memory ``pwrite`` copied it from, the bytes the kernel copied read back from the output
file on background threads while the next bytes move.

Example::

    layout = plan_layout([OutputTensorSpec("w", "BF16", (4, 8))], max_shard_size=None)
    with OutputDir(Path("out"), force=False) as out:
        with ShardWriter(out, layout) as shards:
            shards.write("w", data)              # any number of chunks, in order
            shards.finish_tensor("w")
            shards.write_json("config.json", config)
        digest = shards.digest("w")
        out.commit()
"""

from __future__ import annotations

import errno
import functools
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from ckptxform.errors import (
    OutputError,
    SourceNotFoundError,
    UsageError,
    quote_keys,
)

from ...fileio import hash_range
from ...tensor_digest import DEFAULT_DIGEST, NO_DIGEST, Hasher, check_digest, new_hasher, update_size
from ..output.digest_table import TensorDigests
from ..output.index_file import IndexFile
from ..plan.layout import CLONE_BLOCK, OutputLayout, TensorPlacement
from .kernel_copy import KernelCopier, truncated
from ...errors import io_error

#: hash threads; each tensor is hashed on one of them, in order, so a tensor per core hashes
#: at once (at least two: BLAKE3 outruns the kernel copy on one, sha256 at ~1.2 GB/s a core
#: does not); a tensor of PARALLEL_MIN bytes or more is hashed on every core besides
_HASH_THREADS = max(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2)
#: a tensor's bytes are hashed once this many more are in the file (and when it is finished)
_HASH_WINDOW = 16 << 20
#: bytes copied in the kernel at once: each piece is hashed while the next one copies
#: (so a shard's last hash ends ~3 ms after its last copy), and another thread's write to
#: the same file waits at most one piece
_COPY_PIECE = 16 << 20
#: a tensor of at most this many bytes, written whole, is hashed by the thread that
#: finished it: handing it to a hash thread cost more than hashing it (a submit and a
#: thread wake-up per tensor, a seventh of a 20,000-tensor rename)
_INLINE_HASH = 64 << 10
#: writes at least this big start their writeback at once (when OUT is fsynced)
_WRITEBACK_MIN = 1 << 20
#: a chunk given to ``write`` of at least this many bytes is hashed from the caller's memory
#: as it is written, not read back from the file: reading 2.6 GB of dequantized bf16 back
#: was a third of the FP8 dequant's system time (benchmarks/README.md, "FP8 dequant")
_MEMORY_HASH_MIN = _INLINE_HASH
#: such a chunk is hashed and written this many bytes at a time: a piece the hash has just
#: read is still in the core's cache when pwrite copies it (hashing and writing 2 GiB of
#: fresh 16 MiB buffers here: 4.5 CPU-seconds whole, 1.1 in 1 MiB pieces, 2.0 in 4 MiB)
_MEMORY_HASH_PIECE = 1 << 20


def _hash_written(hasher: Hasher, fd: int, offset: int, length: int, block: int | None) -> None:
    """Feed bytes ``offset:offset+length`` of output file ``fd`` to ``hasher``, read back
    where the write or copy just put them (from the page cache) through a buffer of
    ``block`` bytes (1 MiB, 4 MiB for a hasher on every core: tensor_digest), on
    a hash thread: the copy runs on another core meanwhile. Never through a
    mapping: an output file cut short under the run would be SIGBUS, not an error."""
    if hash_range(hasher, fd, offset, length, block) < length:
        raise OSError(errno.EIO, "the file is shorter than what was written to it")


#: a cloned range: (output offset, source file, source offset, length)
Clone = tuple[int, Path, int, int]


def _size(place: TensorPlacement) -> str:
    """``4096 (BF16 [32, 64])``: a tensor's size as its messages state it."""
    return f"{place.nbytes} ({place.spec.dtype} {list(place.spec.shape)})"


def _wait_all(jobs: list[Future[None]]) -> None:
    for job in jobs:
        job.result()


@functools.cache
def _libc_sync_file_range() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _sync_file_range_write(fd: int, offset: int, length: int) -> None:
    """Start writing a range of ``fd`` to disk without waiting (SYNC_FILE_RANGE_WRITE).
    A failure here is not reported: the fsync before the output is renamed reports it."""
    fn = _libc_sync_file_range()
    if fn is not None:
        fn(fd, offset, length, 2)


class _TensorState:
    __slots__ = ("block", "cloned", "clones", "copied", "digest", "finished", "hashed", "hasher", "hashes",
                 "lane", "placed", "placement", "written")

    def __init__(self, placement: TensorPlacement, algorithm: str) -> None:
        self.placement = placement
        #: bytes given to ``write``/``copy_runs`` so far; of those, in the file; of those, hashed
        self.written = self.placed = self.hashed = 0
        #: of the placed bytes, those cloned (shared extents) and those copied in the kernel;
        #: the rest went through ``write``
        self.cloned = self.copied = 0
        #: made when its first bytes are hashed, dropped once its digest is known: a hasher
        #: is ~2 KB (BLAKE3's state), held for every tensor of a shard it was most of the
        #: writer's memory at 20,000 tensors
        self.hasher: Hasher | None = None
        #: bytes read back and hashed at once
        self.block = update_size(algorithm, placement.nbytes)
        self.finished = False
        self.digest = b""
        #: the hash thread this tensor's bytes are hashed on (in order), once it has one
        self.lane: int | None = None
        #: its hash jobs on that thread, in order, and the cloned ranges placed but not
        #: hashed yet: a shared empty tuple until there is one (most small tensors never
        #: have any; two empty lists were ~110 bytes a tensor of a shard)
        self.hashes: Sequence[Future[None]] = ()
        self.clones: Sequence[Clone] = ()


class WriteTarget(Protocol):
    """Where a ShardWriter writes: files go to ``tmp_path``, messages name them in ``out``
    (an OutputDir, or a job's directory of shards: engine/output/jobdir.py)."""

    @property
    def tmp_path(self) -> Path: ...

    @property
    def out(self) -> Path: ...

    @property
    def fsync(self) -> bool: ...


def write_json_file(out: WriteTarget, layout: OutputLayout, name: str, obj: Any) -> Path:
    """Write ``obj`` as ``name`` (e.g. ``config.json``) next to the shards of ``layout``."""
    reserved = {s.file for s in layout.shards} | {layout.index_file}
    if not name or "/" in name or name in (".", "..") or name in reserved:
        raise UsageError(f"cannot write {name!r} into the output: use a plain file name "
                         "other than the weight files")
    path = out.tmp_path / name
    try:
        path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, allow_nan=False) + "\n", encoding="utf-8")
    except OSError as err:
        raise _write_error(out, name, err) from None
    return path


def write_index(out: WriteTarget, layout: OutputLayout) -> None:
    """Write the shard index of ``layout`` when it has several shards."""
    if layout.index_file is None:
        return
    # a key at a time: json.dumps with an indent joins a list of every piece of the text,
    # ~50 MB of small strings at 200,000 tensors, the peak of such a run (and its RSS after)
    try:
        index = IndexFile(out.tmp_path / layout.index_file, layout.total_bytes)
        try:
            for key, file in layout.keys_with_files():
                index.add(key, file)
        except BaseException:
            index.discard()
            raise
        index.close()
    except OSError as err:
        raise _write_error(out, layout.index_file, err) from None


def _write_error(out: WriteTarget, file: str, err: OSError) -> OutputError:
    return io_error("writing", out.out / file, err)


class ShardWriter:
    """Creates the shard files of ``layout`` in ``out.tmp_path`` and streams tensors into them.

    ``write`` places the next chunk of a tensor at its offset and ``copy_runs`` has the
    kernel copy the next runs of a source file; ``finish_tensor`` checks the byte count; ``close``
    checks every tensor was finished, waits for the hashes and writes the index; ``digest``
    is a tensor's digest (``algorithm``: one of ckptxform.tensor_digest.DIGESTS).

    A large chunk given to ``write`` is hashed from the caller's memory on the caller's
    thread, just before ``pwrite`` copies those same bytes into the file (a file cut short
    under the run is then caught by its size when the tensor is finished). Every other
    byte is hashed from the output file, read back where it landed (a cloned range: from
    its source, see ``_hash_range``): a tensor's bytes a window at a time as they arrive,
    on one of the hash threads (one a core; the hashers release the GIL), while the next
    bytes move. So the digest is of what was put in the file, nothing waits
    for a hash before ``close``, and a caller may refill its buffer as soon as ``write``
    returns. Writes into one file are serialised (a copy a piece at a time). Several threads
    may write, each tensor's chunks in order (a decoded block is hashed and written by the
    thread that decoded it, its turn after the block before it: quant/pipeline.py
    ``then_in_order``).
    """

    def __init__(self, out: WriteTarget, layout: OutputLayout, *, algorithm: str = DEFAULT_DIGEST) -> None:
        self.out = out
        self.layout = layout
        self.algorithm = check_digest(algorithm)
        #: False with ``--digest none``: no byte is read back (a clone then moves no data)
        self._hashing = algorithm != NO_DIGEST
        self._tensors = {key: _TensorState(p, algorithm) for key, p in layout.placements.items()}
        self._fds: dict[str, int] = {}
        self._file_locks = {shard.file: threading.Lock() for shard in layout.shards}
        #: source files of ``copy_runs``, opened once each
        self._src_fds: dict[Path, int] = {}
        self._lanes: list[ThreadPoolExecutor] = []
        #: bytes each hash thread has yet to hash of the tensors given to it
        self._backlog: list[int] = []
        self._old_sigxfsz: Any = None
        self._closed = False
        self._lock = threading.Lock()
        self.bytes_written = 0
        #: clones where the filesystem shares extents (engine/run/kernel_copy.py)
        self._copier = KernelCopier()

    @property
    def bytes_cloned(self) -> int:
        """Of ``bytes_written``, those cloned from a source file, not copied."""
        return self._copier.cloned

    def __enter__(self) -> ShardWriter:
        # Without this a file-size limit (ulimit -f) kills the process with SIGXFSZ;
        # ignored, the write fails with EFBIG and the run reports it cleanly.
        if threading.current_thread() is threading.main_thread():
            self._old_sigxfsz = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        try:
            for shard in self.layout.shards:
                path = self.out.tmp_path / shard.file
                try:  # read as well: every byte is hashed by reading it back
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                except OSError as err:
                    raise self._error(shard.file, err) from None
                self._fds[shard.file] = fd
                try:
                    os.ftruncate(fd, shard.file_nbytes)
                    self._pwrite_all(fd, memoryview(shard.header), 0)
                except OSError as err:
                    raise self._error(shard.file, err) from None
            self._lanes = [ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptxform-hash")
                           for _ in range(_HASH_THREADS)]
            self._backlog = [0] * len(self._lanes)
        except BaseException:
            self._release()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        else:
            self._release()

    def write(self, key: str, chunk: bytes | bytearray | memoryview) -> None:
        """Write the next ``len(chunk)`` bytes of tensor ``key`` (the caller may reuse ``chunk``
        once this returns)."""
        view = memoryview(chunk).cast("B")
        state, offset = self._reserve(key, view.nbytes)
        self._put(state, offset, view)

    def _put(self, state: _TensorState, offset: int, view: memoryview) -> None:
        """Hash (when large: from memory) and write ``view`` at ``offset`` of ``state``'s tensor."""
        file = state.placement.file
        hasher = self._memory_hasher(state, offset, view.nbytes)
        # hashed from memory, a piece at a time just before it is written: the hash brings
        # the piece into the cache that pwrite then copies it from
        step = max(view.nbytes, 1) if hasher is None else _MEMORY_HASH_PIECE  # range() needs a step
        try:
            for at in range(0, view.nbytes, step):
                piece = view[at:at + step]
                if hasher is not None:
                    hasher.update(piece)
                with self._file_locks[file]:
                    self._pwrite_all(self._fds[file], piece, offset + at)
        except OSError as err:
            raise self._error(file, err) from None
        self._placed(state, offset, view.nbytes, hashed=hasher is not None)

    def _memory_hasher(self, state: _TensorState, offset: int, size: int) -> Hasher | None:
        """The hasher to feed the chunk of ``size`` bytes at ``offset`` from memory, or None to
        hash it read back: only a large chunk that comes right after bytes already hashed
        or handed to finished hash jobs (a tensor is written by one thread, in order; a
        copy's bytes before it may still be queued, and the hasher takes bytes in order)."""
        with self._lock:
            if not self._hashing or size < _MEMORY_HASH_MIN or state.clones:
                return None
            if state.hashed != offset - state.placement.offset or not all(job.done() for job in state.hashes):
                return None
            # on one thread: the threads that write are the ones busy on the other cores
            # (BLAKE3's own threads then only spun beside them: 0.16-0.23 CPU-s of a 1 GB
            # FP8 dequant whose 264 MB tensor was hashed by them)
            return self._hasher(state, threads=False)

    def copy_runs(self, key: str, src: Path, runs: Sequence[tuple[int, int]]) -> None:
        """Write the next bytes of tensor ``key``: each ``(offset, length)`` run of file
        ``src`` in turn, copied inside the kernel (``copy_file_range``: no trip through
        Python memory, as ``cp`` does), or cloned where the filesystem can; runs of at most _COPY_PIECE bytes together are one
        piece (the many short runs of a row gather cost a system call each, no more)."""
        runs = [(offset + done, min(_COPY_PIECE, length - done))  # a long run is several pieces
                for offset, length in runs for done in range(0, length, _COPY_PIECE)]
        src_fd = self._source_fd(src)
        state, dst_offset = self._reserve(key, sum(length for _, length in runs))
        file = state.placement.file
        dst_fd = self._fds[file]
        piece: list[tuple[int, int]] = []
        size = 0
        for i, run in enumerate(runs):
            piece.append(run)
            size += run[1]
            if i + 1 < len(runs) and size + runs[i + 1][1] <= _COPY_PIECE:
                continue
            clones: list[Clone] = []
            try:
                with self._file_locks[file]:
                    at = dst_offset
                    for offset, length in piece:
                        if cloned := self._copier.copy(src_fd, offset, dst_fd, at, length, src):
                            head = -at % CLONE_BLOCK
                            clones.append((at + head, src, offset + head, cloned))
                        at += length
            except OSError as err:
                raise self._error(file, err) from None
            self._placed(state, dst_offset, size, clones, copied=True)
            dst_offset += size
            piece, size = [], 0

    def finish_tensor(self, key: str) -> None:
        """Check that all of tensor ``key`` was written (its hash may still be running)."""
        with self._lock:
            state = self._state(key)
            place = state.placement
            if state.written != place.nbytes:
                raise OutputError(f"tensor {key!r}: wrote {state.written} bytes, expected {_size(place)}", key=key)
        self._finish(state)

    def _finish(self, state: _TensorState) -> None:
        """Mark a fully written tensor finished and see to its hash."""
        with self._lock:
            place = state.placement
            state.finished = True
            if not self._hashing:
                return
            if place.nbytes >= _MEMORY_HASH_MIN:
                self._check_in_file(place)
            if not state.hashes and not state.clones and state.placed - state.hashed <= _INLINE_HASH:
                self._hash_inline(state)
            else:
                self._hash_placed(state)

    def _check_in_file(self, place: TensorPlacement) -> None:
        """Check that the file still holds all of a finished tensor: one hashed from memory
        is never read back, and an output cut short under the run is an error, not a digest
        of bytes that are gone."""
        try:
            if os.fstat(self._fds[place.file]).st_size < place.offset + place.nbytes:
                raise OSError(errno.EIO, "the file is shorter than what was written to it")
        except OSError as err:
            raise io_error("checking", self.out.out / place.file, err) from None

    def _hash_inline(self, state: _TensorState) -> None:
        """Hash a small tensor's bytes here, not on a hash thread (under the lock)."""
        place = state.placement
        hasher = self._hasher(state)
        try:
            _hash_written(hasher, self._fds[place.file], place.offset + state.hashed,
                          state.placed - state.hashed, state.block)
        except OSError as err:
            raise io_error("reading back", self.out.out / place.file, err) from None
        state.hashed = state.placed
        state.digest, state.hasher = hasher.digest(), None

    def _hasher(self, state: _TensorState, threads: bool = True) -> Hasher:
        """``state``'s hasher, made by its first bytes: a large tensor's on every core
        (tensor_digest.PARALLEL_MIN) unless those are hashed from memory (not ``threads``)."""
        if state.hasher is None:
            state.hasher = new_hasher(self.algorithm, state.placement.nbytes if threads else 0)
        return state.hasher

    def digest(self, key: str) -> str:
        """The digest (hex, of ``algorithm``) of finished tensor ``key``, once its hashing is
        done ("" with ``--digest none``)."""
        return self._raw_digest(key).hex()

    def _raw_digest(self, key: str) -> bytes:
        """``digest``, binary: 32 bytes a tensor, where the hex str is 113."""
        state = self._tensors.get(key)
        if state is None:
            self.layout.placement(key)  # raises the message
            raise AssertionError(key)
        if not state.finished:
            raise OutputError(f"tensor {key!r} is not finished yet", key=key)
        if not state.digest and self._hashing:
            _wait_all(state.hashes)
            state.digest, state.hasher, state.hashes = self._hasher(state).digest(), None, ()
        return state.digest

    def moved(self, key: str) -> tuple[int, int]:
        """``(cloned, copied)``: of tensor ``key``'s bytes, those the filesystem cloned and
        those the kernel copied (the rest were written from memory)."""
        state = self._tensors[key]
        return state.cloned, state.copied

    def take_results(self) -> tuple[TensorDigests, tuple[tuple[int, int], ...]]:
        """Once closed: ``(key, digest)`` and ``moved`` of every tensor, in data order, each
        tensor's state dropped as it is taken (this writer then answers for none): held
        with the states, these pairs were the peak of a shard of many small tensors."""
        keys, digests, moved = [], [], []
        # one tuple per distinct pair: most of a shard's tensors moved alike (all written,
        # or all of their bytes copied in the kernel), ~11 MB at 200,000 tensors
        pairs: dict[tuple[int, int], tuple[int, int]] = {}
        for key in self.layout.placements:
            keys.append(key)
            digests.append(self._raw_digest(key))
            pair = self.moved(key)
            moved.append(pairs.setdefault(pair, pair))
            del self._tensors[key]
        return TensorDigests.from_raw(keys, digests), tuple(moved)

    def write_json(self, name: str, obj: Any) -> Path:
        """Write ``obj`` as ``name`` (e.g. ``config.json``) next to the shards."""
        return write_json_file(self.out, self.layout, name, obj)

    def close(self) -> None:
        """Check every tensor was finished and write the index when sharded."""
        if self._closed:
            return
        try:
            unfinished = [k for k, s in self._tensors.items() if not s.finished]
            if unfinished:
                detail = "; ".join(f"{k!r} {self._tensors[k].written} of "
                                   f"{self._tensors[k].placement.nbytes} bytes"
                                   for k in sorted(unfinished)[:8])
                raise OutputError(f"{len(unfinished)} output tensor(s) were not written completely: "
                                  f"{quote_keys(unfinished)} ({detail}); this is a bug in the "
                                  "executor, please report it", key=min(unfinished))
            for key in self._tensors:
                self.digest(key)
            write_index(self.out, self.layout)
        finally:
            self._release()

    def _state(self, key: str) -> _TensorState:
        if self._closed or not self._lanes:
            raise OutputError(f"tensor {key!r}: the shard writer is not open", key=key)
        try:
            return self._tensors[key]
        except KeyError:
            self.layout.placement(key)  # raises the message
            raise

    def _reserve(self, key: str, size: int) -> tuple[_TensorState, int]:
        """Claim the next ``size`` bytes of tensor ``key``: its state and their file offset
        (under the lock: two threads may write different tensors)."""
        with self._lock:
            state = self._state(key)
            self._check_room(state, size)
            offset = state.placement.offset + state.written
            state.written += size
            self.bytes_written += size
            return state, offset

    def _placed(self, state: _TensorState, offset: int, size: int, clones: Sequence[Clone] = (),
                copied: bool = False, hashed: bool = False) -> None:
        """``size`` bytes of ``state``'s tensor are in the file at ``offset`` (``clones`` of
        them cloned; the rest copied in the kernel when ``copied``, else written; already
        hashed from memory when ``hashed``)."""
        with self._lock:
            state.placed += size
            if hashed:
                state.hashed += size
            if copied:
                cloned = sum(clone[3] for clone in clones)
                state.cloned += cloned
                state.copied += size - cloned
            if clones:
                state.clones = [*state.clones, *clones]
            if self._hashing and state.placed - state.hashed >= _HASH_WINDOW:
                self._hash_placed(state)
        self._start_writeback(self._fds[state.placement.file], offset, size)

    def _hash_placed(self, state: _TensorState) -> None:
        """Hash the bytes of ``state``'s tensor placed since its last hash job, on its hash
        thread, after its earlier jobs (under the lock)."""
        size = state.placed - state.hashed
        if not size:
            return
        place = state.placement
        if state.lane is None:  # a tensor goes to the thread with the least left to hash
            state.lane = min(range(len(self._lanes)), key=self._backlog.__getitem__)
            self._backlog[state.lane] += place.nbytes
        lane = state.lane
        self._hasher(state)
        job = self._lanes[lane].submit(self._hash_range, lane, state, place.offset + state.hashed, size,
                                       list(state.clones))
        if not state.hashes:
            state.hashes = []
        state.hashes.append(job)  # type: ignore[attr-defined]  # a list once it has a job
        state.hashed = state.placed
        state.clones = ()

    def _hash_range(self, lane: int, state: _TensorState, offset: int, length: int, clones: list[Clone]) -> None:
        """A hash job, on hash thread ``lane``: bytes ``offset:offset+length`` of output
        ``file``, the cloned ranges among them read from their source. A clone's blocks are
        the source's (the filesystem flushed and shared them), the source's page cache is
        where they are likely cached (a fresh clone's never is: read back, it costs a disk
        read, 7 s a GB on this vm's loop XFS against 0.8-1 s from the source's cache), and
        a source written to after its clone fails the run at its pin check (job.py)."""
        file, hasher, block = state.placement.file, state.hasher, state.block
        fd = self._fds[file]
        try:
            for at, src, src_offset, size in clones:
                _hash_written(hasher, fd, offset, at - offset, block)
                if hash_range(hasher, self._src_fds[src], src_offset, size, block) < size:
                    raise truncated(src, src_offset)
                length -= at + size - offset
                offset = at + size
            _hash_written(hasher, fd, offset, length, block)
        except OSError as err:
            raise io_error("reading back", self.out.out / file, err) from None
        finally:
            with self._lock:
                self._backlog[lane] -= length

    def _source_fd(self, path: Path) -> int:
        with self._lock:
            fd = self._src_fds.get(path)
            if fd is None:
                try:
                    fd = self._src_fds[path] = os.open(path, os.O_RDONLY)
                except OSError as err:
                    raise SourceNotFoundError(f"opening source file {str(path)!r} failed: {err.strerror or err}; "
                                              "was it moved or deleted during the run?") from None
            return fd

    def _check_room(self, state: _TensorState, size: int) -> None:
        place = state.placement
        if state.written + size > place.nbytes:
            raise OutputError(f"tensor {place.spec.key!r}: got {state.written + size} bytes, expected "
                              f"{_size(place)}", key=place.spec.key)

    def _start_writeback(self, fd: int, offset: int, length: int) -> None:
        # When OUT will be fsynced anyway, have the disk start on these bytes now: it then
        # works while we copy and hash, and the final fsync finds little left to do.
        if self.out.fsync and length >= _WRITEBACK_MIN:
            _sync_file_range_write(fd, offset, length)

    @staticmethod
    def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
        while view:
            done = os.pwrite(fd, view, offset)
            view = view[done:]
            offset += done

    def _error(self, file: str, err: OSError) -> OutputError:
        return _write_error(self.out, file, err)

    def _release(self) -> None:
        self._closed = True
        for lane in self._lanes:
            lane.shutdown(wait=True, cancel_futures=True)
        for fd in (*self._fds.values(), *self._src_fds.values()):
            os.close(fd)
        self._fds.clear()
        self._src_fds.clear()
        if self._old_sigxfsz is not None:
            signal.signal(signal.SIGXFSZ, self._old_sigxfsz)
            self._old_sigxfsz = None
