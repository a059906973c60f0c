"""Reading file ranges into buffers the caller owns (no intermediate bytes object),
hashing file ranges through one small reused buffer, and opening only regular files (a
FIFO in a file's place would block the open, a device never end)."""

from __future__ import annotations

import os
import stat
from typing import Any, BinaryIO

from .errors import FileTooLargeError, NotAFileError, quote

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


def hash_range(hasher: Any, fd: int, offset: int, length: int, block: int | None = None) -> int:
    """Feed ``length`` bytes of ``fd`` from ``offset`` to ``hasher`` through one reused buffer
    (of ``block`` bytes, HASH_BLOCK by default); the count hashed, short only at the end of the file."""
    view = memoryview(bytearray(min(block or HASH_BLOCK, max(1, length))))
    done = 0
    while done < length:
        n = pread_into(fd, view[:min(len(view), length - done)], offset + done)
        if n == 0:
            break
        hasher.update(view[:n])
        done += n
    return done


def read_small_file(path: str | os.PathLike[str], limit: int, *, what: str, pipes: bool = False) -> bytes:
    """The bytes of ``path``, a regular file (or, with ``pipes``, a pipe) of at most
    ``limit`` bytes; ``what`` names it in messages ("a config.json"). Anything else is refused before a byte is read: opening a FIFO waits
    for a writer forever, and ``/dev/zero`` never ends. OSError for an unreadable path."""
    fd = _open_file(path, pipes=pipes)
    try:
        parts: list[bytes] = []
        size = 0
        while size <= limit:
            part = os.read(fd, min(limit + 1 - size, 1 << 20))
            if not part:
                break
            parts.append(part)
            size += len(part)
    finally:
        os.close(fd)
    if size > limit:
        raise FileTooLargeError(f"{quote(os.fspath(path))}: more than {limit:,} bytes, too large for "
                                f"{what}; check that it is the right file", path=os.fspath(path), limit=limit)
    return b"".join(parts)


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """``path`` open for reading if it is a regular file (links followed); anything else is a
    ``NotAFileError`` before a byte is read."""
    return os.fdopen(_open_file(path, pipes=False), "rb")


def _open_file(path: str | os.PathLike[str], *, pipes: bool) -> int:
    """A blocking read descriptor of ``path`` if it is a regular file (or, with ``pipes``, a
    pipe); ``NotAFileError`` otherwise, before a byte is read."""
    # O_NONBLOCK: the open itself must not wait for a FIFO's writer
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISREG(mode) or (pipes and stat.S_ISFIFO(mode))):
            raise _not_a_file(path, mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def refuse_non_regular(path: str | os.PathLike[str]) -> None:
    """``NotAFileError`` when ``path`` exists and is not a regular file (links followed); a
    missing path is left to the caller, whose message says what the file was for."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        raise _not_a_file(path, mode)


def _not_a_file(path: str | os.PathLike[str], mode: int) -> NotAFileError:
    kind = _kind(mode)
    return NotAFileError(f"{quote(os.fspath(path))}: is {kind}, not a regular file; give the path of the file "
                         "itself", path=os.fspath(path), kind=kind)


def special_kind(path: str | os.PathLike[str]) -> str | None:
    """What ``path`` is when it exists but is no regular file ("a FIFO (named pipe)", "a
    directory", ...); None for a regular file or nothing at all."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    return None if stat.S_ISREG(mode) else _kind(mode)


def _kind(mode: int) -> str:
    kinds = [(stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")]
    return next((name for test, name in kinds if test(mode)), "not a file")


def is_utf8(text: str) -> bool:
    """False for a path holding bytes that are not UTF-8 (Python keeps them as lone
    surrogates, which no UTF-8 file such as the audit log can hold)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
