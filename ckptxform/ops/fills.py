"""The fills that make values for rows a tensor lacks: the ``mean`` of some rows (summed in
float64, on numpy: no torch needed) and seeded ``normal`` values (torch's generator, so
the values are torch's: the one fill that needs the torch extra). ``resize_rows`` and the
vocabulary permutation's ``missing_rows`` both use them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .decode import cast_bytes, require_torch, tensor_bytes, values_of


def mean_row(chunks: Iterable[tuple[bytes | bytearray | memoryview, int]], row_shape: tuple[int, ...],
             dtype: str) -> bytes:
    """The bytes of the mean of the rows in ``chunks`` (``(raw rows, how many)`` each, rows
    of ``row_shape`` and ``dtype``), in ``dtype``; at least one row is expected."""
    import numpy as np

    total, count = np.zeros(row_shape, dtype=np.float64), 0
    for raw, rows in chunks:
        total += values_of(raw, dtype).astype(np.float64).reshape(rows, *row_shape).sum(0)
        count += rows
    mean, src = total / max(1, count), "F64"
    if dtype != "F64":  # through float32, as torch's float64 .to(dtype) rounds: twice, which
        mean, src = mean.astype(np.float32), "F32"  # differs from numpy's once at a float32 tie
    return cast_bytes(mean.tobytes(), src, dtype)


class NormalRows:
    """Rows of normal values times ``std`` (drawn in float32, then cast to ``dtype``), from a
    generator seeded once: consecutive calls continue one stream."""

    def __init__(self, seed: int, std: float, row_shape: tuple[int, ...], dtype: str) -> None:
        self.seed, self.std, self.row_shape, self.dtype = seed, std, row_shape, dtype
        self._generator: Any = None

    def take(self, count: int) -> bytes:
        torch = require_torch("fill: normal (torch's seeded generator)")
        from ..dtypes import torch_dtype

        if self._generator is None:
            self._generator = torch.Generator().manual_seed(self.seed)
        values = torch.randn((count, *self.row_shape), generator=self._generator, dtype=torch.float32) * self.std
        return tensor_bytes(values.to(torch_dtype(self.dtype)))
