"""Several blocks in flight: block kernels run on a few worker threads (torch and numpy
release the GIL), their outputs come back in order, and reads stay on the caller's thread.

torch's own intra-op threads are turned off meanwhile: on a machine whose cores are
shared (the writer hashes on two threads beside the copies), OpenMP's barriers made a
block 4x slower with 2 threads than with 1 (0.19 against 0.75 GB/s measured here), while
one block per worker thread scales with the cores that are free.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

__all__ = ["in_order"]

_T = TypeVar("_T")

#: worker threads; one block each, so at most this many blocks (plus one being read) in memory
WORKERS = max(1, min(2, os.cpu_count() or 1))


def in_order(tasks: Iterable[Callable[[], _T]], workers: int = WORKERS) -> Iterator[_T]:
    """The results of ``tasks`` in order, up to ``workers`` computed at once. The
    iterable is advanced (its reads done) on the caller's thread."""
    from .kernels import backend

    torch = backend().__dict__.get("torch")  # None on the numpy kernels
    threads = torch.get_num_threads() if torch else 0
    if torch:
        torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptxform-dequant") as pool:
            pending: deque[Future[_T]] = deque()
            for task in tasks:
                pending.append(pool.submit(task))
                if len(pending) > workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
    finally:
        if torch:
            torch.set_num_threads(threads)
