"""The bytes Hub sources fetch while a run writes its shards, as they arrive: what the run's
one progress bar counts besides the bytes it writes.

A run installs a listener with ``reporting`` for as long as it writes; a fetch announces
its bytes (``expect``: a batch of ranges, a download's size) and counts them as they land
(``arrived``: a range body chunk by chunk; a download as its connection reads it, through
``ByteCounter``, the stand-in for tqdm every ``hf_hub_download`` of ckptxform is given, so
that huggingface_hub draws no bar of its own). Outside ``reporting`` both are no-ops.
While it reports, huggingface_hub's own log lines below ERROR are held back (its download
retries and resumes, which ckptxform's retries say again in one line), and its logger's
level is given back after.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

#: ``(bytes expected, bytes arrived)``, each a change since the last call
Listener = Callable[[int, int], None]

_lock = threading.Lock()
_listener: Listener | None = None


def expect(nbytes: int) -> None:
    """``nbytes`` more are about to be fetched."""
    listener = _listener
    if listener is not None and nbytes:
        listener(nbytes, 0)


def arrived(nbytes: int) -> None:
    """``nbytes`` landed (negative: bytes counted before are fetched again)."""
    listener = _listener
    if listener is not None and nbytes:
        listener(0, nbytes)


@contextmanager
def reporting(listener: Listener) -> Iterator[None]:
    """Send this process's fetches to ``listener`` until the block ends (one run at a time:
    a nested ``reporting`` replaces the outer listener until it ends)."""
    global _listener
    # huggingface_hub sets its logger up on import: a run without a Hub source leaves it be
    hub_logger = logging.getLogger("huggingface_hub") if "huggingface_hub" in sys.modules else None
    with _lock:
        previous, _listener = _listener, listener
        level = hub_logger.level if hub_logger is not None else logging.NOTSET
        if hub_logger is not None:
            hub_logger.setLevel(max(logging.ERROR, level))
    try:
        yield
    finally:
        with _lock:
            _listener = previous
            if hub_logger is not None:
                hub_logger.setLevel(level)


class ByteCounter:
    """What ``hf_hub_download`` updates instead of a tqdm bar (its ``tqdm_class``): the file's
    size is expected, nothing is drawn. huggingface_hub updates its bar once per 10 MB
    chunk, so the bytes are counted as this thread's connection reads them (``streamed``,
    from ``bounded``), and the count is made that of the body when the download ends."""

    def __init__(self, *_args: Any, total: int | None = None, initial: int = 0, **_kwargs: Any) -> None:
        self._updated = 0
        self._streamed = 0
        self._open = True
        _local.counter = self
        if total:
            expect(total - initial)

    def update(self, n: int | float | None = 1) -> None:
        self._updated += int(n or 0)

    def close(self) -> None:
        if self._open:
            self._open = False
            if getattr(_local, "counter", None) is self:
                _local.counter = None
            arrived(self._updated - self._streamed)

    def __enter__(self) -> ByteCounter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _stream(self, nbytes: int) -> None:
        self._streamed += nbytes
        arrived(nbytes)


_local = threading.local()


def streamed(nbytes: int) -> None:
    """``nbytes`` read from a connection by this thread: counted when a ``ByteCounter`` of
    this thread is downloading."""
    counter = getattr(_local, "counter", None)
    if counter is not None:
        counter._stream(nbytes)
