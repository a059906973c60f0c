"""The shape of a quantized weight's storage, one frozen dataclass per scheme: what the
kernels (both backends) and the ops' block programs agree on. Kept apart from kernels.py so
the backends can import it without importing their dispatcher."""

from __future__ import annotations

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
