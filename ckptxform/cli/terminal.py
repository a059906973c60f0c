"""Standard output for the CLI: a closed or full stdout is one clean error, not a traceback.

``ckptxform plan ... | head -c1`` closes the pipe early, ``> /dev/full`` fails every
write and ``>&-`` leaves no stdout at all; each is an ``OutputStreamError`` (exit 1), and
the interpreter's final flush of the broken stream is kept quiet. The report of an
``apply`` that committed its output is the exception (``echo_done``): the work is done,
so the command exits 0 and says on stderr that the report was lost.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from ..errors import OutputStreamError


class _GuardedStream:
    """``sys.stdout`` while a command runs: each failing write or flush raises
    ``OutputStreamError``; everything else is the real stream's."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as err:
            raise stream_error(err) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as err:
            raise stream_error(err) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def stream_error(err: OSError) -> OutputStreamError:
    if err.errno == errno.EPIPE:
        return OutputStreamError("standard output was closed before all output was written (broken pipe); "
                                 "read all of it, or redirect it to a file")
    return OutputStreamError(f"cannot write to standard output: {err.strerror or err}; redirect it to a "
                             "file where there is room")


@contextmanager
def guarded_stdout() -> Iterator[None]:
    """Run a command with ``sys.stdout`` guarded; on failure, silence the broken stream."""
    real = sys.stdout
    if real is None:
        raise OutputStreamError("standard output is closed; give the command a stdout (redirect it to "
                                "/dev/null to discard what it prints)")
    sys.stdout = _GuardedStream(real)  # type: ignore[assignment]
    try:
        yield
        sys.stdout.flush()
    except OutputStreamError:
        _silence(real)
        raise
    finally:
        sys.stdout = real


def echo_done(text: str) -> str | None:
    """Print ``text``, the report of work already done (an ``apply`` that committed OUT):
    None, or, when stdout cannot take it, why (the stream is then silenced): the exit
    status says whether the work was done, so a full or closed stdout is not a failure."""
    import click

    try:
        click.echo(text)
        sys.stdout.flush()
    except OutputStreamError as err:
        _silence(getattr(sys.stdout, "_stream", sys.stdout))
        return err.message
    return None


def _silence(stream: TextIO) -> None:
    """Point the broken stream at /dev/null so that the interpreter's last flush is quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass  # not a real file (a test's capture): nothing will flush it at exit
