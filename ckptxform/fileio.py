"""Reading a file range into a buffer the caller owns: no intermediate bytes object."""

from __future__ import annotations

import os


def pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Read up to ``len(view)`` bytes of ``fd`` at ``offset`` into ``view``; the count read
    (0 at the end of the file)."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    data = os.pread(fd, len(view), offset)  # platforms without preadv
    view[:len(data)] = data
    return len(data)
