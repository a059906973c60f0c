"""transpose: swap two dims; a block op (elements move one by one).

The output is made in order, a block of its dim-0 indices at a time. For ``transpose(a, c)``
of a tensor viewed as ``[B, A, M, C, T]`` (B: dims before a, A = dim a, M: dims between,
C = dim c, T: dims after), output block ``c0..c1`` of a slab ``b`` is
``input[b, :, :, c0:c1, :]`` permuted. Elements are moved as unsigned integers of their
size, so no dtype is decoded (float8, int4-packed words and all). Each block is read as
``A*M`` runs (straight into a reused buffer when the input is one local file range).
Peak memory: the read tile and its transposed copy, each ``max(4 * chunk_bytes, one
output row)`` bytes (64 MiB), whatever the tensor's size.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Sequence
from math import prod
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .base import Accepts, Block, BlockOp, Context, InputTensor, Value, View

_UINT = {1: "u1", 2: "<u2", 4: "<u4", 8: "<u8"}
#: rows of a tile transposed at once (a band that fits the cache: 3x faster than one copy)
_BAND = 256
_TILE_CHUNKS = 4


class Transpose(BlockOp):
    verb = "transpose"
    description = "Swap two dims ([in, out] Conv1D -> [out, in] Linear): [D0, D1]."
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}
    accepts = Accepts(min_rank=2)

    def map(self, args: Any, ctx: Context, value: View) -> Value:
        rank = len(value.shape)
        d0, d1 = args
        if not (-rank <= d0 < rank and -rank <= d1 < rank) or d0 % max(rank, 1) == d1 % max(rank, 1):
            raise ctx.error(f"transpose {list(args)}: needs two different dims of a tensor of shape "
                            f"{list(value.shape)}")
        if value.itemsize not in _UINT:
            raise ctx.error(f"transpose: {value.dtype} elements are not whole bytes; transpose is not defined")
        a, c = sorted((d0 % rank, d1 % rank))
        shape = list(value.shape)
        shape[a], shape[c] = shape[c], shape[a]
        return Block(self, {"dims": (a, c)}, (value,), tuple(shape), value.dtype)

    def inverse(self, args: Any) -> tuple[str, Any]:
        return "transpose", args

    def describe(self, args: Any) -> str:
        return f"transpose {list(args)}"

    def blocks(self, block: Block, inputs: Sequence[InputTensor], chunk_bytes: int,
               rows: range | None = None) -> Iterator[bytes | memoryview]:
        (source,) = inputs
        shape, size = source.view.shape, source.view.itemsize
        a, c = block.args["dims"]
        before, big_a, mid = prod(shape[:a]), shape[a], prod(shape[a + 1:c])
        big_c, tail = shape[c], prod(shape[c + 1:])
        # every tile costs one read per (a, m): tiles of _TILE_CHUNKS chunks read 4x less often
        step = max(1, _TILE_CHUNKS * chunk_bytes // max(1, big_a * mid * tail * size))
        # the output's dim 0 is dim c when a == 0, else the input's dim 0 (`per` slabs each)
        per = before // shape[0] if a > 0 and shape[0] else 1
        wanted = rows if rows is not None else range(block.shape[0] if block.shape else 1)
        slabs, columns = ((range(wanted.start * per, wanted.stop * per), range(big_c)) if a > 0
                          else (range(before), wanted))
        geometry = (big_a, mid, big_c, tail, size)
        tiles = _LocalTiles(source, geometry) if source.local is not None else _ReadTiles(source, geometry)
        with tiles:
            for b in slabs:
                for c0 in range(columns.start, columns.stop, step):
                    yield tiles.tile(b, c0, min(step, columns.stop - c0))


#: the registered instance: other ops end their programs with it (the plan codec names an op
#: by its registered instance)
TRANSPOSE = Transpose()


class _ReadTiles:
    """Tiles read as one run per (a, m): for inputs that are not one local file range."""

    def __init__(self, source: InputTensor, geometry: tuple[int, int, int, int, int]) -> None:
        self.source, self.geometry = source, geometry

    def __enter__(self) -> _ReadTiles:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def tile(self, b: int, c0: int, count: int) -> memoryview:
        import numpy as np

        big_a, mid, big_c, tail, size = self.geometry
        run = count * tail * size
        base = b * big_a * mid * big_c * tail * size
        if count == big_c:  # whole rows: the tile is one range (a block op's output, decoded once)
            buf = self.source.read(base, big_a * mid * run)
        else:
            buf = bytearray(big_a * mid * run)
            for i in range(big_a * mid):
                buf[i * run:(i + 1) * run] = self.source.read(base + (i * big_c + c0) * tail * size, run)
        tile = np.frombuffer(buf, dtype=_UINT[size]).reshape(big_a, mid, count, tail)
        out = np.empty((count, mid, big_a, tail), dtype=_UINT[size])
        _transpose_bands(tile, out)
        return out.reshape(-1).view(np.uint8).data.toreadonly()  # no memoryview.cast: a tile may be empty


class _LocalTiles:
    """Tiles read straight from the local source file into one reused buffer: a pread per
    (a, m) run, no intermediate bytes, the page cache's copy only (a map would count every
    page a tile touches, a whole row's neighbourhood each, as resident)."""

    def __init__(self, source: InputTensor, geometry: tuple[int, int, int, int, int]) -> None:
        assert source.local is not None
        self.path, self.offset = source.local
        self.geometry = geometry
        self.buf = bytearray()

    def __enter__(self) -> _LocalTiles:
        self.fd = os.open(self.path, os.O_RDONLY)
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)

    def tile(self, b: int, c0: int, count: int) -> memoryview:
        """The tile, in a new buffer (read-only: the caller may still hold it when the next tile is made)."""
        import numpy as np

        from ..fileio import read_into

        big_a, mid, big_c, tail, size = self.geometry
        run = count * tail * size
        if len(self.buf) < big_a * mid * run:
            self.buf = bytearray(big_a * mid * run)
        view = memoryview(self.buf)
        first = self.offset + (b * big_a * mid * big_c + c0) * tail * size
        stride = big_c * tail * size
        fd, preadv = self.fd, os.preadv
        for i in range(big_a * mid):
            piece = view[i * run:(i + 1) * run]
            if preadv(fd, [piece], first + i * stride) < run and read_into(fd, piece, first + i * stride) < run:
                raise OSError(f"{self.path}: file ends inside the tensor being transposed")
        tile = np.frombuffer(self.buf, dtype=_UINT[size], count=big_a * mid * count * tail).reshape(
            big_a, mid, count, tail)
        out = np.empty((count, mid, big_a, tail), dtype=_UINT[size])
        _transpose_bands(tile, out)
        return out.reshape(-1).view(np.uint8).data.toreadonly()  # no memoryview.cast: a tile may be empty


def _transpose_bands(tile: Any, out: Any) -> None:
    """``out[c, m, a, t] = tile[a, m, c, t]``, a band of _BAND ``a`` at a time (the
    transposed copy stays in cache), the bands shared among a thread a core (numpy's copy
    releases the GIL; 1.5x on this vm's two busy cores)."""
    big_a = tile.shape[0]
    lanes = _pool()._max_workers
    share = -(-big_a // lanes // _BAND) * _BAND or _BAND

    def bands(lo: int) -> None:
        for a0 in range(lo, min(lo + share, big_a), _BAND):
            a1 = min(a0 + _BAND, lo + share, big_a)
            out[:, :, a0:a1, :] = tile[a0:a1].transpose(2, 1, 0, 3)

    if big_a <= _BAND:
        bands(0)
        return
    for job in [_pool().submit(bands, lo) for lo in range(0, big_a, share)]:
        job.result()


@functools.cache
def _pool() -> ThreadPoolExecutor:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return ThreadPoolExecutor(max_workers=max(1, min(cores, 8)), thread_name_prefix="ckptxform-transpose")


if hasattr(os, "register_at_fork"):  # a forked child has none of the parent's threads
    os.register_at_fork(after_in_child=_pool.cache_clear)
