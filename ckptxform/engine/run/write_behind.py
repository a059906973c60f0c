"""One background thread running jobs in the order they were given, a bounded number of
chunk-holding jobs behind the caller (the shard writer's writes of fresh chunks:
engine/run/writer.py).

The first error a job raises is kept and raised again in the caller, as the same object,
by its next ``submit``, ``wait`` or ``check``; the jobs after it are dropped (not run).

Example::

    behind = WriteBehind(held=2)
    behind.submit(lambda: os.pwrite(fd, chunk, 0), holds=True)  # blocks while 2 are held
    behind.wait()                                               # all done, or the error
    behind.stop()
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class WriteBehind:
    """Runs jobs on one thread, in order; at most ``held`` jobs that ``holds`` a chunk are
    queued or running at once (``submit`` waits for one to finish): memory stays bounded."""

    def __init__(self, held: int) -> None:
        self._room = threading.Semaphore(held)
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], bool] | None] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._pending = 0
        self._error: BaseException | None = None
        self._dropping = False
        self._thread = threading.Thread(target=self._run, name="ckptxform-write", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None], *, holds: bool) -> None:
        """Queue ``job`` after the others (first waiting for room when it ``holds`` a chunk)."""
        self.check()
        if self._dropping:  # no thread would run it, and a third chunk would wait for room forever
            raise RuntimeError("the write thread has stopped: nothing more can be written")
        if holds:
            self._room.acquire()
        with self._idle:
            self._pending += 1
        self._jobs.put((job, holds))

    def check(self) -> None:
        """Raise the error a job raised, if one did."""
        if self._error is not None:
            raise self._error

    def wait(self) -> None:
        """Wait until every job given so far has run, then ``check``."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)
        self.check()

    def stop(self) -> None:
        """Drop the jobs not started yet and end the thread (after the one running)."""
        self._dropping = True
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, holds = item
            try:
                if self._error is None and not self._dropping:
                    job()
            except BaseException as err:  # raised in the caller
                self._error = err
            finally:
                del job, item  # the chunk it holds is freed before room is made for another
                if holds:
                    self._room.release()
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()
