"""Pause Python's cyclic garbage collector while a plan or a run builds its per-tensor
bookkeeping.

Every full pass of the collector walks every live object, and passes come more often as
the heap grows: at 200,000 tensors a third of ``plan`` was the collector walking the
plan it was building (6-9 s of 26), the part of the cost that grew faster than the
count. Planning and writing make no reference cycles per tensor (tests/test_scale_growth.py
checks this), so their garbage is freed by reference counting alone and nothing piles up
while the collector waits; it runs again when the step returns.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic collection inside the block (nested blocks are fine); the collector's
    earlier state comes back when the block ends, however it ends."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
