"""Several blocks in flight: block kernels run on a few worker threads (torch and numpy
release the GIL), their outputs come back in order (``in_order``) or are handed, in order,
to a function on the thread that made each (``then_in_order``), and reads stay on the
caller's thread.

torch's own intra-op threads are turned off meanwhile: on a machine whose cores are
shared (the writer hashes on two threads beside the copies), OpenMP's barriers made a
block 4x slower with 2 threads than with 1 (0.19 against 0.75 GB/s measured here), while
one block per worker thread scales with the cores that are free.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import chain
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["in_order", "then_in_order"]

_T = TypeVar("_T")

#: worker threads; one block each, so at most this many blocks (plus one being read) in memory
WORKERS = max(1, min(2, os.cpu_count() or 1))


def in_order(tasks: Iterable[Callable[[], _T]], workers: int = WORKERS) -> Iterator[_T]:
    """The results of ``tasks`` in order, up to ``workers`` computed at once. The
    iterable is advanced (its reads done) on the caller's thread."""
    threads = _OneTorchThread()
    try:
        tasks = iter(tasks)
        first = next(tasks, None)
        second = next(tasks, None) if first is not None else None
        if second is None:
            # one block (a small tensor, most modules of a MoE): run here; a pool made and
            # joined per tensor cost more than the kernel at Kimi-K2's 69,000 modules
            if first is not None:
                yield threads.run(first)
            return
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptxform-dequant") as pool:
            pending: deque[Future[_T]] = deque()
            for task in chain((first, second), tasks):
                pending.append(pool.submit(threads.run, task))
                if len(pending) > workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
    finally:
        threads.restore()


def then_in_order(tasks: Iterable[Callable[[], _T]], then: Callable[[_T], object], workers: int = WORKERS) -> None:
    """Run ``tasks``, up to ``workers`` at once, and ``then(result)`` of each on the thread
    that computed it, in the tasks' order (a result waits for the one before it to be done
    with): what ``then`` does with a decoded block (hash it, write it) finds it in that
    core's cache and needs no other thread, while the other workers decode. The iterable is
    advanced on the caller's thread (its reads), a task ahead of a free worker. The first
    error, of a task or of ``then``, stops the rest (no ``then`` after it) and is raised here."""
    threads = _OneTorchThread()
    turns = _Turns()
    try:
        tasks = iter(tasks)
        first = next(tasks, None)
        second = next(tasks, None) if first is not None else None
        if second is None:  # one block: here, no pool (as in ``in_order``)
            if first is not None:
                then(threads.run(first))
            return
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptxform-block") as pool:
            pending: deque[Future[None]] = deque()
            try:
                for number, task in enumerate(chain((first, second), tasks)):
                    if turns.failed:  # the failed task's error is raised below, from its future
                        break
                    pending.append(pool.submit(_run_then, threads, task, then, turns, number))
                    if len(pending) > workers:
                        pending.popleft().result()
                while pending:
                    pending.popleft().result()
            except BaseException:
                turns.fail()  # the workers waiting for their turn give up; the pool can join them
                for job in pending:
                    job.cancel()
                raise
    finally:
        threads.restore()


def _run_then(threads: _OneTorchThread, task: Callable[[], _T], then: Callable[[_T], object], turns: _Turns,
              number: int) -> None:
    try:
        result = threads.run(task)
        if turns.wait(number):
            then(result)
            turns.advance()
    except BaseException:
        turns.fail()
        raise


class _Turns:
    """Whose turn it is to run ``then``: task ``number`` waits for ``number - 1`` to be done,
    or for any task to fail (then it gives up)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._next = 0
        self._failed = False

    def wait(self, number: int) -> bool:
        """Wait for task ``number``'s turn: True, or False once a task has failed."""
        with self._changed:
            self._changed.wait_for(lambda: self._next == number or self._failed)
            return not self._failed

    @property
    def failed(self) -> bool:
        return self._failed

    def advance(self) -> None:
        with self._changed:
            self._next += 1
            self._changed.notify_all()

    def fail(self) -> None:
        with self._changed:
            self._failed = True
            self._changed.notify_all()


class _OneTorchThread:
    """Runs tasks with torch's intra-op threads set to one once torch is loaded, and puts
    them back at the end. Torch is not imported for it: the table kernels (NVFP4, MXFP4)
    never need torch, and importing it cost 1-1.8 s of an NVFP4 run of 0.5 GB here. A
    kernel that imports torch does so in its first block: the blocks after it run with one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._torch: Any = None
        self._threads = 0

    def run(self, task: Callable[[], _T]) -> _T:
        if self._torch is None and _loaded("torch"):
            with self._lock:
                if self._torch is None:
                    torch = sys.modules["torch"]
                    self._threads = torch.get_num_threads()
                    torch.set_num_threads(1)
                    self._torch = torch
        return task()

    def restore(self) -> None:
        if self._torch is not None:
            self._torch.set_num_threads(self._threads)


def _loaded(name: str) -> bool:
    """Whether module ``name`` is imported and done initializing (another thread may be
    importing it: importlib's own test of a module in sys.modules, ``spec._initializing``)."""
    module = sys.modules.get(name)
    return module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False)
