"""Several blocks in flight: block kernels run on a few worker threads (torch and numpy
release the GIL), their outputs come back in order, and reads stay on the caller's thread.

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

__all__ = ["in_order"]

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
