"""A tensor saved as chunks (boxes of its global index space), read by byte range.

A chunk at ``offsets`` of ``sizes`` is contiguous in its own record; in the global
(row-major) tensor it is a run of bytes per index of the dims before the first dim it does
not span whole (one run for an FSDP dim-0 shard, one per row for a column shard). Working
in bytes (the last dim counted in bytes), a global byte range maps to ``Piece``s: which
chunk, where in its record, where in the range. The chunks must tile the tensor exactly:
an overlap or a gap is refused when the grid is made, before any byte is read.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from ckptxform.errors import CheckpointFormatError


@dataclass(frozen=True)
class Piece:
    chunk: int  # index into the grid's chunks
    at: int  # byte offset in the chunk's record
    out: int  # byte offset in the range asked for
    length: int


@dataclass(frozen=True)
class _Box:
    index: int
    offsets: tuple[int, ...]  # in bytes along the last dim
    sizes: tuple[int, ...]
    split: int  # the first dim from which on the box spans the tensor whole, less one
    run: int  # bytes of one contiguous run


class ChunkGrid:
    """The chunks of one tensor of ``shape`` (``itemsize`` bytes an element); ``names``
    says each chunk in errors (its file and offsets)."""

    def __init__(self, shape: tuple[int, ...], itemsize: int, boxes: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
                 *, label: str, names: Sequence[str]) -> None:
        _check_tiling(shape, boxes, label, names)
        self.shape = (*shape[:-1], shape[-1] * itemsize) if shape else (itemsize,)
        self._inner = [1] * len(self.shape)
        for d in range(len(self.shape) - 2, -1, -1):
            self._inner[d] = self._inner[d + 1] * self.shape[d + 1]
        self._boxes = [self._box(i, o, s, itemsize) for i, (o, s) in enumerate(boxes) if _volume(s) or not shape]

    def _box(self, index: int, offsets: tuple[int, ...], sizes: tuple[int, ...], itemsize: int) -> _Box:
        if not offsets:
            offsets, sizes = (0,), (itemsize,)
        else:
            offsets = (*offsets[:-1], offsets[-1] * itemsize)
            sizes = (*sizes[:-1], sizes[-1] * itemsize)
        split = len(sizes) - 1
        while split > 0 and sizes[split] == self.shape[split]:
            split -= 1
        return _Box(index, offsets, sizes, split, sizes[split] * self._inner[split])

    def pieces(self, start: int, length: int) -> list[Piece]:
        """The pieces of global bytes ``[start, start + length)``, in order."""
        end = start + length
        found: list[Piece] = []
        for box in self._boxes:
            found += self._box_pieces(box, start, end)
        found.sort(key=lambda p: p.out)
        merged: list[Piece] = []
        for piece in found:
            last = merged[-1] if merged else None
            if last and last.chunk == piece.chunk and last.at + last.length == piece.at \
                    and last.out + last.length == piece.out:
                merged[-1] = Piece(last.chunk, last.at, last.out, last.length + piece.length)
            else:
                merged.append(piece)
        return merged

    def _box_pieces(self, box: _Box, start: int, end: int) -> list[Piece]:
        k, inner = box.split, self._inner
        lead = box.offsets[k] * inner[k]
        if k == 0:
            return _clip(box.index, lead, 0, box.run, start, end)
        width = inner[k - 1]  # bytes of one index of dims [0, k)
        per0 = width and inner[0] // width  # indices of dims [1, k) under one index of dim 0
        first = max(start // width, box.offsets[0] * per0)
        last = min((end - 1) // width, (box.offsets[0] + box.sizes[0]) * per0 - 1)
        out: list[Piece] = []
        for u in range(first, last + 1):
            local, rest, scale = 0, u, 1
            inside = True
            for d in range(k - 1, -1, -1):  # u's index in each dim [0, k), innermost first
                rest, g = divmod(rest, self.shape[d]) if d else (0, rest)
                if not box.offsets[d] <= g < box.offsets[d] + box.sizes[d]:
                    inside = False
                    break
                local += (g - box.offsets[d]) * scale
                scale *= box.sizes[d]
            if inside:
                out += _clip(box.index, u * width + lead, local * box.run, box.run, start, end)
        return out


def _clip(index: int, global_start: int, at: int, length: int, start: int, end: int) -> list[Piece]:
    low, high = max(start, global_start), min(end, global_start + length)
    return [Piece(index, at + low - global_start, low - start, high - low)] if low < high else []


def _volume(sizes: tuple[int, ...]) -> int:
    n = 1
    for size in sizes:
        n *= size
    return n


#: how many cells of the grid the chunks' edges cut the tensor into may be checked: a layout
#: torch writes (row, column or grid shards) has one cell per chunk; a crafted staggered one
#: that needs more is refused rather than checked for ever
MAX_TILING_CELLS = 1 << 21


def _check_tiling(shape: tuple[int, ...], boxes: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], label: str,
                  names: Sequence[str]) -> None:
    """The boxes lie inside ``shape``, do not overlap and cover it whole.

    Linear in the cells of the grid every chunk edge cuts the tensor into (one per chunk
    for the layouts torch writes): two chunks overlap exactly when they share a cell."""
    for (offsets, sizes), name in zip(boxes, names):
        if any(o + s > d for o, s, d in zip(offsets, sizes, shape)):
            raise CheckpointFormatError(f"{label}: chunk {name} reaches outside the tensor's shape {list(shape)}; "
                                        "the metadata is damaged (save the checkpoint again)", path=label)
    kept = [i for i, (_, s) in enumerate(boxes) if _volume(s) or not shape]
    cuts: list[dict[int, int]] = []
    for d, size in enumerate(shape):
        edges = sorted({0, size, *(boxes[i][0][d] for i in kept), *(boxes[i][0][d] + boxes[i][1][d] for i in kept)})
        cuts.append({edge: n for n, edge in enumerate(edges)})
    owner: dict[tuple[int, ...], int] = {}
    budget = max(MAX_TILING_CELLS, 8 * len(boxes))
    for i in kept:
        offsets, sizes = boxes[i]
        spans = [range(cut[o], cut[o + s]) for cut, o, s in zip(cuts, offsets, sizes)]
        budget -= _volume(tuple(len(span) for span in spans))
        if budget < 0:
            raise CheckpointFormatError(
                f"{label}: its {len(boxes)} chunks are staggered into more than {MAX_TILING_CELLS} pieces, which "
                "no layout torch saves has; the metadata is damaged or hostile (save the checkpoint again)",
                path=label)
        for cell in itertools.product(*spans):
            j = owner.setdefault(cell, i)
            if j != i:
                raise CheckpointFormatError(
                    f"{label}: chunks {names[j]} and {names[i]} overlap; the metadata is damaged or mixes two "
                    "saves (save the checkpoint again)", path=label)
    covered, total = sum(_volume(s) for _, s in boxes), _volume(shape)
    if covered != total:
        raise CheckpointFormatError(
            f"{label}: its chunks cover {covered} of its {total} elements (shape {list(shape)}); a rank's "
            "chunk is missing from the metadata (save the checkpoint again)", path=label)
