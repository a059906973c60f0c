"""The output: safetensors shards laid out before any byte is read, written in place.

The plan knows every output tensor's key, dtype and shape, so ``plan_layout`` fixes each
shard's header and each tensor's absolute file offset up front. ``ShardWriter`` then
creates every shard at its full size and the executor streams each tensor's bytes into
place chunk by chunk (``pwrite``), hashing as it goes, so memory stays bounded by a chunk.
``OutputDir`` makes the result appear whole or not at all: everything is written to a
temporary sibling of OUT and renamed into place by ``commit``; a lock file keeps two runs
off the same OUT.

Example::

    layout = plan_layout([OutputTensorSpec("w", "BF16", (4, 8))], max_shard_size=None)
    with OutputDir(Path("out"), force=False) as out:
        with ShardWriter(out, layout) as shards:
            shards.write("w", data)              # any number of chunks, in order
            digest = shards.finish_tensor("w")
            shards.write_json("config.json", config)
        out.commit()
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Any

from loguru import logger

from ckptxform.dtypes import DTYPE_SIZES, nbytes
from ckptxform.errors import OutputError, PlanError, UsageError, quote_keys

#: the safetensors library refuses headers larger than this
_MAX_HEADER_BYTES = 100_000_000
_DEFAULT_METADATA: Mapping[str, str] = MappingProxyType({"format": "pt"})
#: chunks at least this big are hashed on the background thread; below it the
#: hand-off costs more than it saves
_ASYNC_HASH_MIN = 1 << 20
#: chunks still being hashed when ``write`` returns: one overlaps hashing with the
#: caller reading the next chunk; more only holds memory (hashing is the slower side)
_HASH_PIPELINE_DEPTH = 1


@dataclass(frozen=True)
class OutputTensorSpec:
    """One output tensor as the plan knows it before any byte is read."""

    key: str
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.key or self.key == "__metadata__":
            raise PlanError(f"output tensor name {self.key!r} is reserved by safetensors; "
                            "rename it in the rule file", key=self.key)
        if self.dtype not in DTYPE_SIZES:
            raise PlanError(f"output tensor {self.key!r}: unknown dtype {self.dtype!r} "
                            f"(known: {', '.join(DTYPE_SIZES)})", key=self.key)
        if any(not isinstance(d, int) or d < 0 for d in self.shape):
            raise PlanError(f"output tensor {self.key!r}: invalid shape {list(self.shape)}; "
                            "dimensions must be non-negative integers", key=self.key)
        object.__setattr__(self, "shape", tuple(self.shape))

    @property
    def nbytes(self) -> int:
        return nbytes(self.dtype, self.shape)


@dataclass(frozen=True)
class TensorPlacement:
    """Where one tensor's bytes go: ``offset`` is absolute in ``file``."""

    spec: OutputTensorSpec
    file: str
    offset: int

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes


@dataclass(frozen=True)
class ShardLayout:
    """One output file: its complete header (8-byte length + padded JSON) and tensors."""

    file: str
    header: bytes
    tensors: tuple[TensorPlacement, ...]
    data_nbytes: int

    @property
    def file_nbytes(self) -> int:
        return len(self.header) + self.data_nbytes


@dataclass(frozen=True)
class OutputLayout:
    """Every output file and where each tensor lives in it. ``index_file`` is None when
    the output is a single file."""

    shards: tuple[ShardLayout, ...]
    index_file: str | None
    _placements: Mapping[str, TensorPlacement] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        table = {p.spec.key: p for shard in self.shards for p in shard.tensors}
        object.__setattr__(self, "_placements", MappingProxyType(table))

    @property
    def placements(self) -> Mapping[str, TensorPlacement]:
        """Every tensor, by key, in data order."""
        return self._placements

    def placement(self, key: str) -> TensorPlacement:
        try:
            return self._placements[key]
        except KeyError:
            raise OutputError(f"tensor {key!r} is not in the output layout "
                              f"(it has {len(self._placements)} tensors)", key=key) from None

    @property
    def total_bytes(self) -> int:
        """Tensor data bytes of all shards (the index's ``total_size``)."""
        return sum(s.data_nbytes for s in self.shards)

    @property
    def file_bytes(self) -> int:
        """Bytes of all shard files, headers included."""
        return sum(s.file_nbytes for s in self.shards)

    def index_json(self) -> dict[str, Any]:
        """The standard ``model.safetensors.index.json`` content (also valid when unsharded)."""
        weight_map = {key: self._placements[key].file for key in sorted(self._placements)}
        return {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}


