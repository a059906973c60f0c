"""Reading file ranges into buffers the caller owns (no intermediate bytes object), and
hashing file ranges through one small reused buffer."""

from __future__ import annotations

import os
from typing import Any

#: Linux moves at most this many bytes per read(2)/pread(2) call.
MAX_PREAD = 0x7FFFF000

#: bytes hashed per read: small enough to stay in the core's cache between read and hash
HASH_BLOCK = 1 << 20


def pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Read up to ``len(view)`` bytes of ``fd`` at ``offset`` into ``view``; the count read
    (0 at the end of the file)."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    data = os.pread(fd, len(view), offset)  # platforms without preadv
    view[:len(data)] = data
    return len(data)


def read_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``fd`` at ``offset``; the count read, short only at the end of the file."""
    done = 0
    while done < len(view):
        n = pread_into(fd, view[done:done + MAX_PREAD], offset + done)
        if n == 0:
            break
        done += n
    return done


def hash_range(sha: Any, fd: int, offset: int, length: int) -> int:
    """Feed ``length`` bytes of ``fd`` from ``offset`` to ``sha`` through one reused buffer;
    the count hashed, short only at the end of the file."""
    view = memoryview(bytearray(min(HASH_BLOCK, max(1, length))))
    done = 0
    while done < length:
        n = pread_into(fd, view[:min(len(view), length - done)], offset + done)
        if n == 0:
            break
        sha.update(view[:n])
        done += n
    return done
