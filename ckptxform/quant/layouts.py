"""The shape of a quantized weight's storage, one frozen dataclass per scheme: what the
kernels (both backends) and the ops' block programs agree on. Kept apart from kernels.py so
the backends can import it without importing their dispatcher."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Fp8Block:
    """An FP8 weight of ``cols`` columns scaled per ``block_rows x block_cols`` block."""

    cols: int
    block_rows: int
    block_cols: int

    @property
    def scale_cols(self) -> int:
        return -(-self.cols // self.block_cols)

    def scale_rows(self, rows: int) -> int:
        return -(-rows // self.block_rows)

    def band_blocks(self, elements: int) -> int:
        """Block rows a band of about ``elements`` values holds (1: part of one)."""
        return max(1, elements // max(1, self.block_rows * self.cols))

    def bands(self, rows: int, elements: int) -> Iterator[tuple[int, int, int]]:
        """(first row, rows, k) of bands of ``rows`` rows of about ``elements`` values, for
        kernels that sweep a block in cache: part of one block row (``k == 1``) where a
        block row is larger, else ``k`` whole block rows (the last band may be partial)."""
        k = self.band_blocks(elements)
        step = k * self.block_rows if k > 1 else max(1, min(self.block_rows, elements // max(1, self.cols)))
        for start in range(0, rows, self.block_rows * k):
            stop = min(start + self.block_rows * k, rows)
            for first in range(start, stop, step):
                yield first, min(step, stop - first), k


@dataclass(frozen=True)
class Int4Groups:
    """An int4 weight of ``cols`` columns packed 8 per int32 word, one scale per
    ``group_size`` columns of a row, scales of dtype ``scale_dtype`` (safetensors name)."""

    cols: int
    group_size: int
    scale_dtype: str

    @property
    def words(self) -> int:
        return -(-self.cols // 8)

    @property
    def groups(self) -> int:
        return -(-self.cols // self.group_size)

    @staticmethod
    def zero_point_rows(rows: int) -> int:
        return -(-rows // 8)


@dataclass(frozen=True)
class Fp4Groups:
    """An FP4 e2m1 weight of ``cols`` columns, two codes a byte (low nibble first), one
    float32 scale per ``group_size`` columns of a row (NVFP4: 16). ``signed_zero``: code 8
    is ``-0.0`` (False: ``+0.0``, ModelOpt's reading)."""

    cols: int
    group_size: int
    signed_zero: bool = True

    @property
    def row_bytes(self) -> int:
        return self.cols // 2

    @property
    def groups(self) -> int:
        return self.cols // self.group_size
