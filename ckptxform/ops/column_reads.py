"""A band of columns of a row-major tensor read as one buffer: the run of each row, one after
another. For ops whose source stores the transpose of their output (AWQ and GPTQ store
``[in, out]``): a band of output rows is a band of the source's columns, so each source byte
is read once, by the band that needs it.

A local file range is read with one ``preadv`` per group of rows: the wanted runs and the
gaps between them (into one scratch buffer) are the iovecs of one contiguous read, so a
thousand rows cost one system call, not a thousand. Where the gaps are much longer than
the runs, a ``pread`` a run copies less."""

from __future__ import annotations

import os

from .base import InputTensor

#: iovecs per preadv (Linux's IOV_MAX is 1024): a run and a gap each
_IOVECS = 1024
#: read the gaps too while they are at most this many times the runs
_GAP_RATIO = 8


def read_columns(source: InputTensor, *, rows: int, row_bytes: int, start: int, length: int) -> bytearray:
    """Bytes ``start .. start + length`` of each of ``rows`` rows of ``row_bytes``, concatenated."""
    buf = bytearray(rows * length)
    if not buf:
        return buf
    if length == row_bytes:
        buf[:] = source.read(0, rows * row_bytes)
        return buf
    if source.local is None:
        for r in range(rows):
            buf[r * length:(r + 1) * length] = source.read(r * row_bytes + start, length)
        return buf
    path, offset = source.local
    fd = os.open(path, os.O_RDONLY)
    try:
        if not _pread_runs(fd, memoryview(buf), offset + start, rows, row_bytes, length):
            raise OSError(f"{path}: the file ends inside a tensor (truncated?)")
    finally:
        os.close(fd)
    return buf


def _pread_runs(fd: int, view: memoryview, first: int, rows: int, stride: int, length: int) -> bool:
    """Whether every run was read whole."""
    gap = stride - length
    if gap > _GAP_RATIO * length:
        return _runs_one_by_one(fd, view, first, range(rows), stride, length)
    junk = memoryview(bytearray(gap))
    per_call = _IOVECS // 2
    for r0 in range(0, rows, per_call):
        r1 = min(r0 + per_call, rows)
        iovecs: list[memoryview] = []
        for r in range(r0, r1):
            iovecs.append(view[r * length:(r + 1) * length])
            if r + 1 < r1:
                iovecs.append(junk)
        want = (r1 - r0) * stride - gap
        got = os.preadv(fd, iovecs, first + r0 * stride)
        # a short read (a signal, the end of the file): these rows again, a run at a time
        if got < want and not _runs_one_by_one(fd, view, first, range(r0, r1), stride, length):
            return False
    return True


def _runs_one_by_one(fd: int, view: memoryview, first: int, rows: range, stride: int, length: int) -> bool:
    from ..fileio import read_into

    return all(read_into(fd, view[r * length:(r + 1) * length], first + r * stride) == length for r in rows)
