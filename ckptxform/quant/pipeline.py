"""Several blocks in flight: block kernels run on a few worker threads (torch and numpy
release the GIL), their outputs come back in order (``in_order``, the reads on the caller's
thread) or are handed, in order, to a function on the thread that made each
(``then_in_order``, each worker reading its own blocks).

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
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

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
        tasks = _taken_once([first, second], tasks)
        del first, second  # else the first two blocks' bytes live to the end
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptxform-dequant") as pool:
            pending: deque[Future[_T]] = deque()
            for task in tasks:
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
    core's cache and needs no other thread, while the other workers decode. Each worker,
    the caller's thread among them, takes its next task itself (advancing the iterable, its
    reads, one thread at a time), so no thread hands blocks to another and at most
    ``workers`` tasks are read and not yet done with. The first error, of a read, a task or
    ``then``, stops the rest (no ``then`` after it) and is raised here."""
    threads = _OneTorchThread()
    try:
        tasks = iter(tasks)
        first = next(tasks, None)
        second = next(tasks, None) if first is not None else None
        if second is None:  # one block: here, no thread (as in ``in_order``)
            if first is not None:
                then(threads.run(first))
            return
        tasks = _taken_once([first, second], tasks)
        del first, second  # else the first two blocks' bytes live to the end
        _Pull(tasks, then, threads).run(workers)
    finally:
        threads.restore()


def _taken_once(head: list[_T], rest: Iterator[_T]) -> Iterator[_T]:
    """``head``'s items, then ``rest``'s, holding none once it is taken (``chain`` keeps
    ``head`` to its end)."""
    while head:
        yield head.pop(0)
    yield from rest


class _Pull(Generic[_T]):
    """``then_in_order``'s workers: each takes the next task (under a lock), runs it, waits
    for its turn and runs ``then``, until the tasks end or one of them fails. A thread that
    read the blocks and handed them to a pool slept and woke ~6 times a block (the GIL, the
    pool's queue, each result): 7,200 of the 24,000 context switches of an apply of 1 GB of
    FP8. Here a block's only hand-over is its turn."""

    def __init__(self, tasks: Iterator[Callable[[], _T]], then: Callable[[_T], object],
                 threads: _OneTorchThread) -> None:
        self._tasks, self._then, self._threads = tasks, then, threads
        self._taking = threading.Lock()
        self._taken = 0
        self._turns = _Turns()
        self._errors: list[tuple[int, BaseException]] = []

    def run(self, workers: int) -> None:
        """Work on this thread and ``workers - 1`` others; raise the first task's error, if any."""
        helpers = [threading.Thread(target=self._work, name=f"ckptxform-block-{i}", daemon=True)
                   for i in range(1, workers)]
        for helper in helpers:
            helper.start()
        try:
            self._work()
        except BaseException:  # here, not in a task (an interrupt): the helpers stop too
            self._turns.fail()
            raise
        finally:
            for helper in helpers:
                helper.join()
        if self._errors:
            raise min(self._errors, key=lambda e: e[0])[1]

    def _work(self) -> None:
        while not self._turns.failed:
            with self._taking:
                number = self._taken
                try:
                    task = next(self._tasks, None)
                except BaseException as err:  # a read
                    self._fail(number, err)
                    return
                if task is None:
                    return
                self._taken += 1
            try:
                result = self._threads.run(task)
                del task  # its bytes read: a worker holds one block's at a time
                if not self._turns.wait(number):
                    return
                self._then(result)
                del result  # before the next read
                self._turns.advance()
            except BaseException as err:
                self._fail(number, err)
                return

    def _fail(self, number: int, err: BaseException) -> None:
        self._errors.append((number, err))  # list.append is atomic
        self._turns.fail()


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
