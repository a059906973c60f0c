"""The output directory: written under a temporary sibling of OUT, renamed into place.

The result appears whole or not at all; a lock file keeps two runs off the same OUT, and
temporary siblings left by killed runs are removed by the next run. Nothing ckptxform did
not write is ever removed: OUT may not overlap what the run reads (``refuse_overlap``), and
``force`` replaces only an earlier output of ckptxform (``audit.not_an_earlier_output``).

What ckptxform keeps beside OUT is exactly ``.NAME.ckptxform-lock``,
``.NAME.ckptxform-tmp-PID`` and ``.NAME.ckptxform-old-PID.HEX``; other names under the
``.NAME.ckptxform-`` prefix (a resumable job directory, say) are never treated as stale.

Example::

    with OutputDir(Path("out"), force=False) as out:
        ...                      # write files into out.tmp_path
        out.commit()             # fsync, then rename to "out"
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
import signal
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import TracebackType

from ckptxform.engine.output.audit import not_an_earlier_output
from ckptxform.errors import OutputError, UsageError, io_error
from ckptxform.log import logger

#: the signals a user or a supervisor stops a run with; held back while OUT is swapped
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


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


def refuse_overlap(out: Path | str, inputs: Iterable[tuple[str, Path]]) -> None:
    """Refuse an ``out`` that is, contains or lies inside one of ``inputs`` ((what, resolved
    path) pairs): writing there could overwrite, and with --force delete, what the run reads.
    Paths are compared resolved, so a link is where it leads."""
    real = Path(os.path.abspath(out)).resolve()
    for what, path in inputs:
        if real == path:
            relation = "is"
        elif real in path.parents:
            relation = "contains"
        elif path in real.parents:
            relation = "lies inside"
        else:
            continue
        raise OutputError(f"refusing to write to {str(out)!r}: it {relation} {what} ({str(path)!r}); "
                          "choose an --out outside every input", path=str(out))


def refuse_foreign(out: Path) -> None:
    """Refuse an existing ``out`` that is not purely an earlier output of ckptxform, with or
    without --force: replacing it would delete what ckptxform did not write."""
    foreign = not_an_earlier_output(out)
    if foreign is not None:
        raise OutputError(f"{str(out)!r} already exists and {foreign}; ckptxform replaces only its own "
                          "earlier outputs (with --force): move it away or choose another --out", path=str(out))


@contextlib.contextmanager
def _stop_signals_held() -> Iterator[None]:
    """Hold SIGINT/SIGTERM back until the block is done and act on them after it, so that
    a stopped run never leaves OUT moved aside and not yet replaced, nor half a temporary
    output. Python runs signal handlers in the main thread only, so that is where they are
    swapped (elsewhere the block runs unguarded)."""
    previous = {signum: signal.getsignal(signum) for signum in _STOP_SIGNALS}
    if threading.current_thread() is not threading.main_thread() or None in previous.values():
        yield
        return
    caught: list[signal.Signals] = []
    for signum in _STOP_SIGNALS:
        signal.signal(signum, lambda number, _frame: caught.append(signal.Signals(number)))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if caught:
            handler = previous[caught[0]]
            if callable(handler):
                handler(caught[0], None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(caught[0])


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
            raise io_error("creating", self.out.parent, err) from None
        try:
            self._lock()
            if os.path.lexists(self.out):
                self._check_replaceable()
            self.stale_removed = tuple(self._remove_stale())
            self.tmp_path.mkdir()
        except BaseException:  # a stop signal may land after the mkdir: remove tmp_path too
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        with _stop_signals_held():  # a second Ctrl-C must not leave half of tmp_path behind
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
            raise io_error("flushing", self.out, err) from None
        if os.path.lexists(self.out):
            self._check_replaceable()
            aside = self.out.with_name(f".{self.out.name}.ckptxform-old-{os.getpid()}.{secrets.token_hex(4)}")
            with _stop_signals_held():  # through the removal of the old content: nothing left aside
                self._swap(aside)
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
                raise io_error("renaming the new output to", self.out, err) from None
            self.committed = True
            self._fsync_parent()
        return self.out

    def _swap(self, aside: Path) -> None:
        """Move the existing OUT to ``aside`` and the new output into its place."""
        try:
            os.rename(self.out, aside)
        except OSError as err:
            raise io_error("moving aside the existing", self.out, err) from None
        try:
            os.rename(self.tmp_path, self.out)
        except OSError as err:
            try:
                os.rename(aside, self.out)  # put the user's output back
            except OSError:
                raise OutputError(f"replacing {str(self.out)!r} failed ({err.strerror}); its "
                                  f"previous content is in {str(aside)!r}: rename it back",
                                  path=str(self.out)) from None
            raise io_error("renaming the new output to", self.out, err) from None
        self.committed = True

    def write_error(self, name: str, err: OSError) -> OutputError:
        """The one-line message for a failed write of ``name`` in OUT (e.g. the audit log)."""
        return io_error("writing", self.out / name, err)

    def remove_stale(self, also: tuple[Path, ...] = ()) -> tuple[Path, ...]:
        """Without writing OUT, remove what killed runs left beside it (temporary siblings,
        the lock file, and the ``also`` paths: the job directory of OUT's own plan, whose
        shards OUT already holds), for a rerun that finds OUT up to date. Leaves everything alone
        while another run holds the lock, or where no lock can be taken (a read-only
        directory): nothing is written there, so nothing is left behind either."""
        prefix = f".{self.out.name}.ckptxform-"
        try:
            try:
                if not any(entry.name.startswith(prefix) for entry in self.out.parent.iterdir()):
                    return ()
                self._lock()
            except (OSError, OutputError) as err:
                logger.debug("not tidying beside {}: {}", self.out, err)
                return ()
            removed = self._remove_stale()
            for path in also:
                if os.path.lexists(path):
                    try:
                        _remove(path)
                    except OSError as err:
                        raise io_error("removing the finished job", path, err) from None
                    logger.info("removed {}: a killed run's finished shards, which {} already holds", path, self.out)
                    removed.append(path)
            return tuple(removed)
        except OutputError as err:  # OUT is fine; what is left beside it does not fail the run
            logger.warning("{}", err)
            return ()
        finally:
            self._unlock()

    def _check_replaceable(self) -> None:
        refuse_foreign(self.out)
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
                raise io_error("removing the stale temporary output", entry, err) from None
            logger.info("removed {} left by a killed ckptxform run (pid {})", entry, pid)
            removed.append(entry)
        return removed

    def _lock(self) -> None:
        # A stop signal waits until the lock is taken and recorded, so _unlock removes it.
        with _stop_signals_held():
            self._take_lock()

    def _take_lock(self) -> None:
        # Loop because the holder unlinks the lock file on exit: the file we locked must
        # still be the one at lock_path, or a third run could lock a fresh file alongside us.
        while True:
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as err:
                raise io_error("creating the lock file", self.lock_path, err) from None
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


