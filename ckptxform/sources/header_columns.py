"""One safetensors header's tensors held as columns: a read-only mapping key -> ``TensorInfo``
whose entries are made when asked for, not kept.

A sharded checkpoint keeps the headers it read last (``lazy_index``). As a dict of
``TensorInfo`` (an object and a boxed offset each, a dict slot) that was ~145 bytes a
tensor; as columns, ~22: the keys sorted in a tuple (found by bisection: no dict, no boxed
int per key), each tensor's data offset in an ``array('Q')``, its dtype and shape as an
index into the header's few distinct (dtype, shape) pairs, and its rank in offset order.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import fields
from sys import getsizeof

from ckptxform.dtypes import nbytes
from ckptxform.sources.base import TensorInfo

__all__ = ["ShardColumns"]

#: (dtype, shape, nbytes) of a tensor: a safetensors header fixes nbytes by dtype and shape
Kind = tuple[str, tuple[int, ...], int]

# A plan and its run ask for each tensor some 7 times, and each time one is made: through
# its slots' setters it takes ~0.4 us, through the frozen dataclass's __init__ ~0.75 us
# (that __init__ calls object.__setattr__ per field). Unpacking fails should TensorInfo
# gain or lose a field.
_new = object.__new__
_set_key, _set_dtype, _set_shape, _set_file, _set_offset, _set_nbytes = (
    TensorInfo.__dict__[field.name].__set__ for field in fields(TensorInfo))
assert not hasattr(TensorInfo, "__post_init__")  # which making it this way would skip


def _tensor_info(key: str, kind: Kind, file: str, offset: int) -> TensorInfo:
    """``TensorInfo(key, *kind[:2], file, offset, kind[2])``, made faster."""
    info = _new(TensorInfo)
    _set_key(info, key)
    _set_dtype(info, kind[0])
    _set_shape(info, kind[1])
    _set_file(info, file)
    _set_offset(info, offset)
    _set_nbytes(info, kind[2])
    return info


class ShardColumns(Mapping[str, TensorInfo]):
    """The tensors of one file, iterated in offset order (ties by key) as the header
    parser sorts them; ``self[key]`` is a new ``TensorInfo`` each time."""

    __slots__ = ("file", "_base", "_keys", "_begins", "_kinds", "_types", "_order")

    def __init__(self, file: str, base: int, entries: Iterable[tuple[str, str, tuple[int, ...], int]]) -> None:
        """``entries``: each tensor's ``(key, dtype, shape, begin)``, ``begin`` counted from
        ``base`` (the absolute offset of the data section, where ``begin`` 0 lies)."""
        self.file = file
        self._base = base
        rows = sorted(entries)  # by key: no key is in a header twice
        kinds: dict[tuple[str, tuple[int, ...]], int] = {}
        for _, dtype, shape, _ in rows:
            kinds.setdefault((dtype, shape), len(kinds))
        self._types: tuple[Kind, ...] = tuple((dtype, shape, nbytes(dtype, shape)) for dtype, shape in kinds)
        self._keys: tuple[str, ...] = tuple(row[0] for row in rows)
        self._begins = array("Q", (row[3] for row in rows))
        self._kinds = array(_smallest_code(len(kinds)), (kinds[row[1], row[2]] for row in rows))
        #: positions in offset order; a stable sort of key-sorted rows breaks ties by key
        self._order = array("I", sorted(range(len(rows)), key=self._begins.__getitem__))

    @property
    def sorted_keys(self) -> tuple[str, ...]:
        """The keys, sorted."""
        return self._keys

    def held_bytes(self) -> int:
        """About what these columns hold (a cache of them is bounded by it)."""
        keys = self._keys
        return (sum(map(getsizeof, keys)) + getsizeof(keys) + getsizeof(self._types)
                + sum(column.itemsize * len(column) for column in (self._begins, self._kinds, self._order)))

    def __getitem__(self, key: str) -> TensorInfo:
        info = self.find(key)
        if info is None:
            raise KeyError(key)
        return info

    def find(self, key: str) -> TensorInfo | None:
        """``self[key]``, or None: no exception for a key of another shard."""
        # asked several times a tensor by a plan and its run: one call, no helper (each
        # nested call cost ~0.1 us)
        keys = self._keys
        position = bisect_left(keys, key) if isinstance(key, str) else len(keys)
        if position == len(keys) or keys[position] != key:
            return None
        return _tensor_info(keys[position], self._types[self._kinds[position]], self.file,
                            self._base + self._begins[position])

    def __contains__(self, key: object) -> bool:
        keys = self._keys
        position = bisect_left(keys, key) if isinstance(key, str) else len(keys)
        return position < len(keys) and keys[position] == key

    def __iter__(self) -> Iterator[str]:
        keys = self._keys
        return (keys[position] for position in self._order)

    def __len__(self) -> int:
        return len(self._keys)

    def infos(self) -> list[TensorInfo]:
        """Every tensor, in offset order (ties by key)."""
        keys, begins, kinds, types, file, base = \
            self._keys, self._begins, self._kinds, self._types, self.file, self._base
        return [_tensor_info(keys[p], types[kinds[p]], file, base + begins[p]) for p in self._order]


def _smallest_code(count: int) -> str:
    """The narrowest unsigned ``array`` type code that holds ``0 .. count - 1``."""
    return "B" if count <= 1 << 8 else "H" if count <= 1 << 16 else "I"
