"""One progress bar over a run: the bytes its Hub sources fetch and the bytes it writes,
whichever process fetches or writes them.

The bar counts both in one total, the write total known from the plan and the fetch total
growing as each fetch is announced (before its bytes arrive, sources/hub/meter.py), so a
run that first waits on the network moves from its first fetched byte, and its ETA is
that of the bytes left, not of the writes alone. The counts of each stay readable after
the bar: ``fetched 1.2MB/4.0MB, written 0.00B/10.0MB``.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Mapping
from typing import Any


class RunProgress:
    """Bytes written as they land (``update``), each shard brought to its full size by its
    record (``finish``), and Hub bytes as they arrive (``fetched``); neither count passes
    its total, so the bar ends at 100% whatever an executor or a retry reports."""

    def __init__(self, sizes: Mapping[int, int], enabled: bool) -> None:
        self._sizes = dict(sizes)
        self._landed = dict.fromkeys(self._sizes, 0)
        self._write_total = sum(self._sizes.values())
        self._expected = 0
        self._arrived = 0
        self._fetch_shown = 0
        self._lock = threading.Lock()  # fetches arrive from many threads
        self._bar: Any = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=self._write_total, unit="B", unit_scale=True, unit_divisor=1024,
                             desc="apply", file=sys.stderr)
            self._describe()

    def update(self, index: int, nbytes: int) -> None:
        with self._lock:
            # a late report of a finished shard, or one past its size, moves nothing
            step = min(nbytes, self._sizes[index] - self._landed[index])
            if step > 0:
                self._landed[index] += step
                self._move(step)

    def finish(self, index: int) -> None:
        self.update(index, self._sizes[index] - self._landed[index])

    def fetched(self, expected: int, arrived: int) -> None:
        """``expected`` more bytes announced, ``arrived`` more landed (both changes)."""
        with self._lock:
            self._expected += expected
            self._arrived += arrived
            shown = max(0, min(self._arrived, self._expected))
            step, self._fetch_shown = shown - self._fetch_shown, shown
            if self._bar is not None and expected:
                self._bar.total = self._write_total + self._expected
            self._move(step)

    def fetches_done(self) -> None:
        """Every announced byte was fetched (the run succeeded): a worker's last fetch report
        may come after its shard's record, or a fetch may have been served another way."""
        with self._lock:
            step, self._fetch_shown = self._expected - self._fetch_shown, self._expected
            self._arrived = self._expected
            self._move(step)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def _move(self, step: int) -> None:
        if self._bar is not None and step:
            self._describe()
            self._bar.update(step)

    def _describe(self) -> None:
        from tqdm import tqdm

        def size(n: int) -> str:
            return str(tqdm.format_sizeof(n, "B", 1024))

        written = sum(self._landed.values())
        fetch = f"fetched {size(self._fetch_shown)}/{size(self._expected)}, " if self._expected else ""
        self._bar.set_postfix_str(f"{fetch}written {size(written)}/{size(self._write_total)}", refresh=False)
