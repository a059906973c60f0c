"""``ProcessPool``: shard tasks in worker processes of this machine (``--jobs N``).

Workers report the bytes they write and the Hub bytes they fetch through a queue the
parent drains between waits (one bar over all workers); a worker that dies is one OutputError naming the shards that
were unwritten, never a hang; a task's error lets the running tasks finish; Ctrl-C (or
SIGTERM) kills the workers at once, so the run ends within a wait, keeping the shards
already finished.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from ...errors import OutputError
from ...sources.hub import meter
from ..output.jobdir import ShardRecord
from .tasks import Done, Progress, ShardTask, run_shard, shard_error

#: seconds between the parent's looks at the progress queue (and at Ctrl-C)
POLL = 0.05
#: a worker reports its bytes at most this often (seconds)
REPORT_EVERY = 0.1


class ProcessPool:
    def __init__(self, jobs: int) -> None:
        self._jobs = jobs

    def run(self, tasks: Sequence[ShardTask], done: Done, progress: Progress) -> None:
        """Run ``tasks`` in the pool (see the module docstring)."""
        import multiprocessing  # here: a run in one process does not pay for importing it
        from concurrent.futures.process import BrokenProcessPool, ProcessPoolExecutor

        context = multiprocessing.get_context("spawn")  # no inherited threads, locks or sockets
        reports: Any = context.Queue()
        pool = ProcessPoolExecutor(max_workers=self._jobs, mp_context=context, initializer=_worker_started,
                                   initargs=(os.getpid(), reports))
        futures: dict[Future[ShardRecord], ShardTask] = {pool.submit(_pool_shard, t): t for t in tasks}
        pending = set(futures)
        try:
            while pending:
                finished, pending = wait(pending, timeout=POLL, return_when=FIRST_COMPLETED)
                _drain(reports, progress)
                for future in sorted(finished, key=lambda f: futures[f].index):
                    try:
                        record = future.result()
                    except BrokenProcessPool:
                        lost = sorted(t.file for f, t in futures.items() if not _succeeded(f))
                        raise OutputError(f"a worker process died (killed, or out of memory?) while {len(lost)} "
                                          f"shard(s) were unwritten: {', '.join(map(repr, lost[:8]))}; the "
                                          "finished shards are kept: rerun the same command to resume",
                                          path=str(tasks[0].job.out)) from None
                    except Exception as err:  # noqa: BLE001 - the task's own error, whatever it is
                        raise shard_error(futures[future], err)  # its context: err, with the worker's traceback
                    done(record)
            _drain(reports, progress)  # what the last task reported before its record
        except Exception:
            raise  # a task failed: the running ones finish (and are kept), the others are cancelled
        except BaseException:
            # Ctrl-C or SIGTERM: stop now. The pool has no public way to stop a running
            # task, so its processes are killed; the shards they were writing are partial.
            for process in list((getattr(pool, "_processes", None) or {}).values()):
                process.kill()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            reports.close()


def _drain(reports: Any, progress: Progress) -> None:
    while True:
        try:
            kind, first, second = reports.get_nowait()
        except queue.Empty:
            return
        if kind == _WRITTEN:
            progress(first, second)
        else:  # a worker's fetch: into this process's meter, which the run's bar listens to
            meter.expect(first)
            meter.arrived(second)


def _succeeded(future: Future[ShardRecord]) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None


#: in a worker: where it reports the bytes it writes
_REPORTS: Any = None


_WRITTEN, _FETCHED = "written", "fetched"


def _pool_shard(task: ShardTask) -> ShardRecord:
    if _REPORTS is None:
        return run_shard(task, None)
    written = _Batched(lambda n, _: _REPORTS.put((_WRITTEN, task.index, n)))
    fetched = _Batched(lambda expected, arrived: _REPORTS.put((_FETCHED, expected, arrived)))
    try:
        with meter.reporting(fetched.add):
            return run_shard(task, lambda n: written.add(n, 0))
    finally:
        fetched.flush()


class _Batched:
    """Pairs of counts summed and sent at most every ``REPORT_EVERY`` seconds (fetches come
    from many threads)."""

    def __init__(self, send: Callable[[int, int], None]) -> None:
        self._send = send
        self._pending = [0, 0]
        self._sent_at = time.monotonic()
        self._lock = threading.Lock()

    def add(self, first: int, second: int) -> None:
        with self._lock:
            self._pending[0] += first
            self._pending[1] += second
            if time.monotonic() - self._sent_at < REPORT_EVERY:
                return
        self.flush()

    def flush(self) -> None:
        with self._lock:
            pending, self._pending, self._sent_at = self._pending, [0, 0], time.monotonic()
        if pending != [0, 0]:
            self._send(*pending)


def _worker_started(parent: int, reports: Any) -> None:
    """In each worker: die with the parent (a SIGKILLed run must not leave writers behind),
    leave Ctrl-C to the parent, log errors only (the parent reports the run)."""
    global _REPORTS
    from ...log import configure_stderr

    _REPORTS = reports
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_stderr("ERROR")
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