def plan_layout(
    specs: Sequence[OutputTensorSpec],
    *,
    max_shard_size: int | None,
    file_name: str = "model.safetensors",
    metadata: Mapping[str, str] | None = _DEFAULT_METADATA,
) -> OutputLayout:
    """Lay out ``specs`` (kept in order) in shards of at most ``max_shard_size`` data bytes.

    A tensor larger than the limit gets a shard of its own, as huggingface does. One shard
    is named ``file_name``; several are ``model-00001-of-00003.safetensors`` and an index.

    >>> layout = plan_layout([OutputTensorSpec("a", "F32", (4,))], max_shard_size=None)
    >>> layout.shards[0].file, layout.shards[0].tensors[0].offset
    ('model.safetensors', 96)
    """
    if max_shard_size is not None and max_shard_size <= 0:
        raise UsageError(f"max_shard_size must be positive, got {max_shard_size}")
    if not file_name.endswith(".safetensors") or "/" in file_name or file_name == ".safetensors":
        raise UsageError(f"output file name {file_name!r} must be a plain name ending in "
                         "'.safetensors', e.g. 'model.safetensors'")
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str)
                                        for k, v in metadata.items()):
        raise UsageError("safetensors metadata must map strings to strings")
    seen: set[str] = set()
    for spec in specs:
        if spec.key in seen:
            raise PlanError(f"output tensor {spec.key!r} is produced twice; "
                            "make the rules give each output a distinct name", key=spec.key)
        seen.add(spec.key)

    groups = _pack(specs, max_shard_size)
    if len(groups) == 1:
        names = [file_name]
        index_file = None
    else:
        stem = file_name.removesuffix(".safetensors")
        names = [f"{stem}-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)]
        index_file = f"{file_name}.index.json"
    shards = tuple(_shard(name, group, metadata) for name, group in zip(names, groups, strict=True))
    return OutputLayout(shards=shards, index_file=index_file)


def _pack(specs: Sequence[OutputTensorSpec], limit: int | None) -> list[list[OutputTensorSpec]]:
    """Greedy, order-keeping packing; always at least one (possibly empty) group. A tensor
    over the limit lands alone: it starts a group, and the group is then over the limit."""
    groups: list[list[OutputTensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if limit is not None and groups[-1] and size + spec.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += spec.nbytes
    return groups


def _shard(name: str, group: list[OutputTensorSpec], metadata: Mapping[str, str] | None) -> ShardLayout:
    # JSON keys follow data order (the safetensors library sorts by alignment instead;
    # readers do not care, and data order keeps the file in the plan's order).
    header: dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    start = 0
    for spec in group:
        header[spec.key] = {"dtype": spec.dtype, "shape": list(spec.shape),
                            "data_offsets": [start, start + spec.nbytes]}
        start += spec.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # pad like the library so data starts 8-aligned
    if len(text) > _MAX_HEADER_BYTES:
        raise PlanError(f"the header of {name!r} would be {len(text)} bytes, more than "
                        f"safetensors reads ({_MAX_HEADER_BYTES}); set a smaller max_shard_size")
    blob = len(text).to_bytes(8, "little") + text
    placements, offset = [], len(blob)
    for spec in group:
        placements.append(TensorPlacement(spec=spec, file=name, offset=offset))
        offset += spec.nbytes
    return ShardLayout(file=name, header=blob, tensors=tuple(placements), data_nbytes=start)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _fsync_path(path: Path, *, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _io_error(action: str, path: Path | str, err: OSError) -> OutputError:
    """The one-line message for a failed write, with the fix that fits the errno."""
    fixes = {
        errno.ENOSPC: "free space or choose another --out",
        errno.EDQUOT: "free space within your quota or choose another --out",
        errno.EFBIG: "raise the file size limit (ulimit -f) or set a smaller output.max_shard_size",
        errno.EACCES: "check the permissions of the output directory or choose another --out",
        errno.EROFS: "choose an --out on a writable filesystem",
    }
    reason = err.strerror or str(err)
    fix = fixes.get(err.errno or 0, "check the output directory or choose another --out")
    return OutputError(f"{action} {str(path)!r} failed: {reason}; {fix}", path=str(path))


class OutputDir:
    """The output directory, written under a temporary sibling and renamed into place.

    ``__enter__`` takes the lock ``.NAME.ckptxform-lock``, refuses an existing OUT unless
    ``force``, removes temporary siblings left by killed runs (``stale_removed``) and
    creates ``tmp_path``. ``commit`` fsyncs and renames; leaving without ``commit``
    removes ``tmp_path``, so a failed run leaves OUT as it was.
    """

    def __init__(self, out: Path | str, *, force: bool = False, fsync: bool = True) -> None:
        self.out = Path(os.path.abspath(out))  # abspath, not resolve: a symlink OUT is the entry
        self.force = force
        #: flush to disk before the rename, so that OUT survives a power loss whole, not
        #: only a killed process (which the rename alone covers)
        self.fsync = fsync
        name = self.out.name
        if not name or name in (".", ".."):
            raise UsageError(f"--out {str(out)!r} must name a directory to create")
        self.tmp_path = self.out.with_name(f".{name}.ckptxform-tmp-{os.getpid()}")
        self.lock_path = self.out.with_name(f".{name}.ckptxform-lock")
        self.stale_removed: tuple[Path, ...] = ()
        self.committed = False
        self._lock_fd: int | None = None

    def __enter__(self) -> OutputDir:
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise _io_error("creating", self.out.parent, err) from None
        self._lock()
        try:
            if os.path.lexists(self.out):
                self._check_replaceable()
            self.stale_removed = tuple(self._remove_stale())
            self.tmp_path.mkdir()
        except BaseException:
            self._unlock()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if not self.committed and os.path.lexists(self.tmp_path):
                try:
                    shutil.rmtree(self.tmp_path)
                except OSError as err:
                    logger.warning("could not remove the temporary output {}: {}", self.tmp_path, err)
        finally:
            self._unlock()

    def commit(self) -> Path:
        """Flush every file to disk and rename the temporary directory to OUT."""
        if self.committed:
            return self.out
        try:
            for root, _dirs, files in os.walk(self.tmp_path) if self.fsync else ():
                for name in files:
                    _fsync_path(Path(root, name))
                _fsync_path(Path(root), directory=True)
        except OSError as err:
            raise _io_error("flushing", self.out, err) from None
        if os.path.lexists(self.out):
            self._check_replaceable()
            aside = self.out.with_name(f".{self.out.name}.ckptxform-old-{os.getpid()}.{secrets.token_hex(4)}")
            try:
                os.rename(self.out, aside)
            except OSError as err:
                raise _io_error("moving aside the existing", self.out, err) from None
            try:
                os.rename(self.tmp_path, self.out)
            except OSError as err:
                try:
                    os.rename(aside, self.out)  # put the user's output back
                except OSError:
                    raise OutputError(f"replacing {str(self.out)!r} failed ({err.strerror}); its "
                                      f"previous content is in {str(aside)!r}: rename it back",
                                      path=str(self.out)) from None
                raise _io_error("renaming the new output to", self.out, err) from None
            self.committed = True
            self._fsync_parent()
            try:
                _remove(aside)
            except OSError as err:
                logger.warning("replaced {} but could not delete its old content at {}: {}",
                               self.out, aside, err)
        else:
            try:
                os.rename(self.tmp_path, self.out)
            except OSError as err:
                raise _io_error("renaming the new output to", self.out, err) from None
            self.committed = True
            self._fsync_parent()
        return self.out

    def write_error(self, name: str, err: OSError) -> OutputError:
        """The one-line message for a failed write of ``name`` in OUT (e.g. the audit log)."""
        return _io_error("writing", self.out / name, err)

    def remove_stale(self) -> tuple[Path, ...]:
        """Without writing OUT, remove what killed runs left beside it (temporary siblings
        and the lock file), for a rerun that finds OUT up to date. Leaves everything alone
        while another run holds the lock, or where no lock can be taken (a read-only
        directory): nothing is written there, so nothing is left behind either."""
        prefix = f".{self.out.name}.ckptxform-"
        try:
            if not any(entry.name.startswith(prefix) for entry in self.out.parent.iterdir()):
                return ()
            self._lock()
        except (OSError, OutputError) as err:
            logger.debug("not tidying beside {}: {}", self.out, err)
            return ()
        try:
            return tuple(self._remove_stale())
        except OutputError as err:  # OUT is fine; what is left beside it does not fail the run
            logger.warning("{}", err)
            return ()
        finally:
            self._unlock()

    def _check_replaceable(self) -> None:
        if not self.force:
            raise OutputError(f"{str(self.out)!r} already exists; pass --force to replace it",
                              path=str(self.out))
        try:
            cwd = Path.cwd()
        except OSError:  # the working directory was deleted: nothing to protect
            return
        if self.out == cwd or self.out in cwd.parents:
            raise OutputError(f"refusing to replace {str(self.out)!r}: it contains the current "
                              "directory; choose another --out", path=str(self.out))

    def _fsync_parent(self) -> None:
        try:
            _fsync_path(self.out.parent, directory=True)
        except OSError as err:  # the rename is done; durability of the entry is best effort
            logger.warning("could not flush directory {}: {}", self.out.parent, err)

    def _remove_stale(self) -> list[Path]:
        """Remove siblings of OUT left by killed runs; called with the lock held.

        ``-tmp-PID`` is stale when PID is dead, or is ours (a killed run in a container
        that reused our pid). ``-old-PID`` (an OUT being replaced) is removed only when
        OUT exists, i.e. the replacement completed; otherwise it may be the user's only copy.
        """
        pattern = re.compile(re.escape(f".{self.out.name}.ckptxform-") + r"(tmp|old)-(\d+)(\.[0-9a-f]+)?")
        removed: list[Path] = []
        for entry in sorted(self.out.parent.iterdir()):
            match = pattern.fullmatch(entry.name)
            if not match:
                continue
            kind, pid = match.group(1), int(match.group(2))
            if pid != os.getpid() and _pid_alive(pid):
                logger.warning("leaving {}: process {} that may be writing it is alive", entry, pid)
                continue
            if kind == "old" and not os.path.lexists(self.out):
                logger.warning("{} holds a previous output of {} whose replacement was "
                               "interrupted; rename it back or delete it", entry, self.out)
                continue
            try:
                _remove(entry)
            except OSError as err:
                raise _io_error("removing the stale temporary output", entry, err) from None
            logger.info("removed {} left by a killed ckptxform run (pid {})", entry, pid)
            removed.append(entry)
        return removed

    def _lock(self) -> None:
        # Loop because the holder unlinks the lock file on exit: the file we locked must
        # still be the one at lock_path, or a third run could lock a fresh file alongside us.
        while True:
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as err:
                raise _io_error("creating the lock file", self.lock_path, err) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise OutputError(f"another ckptxform apply is writing to {str(self.out)!r} "
                                  f"(lock held by pid {holder}); wait for it or choose another --out",
                                  path=str(self.out)) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.lock_path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.lock_path)  # while still holding it, see _lock
        os.close(self._lock_fd)
        self._lock_fd = None


_HASH_BLOCK = 8 << 20
_hash_buffers = threading.local()


def _hash_range(sha: Any, fd: int, offset: int, length: int) -> None:
    """Feed ``length`` bytes of ``fd`` from ``offset`` to ``sha`` through one reused buffer."""
    buf = getattr(_hash_buffers, "buf", None)
    if buf is None:
        buf = _hash_buffers.buf = bytearray(_HASH_BLOCK)
    view = memoryview(buf)
    while length:
        n = os.preadv(fd, [view[: min(length, _HASH_BLOCK)]], offset)
        if n <= 0:
            raise OSError(errno.EIO, "source file ended before the tensor did (was it truncated?)")
        sha.update(view[:n])
        offset += n
        length -= n


def _copy_range(src: int, src_offset: int, dst: int, dst_offset: int, length: int) -> None:
    """Copy bytes between files in the kernel; plain reads and writes where it cannot."""
    while length:
        try:
            n = os.copy_file_range(src, dst, length, src_offset, dst_offset)
        except OSError as err:
            if err.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            n = 0
        if n == 0:  # not supported here (or EOF): copy the rest through a buffer
            block = os.pread(src, min(length, _HASH_BLOCK), src_offset)
            if not block:
                raise OSError(errno.EIO, "source file ended before the tensor did (was it truncated?)")
            n = os.pwrite(dst, block, dst_offset)
        src_offset += n
        dst_offset += n
        length -= n


class _TensorState:
    __slots__ = ("placement", "written", "sha", "finished", "digest", "copy_hashes")

    def __init__(self, placement: TensorPlacement) -> None:
        self.placement = placement
        self.written = 0
        self.sha = hashlib.sha256()
        self.finished = False
        self.digest = ""
        #: hashes of ranges copied in the kernel (copy_from), on their own thread
        self.copy_hashes: list[Future[None]] = []


class ShardWriter:
    """Creates the shard files of ``layout`` in ``out.tmp_path`` and streams tensors into them.

    ``write`` places the next chunk of a tensor at its offset; ``finish_tensor`` checks the
    byte count and returns the sha256; ``close`` checks every tensor was finished and writes
    the index. Large chunks are hashed on a background thread while the caller reads the
    next chunk (hashlib releases the GIL); immutable chunks (``bytes``) are not copied.
    """

    def __init__(self, out: OutputDir, layout: OutputLayout) -> None:
        self.out = out
        self.layout = layout
        self._tensors = {key: _TensorState(p) for key, p in layout.placements.items()}
        self._fds: dict[str, int] = {}
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
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptxform-sha256")
            self._copy_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptxform-sha256-copy")
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
        """Write the next ``len(chunk)`` bytes of tensor ``key``."""
        view = memoryview(chunk).cast("B")
        size = view.nbytes
        # Bookkeeping under the lock (two threads may write different tensors); the
        # write itself outside it.
        with self._lock:
            state = self._state(key)
            place = state.placement
            if state.written + size > place.nbytes:
                raise OutputError(f"tensor {key!r}: got {state.written + size} bytes, expected "
                                  f"{place.nbytes} ({place.spec.dtype} {list(place.spec.shape)})", key=key)
            if size >= _ASYNC_HASH_MIN:
                assert self._pool is not None
                self._pending.append(self._pool.submit(state.sha.update, view))
            else:
                self._drain(0)  # chunks of one tensor must be hashed in order
                state.sha.update(view)
            offset = place.offset + state.written
            state.written += size
            self.bytes_written += size
        try:
            self._pwrite_all(self._fds[place.file], view, offset)
        except OSError as err:
            raise self._error(place.file, err) from None
        # a writable buffer may be refilled by the caller as soon as we return
        with self._lock:
            self._drain(_HASH_PIPELINE_DEPTH if view.readonly else 0)

    def copy_from(self, key: str, src_fd: int, src_offset: int, length: int) -> None:
        """Write the next ``length`` bytes of tensor ``key`` by copying them from ``src_fd``
        at ``src_offset`` inside the kernel (``copy_file_range``: no trip through Python
        memory, as ``cp`` does). The same range is hashed from the source's page cache on
        the hash thread meanwhile."""
        with self._lock:
            state = self._state(key)
            place = state.placement
            if state.written + length > place.nbytes:
                raise OutputError(f"tensor {key!r}: got {state.written + length} bytes, expected "
                                  f"{place.nbytes} ({place.spec.dtype} {list(place.spec.shape)})", key=key)
            assert self._copy_pool is not None
            # a pool of its own, so that streamed writes never queue behind these long jobs
            state.copy_hashes.append(self._copy_pool.submit(_hash_range, state.sha, src_fd, src_offset, length))
            dst_fd, dst_offset = self._fds[place.file], place.offset + state.written
            state.written += length
            self.bytes_written += length
        try:
            _copy_range(src_fd, src_offset, dst_fd, dst_offset, length)
        except OSError as err:
            raise self._error(place.file, err) from None

    def finish_tensor(self, key: str) -> str:
        """Check that all of tensor ``key`` was written; return its sha256 (hex)."""
        with self._lock:
            state = self._state(key)
            place = state.placement
            if state.written != place.nbytes:
                raise OutputError(f"tensor {key!r}: wrote {state.written} bytes, expected "
                                  f"{place.nbytes} ({place.spec.dtype} {list(place.spec.shape)})", key=key)
            self._drain(0)
            for job in state.copy_hashes:
                job.result()
            state.finished = True
            state.digest = state.sha.hexdigest()
            return state.digest

    def write_json(self, name: str, obj: Any) -> Path:
        """Write ``obj`` as ``name`` (e.g. ``config.json``) next to the shards."""
        reserved = {s.file for s in self.layout.shards} | {self.layout.index_file}
        if not name or "/" in name or name in (".", "..") or name in reserved:
            raise UsageError(f"cannot write {name!r} into the output: use a plain file name "
                             "other than the weight files")
        path = self.out.tmp_path / name
        try:
            path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        except OSError as err:
            raise self._error(name, err) from None
        return path

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
                                  "executor, please report it", key=sorted(unfinished)[0])
            if self.layout.index_file is not None:
                index = json.dumps(self.layout.index_json(), indent=2) + "\n"
                try:
                    (self.out.tmp_path / self.layout.index_file).write_text(index, encoding="utf-8")
                except OSError as err:
                    raise self._error(self.layout.index_file, err) from None
        finally:
            self._release()

    def digest(self, key: str) -> str:
        """The sha256 returned by ``finish_tensor(key)``."""
        state = self._state(key)
        if not state.finished:
            raise OutputError(f"tensor {key!r} is not finished yet", key=key)
        return state.digest

    def _state(self, key: str) -> _TensorState:
        if self._closed or self._pool is None:
            raise OutputError(f"tensor {key!r}: the shard writer is not open", key=key)
        try:
            return self._tensors[key]
        except KeyError:
            self.layout.placement(key)  # raises the message
            raise

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
        return _io_error("writing", self.out.out / file, err)

    def _release(self) -> None:
        self._closed = True
        for pool in (self._pool, self._copy_pool):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._old_sigxfsz is not None:
            signal.signal(signal.SIGXFSZ, self._old_sigxfsz)
            self._old_sigxfsz = None
