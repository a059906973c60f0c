"""One progress bar over every shard of a run, whichever process writes them."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any


class ShardProgress:
    """Bytes as they land (``update``), each shard brought to its full size by its record
    (``finish``), so the bar ends at 100% whatever an executor reports mid-task."""

    def __init__(self, sizes: Mapping[int, int], enabled: bool) -> None:
        self._sizes = dict(sizes)
        self._landed = dict.fromkeys(self._sizes, 0)
        self._bar: Any = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=sum(self._sizes.values()), unit="B", unit_scale=True, unit_divisor=1024,
                             desc="writing", file=sys.stderr)

    def update(self, index: int, nbytes: int) -> None:
        # a late report of a finished shard, or one past its size, moves nothing
        step = min(nbytes, self._sizes[index] - self._landed[index])
        if step > 0:
            self._landed[index] += step
            if self._bar is not None:
                self._bar.update(step)

    def finish(self, index: int) -> None:
        self.update(index, self._sizes[index] - self._landed[index])

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
