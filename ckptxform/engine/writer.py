"""The shard writer: creates each output file at its full size and streams tensors into place.

``ShardWriter`` writes the header from the layout, then the executor streams each
tensor's bytes to its offset chunk by chunk (``pwrite``) or has the kernel copy them from
a source file (``copy_from``), so memory stays bounded by a chunk. Every tensor is hashed
(BLAKE3, or sha256 on request: ckptxform.tensor_digest) on background threads while the bytes move.

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
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from ckptxform.errors import (
    CheckpointFormatError,
    OutputError,
    SourceNotFoundError,
    UsageError,
    quote_keys,
)

from ..tensor_digest import DEFAULT_DIGEST, Hasher, check_digest, new_hasher
from ..fileio import hash_range
from .layout import OutputLayout, TensorPlacement
from .outdir import io_error

#: chunks at least this big are hashed on the background thread; below it the
#: hand-off costs more than it saves
_ASYNC_HASH_MIN = 1 << 20
#: chunks still being hashed when ``write`` returns: one overlaps hashing with the
#: caller reading the next chunk; more only holds memory (hashing is the slower side)
_HASH_PIPELINE_DEPTH = 1

#: threads hashing kernel-copied ranges, several tensors at once: BLAKE3 outruns the copy
#: on one; sha256 (~1.2 GB/s a core) is slower than the copy, and with two it uses the core
#: the copy leaves idle and, once the copies are done, both cores.
_COPY_HASH_THREADS = 2

#: bytes copied at once where the kernel cannot copy
_COPY_BLOCK = 8 << 20

def _hash_range(hasher: Hasher, fd: int, offset: int, length: int, path: Path) -> None:
    """Feed ``length`` bytes of ``fd`` (file ``path``) from ``offset`` to ``hasher``.

    Read from the page cache (the kernel copy reads the same range; whichever comes second
    finds it cached) into one 1 MiB buffer reused for the whole range: it stays in the
    core's cache, so the extra copy costs next to nothing (measured: the same user and sys
    time as hashing through a read-only mapping), and unlike a mapping, a source truncated
    during the run is a clean error, not SIGBUS.
    """
    try:
        done = hash_range(hasher, fd, offset, length)
    except OSError as err:
        raise CheckpointFormatError(f"reading {str(path)!r} failed: {err.strerror or err}") from None
    if done < length:
        raise _truncated(path, offset + done)


def _truncated(path: Path, offset: int) -> CheckpointFormatError:
    return CheckpointFormatError(f"source file {str(path)!r} ended at byte {offset}, inside a tensor its "
                                 "header lists; was it truncated or rewritten during the run?")


def _copy_range(src: int, src_offset: int, dst: int, dst_offset: int, length: int, src_path: Path) -> None:
    """Copy bytes between files in the kernel; plain reads and writes where it cannot
    (another filesystem, an old kernel, or no copy_file_range at all: macOS)."""
    kernel_copy = getattr(os, "copy_file_range", None)
    while length:
        n = 0
        if kernel_copy is not None:
            try:
                n = kernel_copy(src, dst, length, src_offset, dst_offset)
            except OSError as err:
                if err.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    raise
        if n == 0:  # not supported here (or EOF): copy the rest through a buffer
            block = os.pread(src, min(length, _COPY_BLOCK), src_offset)
            if not block:
                raise _truncated(src_path, src_offset)
            n = os.pwrite(dst, block, dst_offset)
        src_offset += n
        dst_offset += n
        length -= n


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
    __slots__ = ("copy_hashes", "digest", "finished", "hasher", "placement", "written")

    def __init__(self, placement: TensorPlacement, algorithm: str) -> None:
        self.placement = placement
        self.written = 0
        self.hasher = new_hasher(algorithm)
        self.finished = False
        self.digest = ""
        #: hashes of the ranges copied in the kernel (``copy_from``), in order
        self.copy_hashes: list[Future[None]] = []


class WriteTarget(Protocol):
    """Where a ShardWriter writes: files go to ``tmp_path``, messages name them in ``out``
    (an OutputDir, or a job's directory of shards: engine/jobdir.py)."""

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
    index = json.dumps(layout.index_json(), indent=2) + "\n"
    try:
        (out.tmp_path / layout.index_file).write_text(index, encoding="utf-8")
    except OSError as err:
        raise _write_error(out, layout.index_file, err) from None


def _write_error(out: WriteTarget, file: str, err: OSError) -> OutputError:
    return io_error("writing", out.out / file, err)


class ShardWriter:
    """Creates the shard files of ``layout`` in ``out.tmp_path`` and streams tensors into them.

    ``write`` places the next chunk of a tensor at its offset and ``copy_from`` has the
    kernel copy it from a source file; ``finish_tensor`` checks the byte count; ``close``
    checks every tensor was finished, waits for the hashes and writes the index; ``digest``
    is a tensor's digest (``algorithm``: one of ckptxform.tensor_digest.DIGESTS). Nothing waits for a hash before ``close``: large written chunks
    are hashed on a background thread (the hashers release the GIL) and copied ranges on two
    more, straight from the source's page cache, while the next bytes move.
    """

    def __init__(self, out: WriteTarget, layout: OutputLayout, *, algorithm: str = DEFAULT_DIGEST) -> None:
        self.out = out
        self.layout = layout
        self.algorithm = check_digest(algorithm)
        self._tensors = {key: _TensorState(p, algorithm) for key, p in layout.placements.items()}
        self._fds: dict[str, int] = {}
        #: source files of ``copy_from``, open until their ranges are hashed
        self._src_fds: dict[Path, int] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._copy_pool: ThreadPoolExecutor | None = None
        self._pending: deque[Future[None]] = deque()
        self._old_sigxfsz: Any = None
        self._closed = False
        self._lock = threading.Lock()
        self.bytes_written = 0

    def __enter__(self) -> ShardWriter:
        # Without this a file-size limit (ulimit -f) kills the process with SIGXFSZ;
        # ignored, the write fails with EFBIG and the run reports it cleanly.
        if threading.current_thread() is threading.main_thread():
            self._old_sigxfsz = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        try:
            for shard in self.layout.shards:
                path = self.out.tmp_path / shard.file
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                except OSError as err:
                    raise self._error(shard.file, err) from None
                self._fds[shard.file] = fd
                try:
                    os.ftruncate(fd, shard.file_nbytes)
                    self._pwrite_all(fd, memoryview(shard.header), 0)
                except OSError as err:
                    raise self._error(shard.file, err) from None
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptxform-hash")
            self._copy_pool = ThreadPoolExecutor(max_workers=_COPY_HASH_THREADS,
                                                 thread_name_prefix="ckptxform-hash-copy")
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
        """Write the next ``len(chunk)`` bytes of tensor ``key``. A writable ``chunk`` may be
        refilled as soon as this returns; a read-only one must not change until ``close``."""
        view = memoryview(chunk).cast("B")
        size = view.nbytes
        # Bookkeeping under the lock (two threads may write different tensors); the
        # write itself outside it.
        with self._lock:
            state = self._state(key)
            place = state.placement
            self._check_room(state, size)
            _wait_all(state.copy_hashes)  # a tensor's bytes are hashed in order
            if size >= _ASYNC_HASH_MIN:
                assert self._pool is not None
                self._pending.append(self._pool.submit(state.hasher.update, view))
            else:
                self._drain(0)
                state.hasher.update(view)
            offset = place.offset + state.written
            state.written += size
            self.bytes_written += size
        fd = self._fds[place.file]
        try:
            self._pwrite_all(fd, view, offset)
        except OSError as err:
            raise self._error(place.file, err) from None
        self._start_writeback(fd, offset, size)
        # a writable buffer may be refilled by the caller as soon as we return
        with self._lock:
            self._drain(_HASH_PIPELINE_DEPTH if view.readonly else 0)

    def copy_from(self, key: str, src: Path, src_offset: int, length: int) -> None:
        """Write the next ``length`` bytes of tensor ``key`` by copying them from file ``src``
        at ``src_offset`` inside the kernel (``copy_file_range``: no trip through Python
        memory, as ``cp`` does). The same range is hashed from the source's page cache on
        a hash thread meanwhile (the writer keeps ``src`` open until then)."""
        src_fd = self._source_fd(src)
        with self._lock:
            state = self._state(key)
            place = state.placement
            self._check_room(state, length)
            if state.written:  # an earlier part of this tensor may still be hashing
                self._drain(0)
                _wait_all(state.copy_hashes)
            assert self._copy_pool is not None
            state.copy_hashes.append(self._copy_pool.submit(_hash_range, state.hasher, src_fd, src_offset, length, src))
            dst_fd, dst_offset = self._fds[place.file], place.offset + state.written
            state.written += length
            self.bytes_written += length
        try:
            _copy_range(src_fd, src_offset, dst_fd, dst_offset, length, src)
        except OSError as err:
            raise self._error(place.file, err) from None
        self._start_writeback(dst_fd, dst_offset, length)

    def finish_tensor(self, key: str) -> None:
        """Check that all of tensor ``key`` was written (its hash may still be running)."""
        with self._lock:
            state = self._state(key)
            place = state.placement
            if state.written != place.nbytes:
                raise OutputError(f"tensor {key!r}: wrote {state.written} bytes, expected {_size(place)}", key=key)
            state.finished = True

    def digest(self, key: str) -> str:
        """The digest (hex, of ``algorithm``) of finished tensor ``key``, once its hashing is done."""
        state = self._tensors.get(key)
        if state is None:
            self.layout.placement(key)  # raises the message
            raise AssertionError(key)
        if not state.finished:
            raise OutputError(f"tensor {key!r} is not finished yet", key=key)
        if not state.digest:
            with self._lock:
                self._drain(0)
                _wait_all(state.copy_hashes)
                state.digest = state.hasher.hexdigest()
        return state.digest

    def write_json(self, name: str, obj: Any) -> Path:
        """Write ``obj`` as ``name`` (e.g. ``config.json``) next to the shards."""
        return write_json_file(self.out, self.layout, name, obj)

    def close(self) -> None:
        """Check every tensor was finished and write the index when sharded."""
        if self._closed:
            return
        try:
            self._drain(0)
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
        if self._closed or self._pool is None:
            raise OutputError(f"tensor {key!r}: the shard writer is not open", key=key)
        try:
            return self._tensors[key]
        except KeyError:
            self.layout.placement(key)  # raises the message
            raise

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
        if self.out.fsync and length >= _ASYNC_HASH_MIN:
            _sync_file_range_write(fd, offset, length)

    def _drain(self, keep: int) -> None:
        while len(self._pending) > keep:
            self._pending.popleft().result()

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
        for pool in (self._pool, self._copy_pool):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()
        for fd in (*self._fds.values(), *self._src_fds.values()):
            os.close(fd)
        self._fds.clear()
        self._src_fds.clear()
        if self._old_sigxfsz is not None:
            signal.signal(signal.SIGXFSZ, self._old_sigxfsz)
            self._old_sigxfsz = None
