"""What a run read from the local disk, pinned when it was read and checked before the commit.

A ``FilePin`` is the identity of one file as it stood when ckptxform first opened it:
device, inode, size, modification and status-change times. Any write to the file moves
its ctime (which, unlike the mtime, no user tool can set back), and a file replaced by a
rename has another inode; so a file whose pin still matches after the run has not been
written since it was pinned. Pins serve twice: ``apply`` checks every pin just before it
commits (a source rewritten in place mid-run fails instead of yielding an output that
mixes old and new bytes), and the audit's run record keeps them so that a rerun can tell
an unchanged input from a changed one (``ckptxform.engine.output.digest``).

Example::

    pin = pin_fd(path, fd)            # when the file is opened, before reading it
    ...                               # read it
    check_unchanged([pin])            # SourceChangedError naming the file if it moved
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ckptxform.errors import SourceChangedError

__all__ = ["FilePin", "changed_error", "check_unchanged", "pin_existing", "pin_fd", "pin_path"]


@dataclass(frozen=True)
class FilePin:
    """One file as it stood when it was read. ``path`` is resolved (links followed)."""

    path: str
    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: str | Path, stat: os.stat_result) -> FilePin:
        return cls(str(Path(path).resolve()), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns,
                   stat.st_ctime_ns)

    @property
    def stamp(self) -> str:
        """The pin as the audit's run record keeps it (``files_read``)."""
        return (f"size={self.size} mtime_ns={self.mtime_ns} ctime_ns={self.ctime_ns} "
                f"inode={self.device}:{self.inode}")

    def difference(self, now: FilePin) -> str | None:
        """What moved since the pin (None: nothing), in words for an error message."""
        if (now.device, now.inode) != (self.device, self.inode):
            return "it was replaced by another file"
        if now.size != self.size:
            return f"its size went from {self.size:,} to {now.size:,} bytes"
        if (now.mtime_ns, now.ctime_ns) != (self.mtime_ns, self.ctime_ns):
            return "it was written to"
        return None


def pin_fd(path: str | Path, fd: int) -> FilePin:
    """Pin the file open as ``fd`` (take it before reading, so a later write shows)."""
    return FilePin.of(path, os.fstat(fd))


def pin_path(path: str | Path) -> FilePin:
    """Pin the file at ``path`` (links followed)."""
    return FilePin.of(path, os.stat(path))


def pin_existing(path: str | Path) -> FilePin | None:
    """Pin ``path`` if it can be stat'ed (None otherwise: its reader then says why)."""
    try:
        return pin_path(path)
    except OSError:
        return None


def check_unchanged(pins: Iterable[FilePin]) -> None:
    """Raise ``SourceChangedError`` naming the first pinned file that changed since."""
    for pin in pins:
        try:
            moved = pin.difference(pin_path(pin.path))
        except FileNotFoundError:
            moved = "it was deleted"
        except OSError as err:
            moved = f"it can no longer be read: {err.strerror or err}"
        if moved is not None:
            raise changed_error(pin.path, moved)


def changed_error(path: str, moved: str) -> SourceChangedError:
    return SourceChangedError(
        f"{path!r} changed while ckptxform was reading it ({moved}); no output was written; "
        "rerun once nothing writes to it", path=path)
