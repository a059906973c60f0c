"""The tensor index of a sharded safetensors checkpoint (local or Hub): a mapping over its
``model.safetensors.index.json`` that reads a shard's header only when one of its tensors
is looked up, so a plan that needs two shards of a 60-shard verifier reads two headers.

What the index alone says (which keys exist, which file the index assigns each to) is
known without a read (``ShardIndex``: by each key's hash, no key string held); a shard's
header, each time it is read, is checked against the index's part for that shard
(``check_shard``, called by the loader). An index that lies about a
shard whose header is never read (a key it does not hold, one it holds but the index puts
elsewhere, a file that is not a safetensors file at all) cannot be caught without reading
it: such a shard's keys are only listed, never read or written.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckptxform.sources.base import Checkpoint, TensorInfo
from ckptxform.sources.header_columns import ShardColumns
from ckptxform.sources.safetensors_header import check_shard_matches_index
from ckptxform.sources.shard_index import ShardIndex

__all__ = ["LazyShards", "LazyTensors", "weak_loader"]


def weak_loader(load: Callable[..., ShardColumns]) -> Callable[..., ShardColumns]:
    """``load``, a checkpoint's bound method, called through a weak reference: the
    checkpoint holds its ``LazyTensors``, and a loader holding the checkpoint made a
    reference cycle that only the cyclic collector frees (paused over a run: every header
    read stayed alive until it ran)."""
    method = weakref.WeakMethod(load)  # type: ignore[arg-type]

    def load_weakly(*args: Any) -> ShardColumns:
        bound = method()
        if bound is None:
            raise RuntimeError("the checkpoint of this index is gone: its headers cannot be read")
        return bound(*args)

    return load_weakly


#: The header columns a sharded checkpoint keeps, least recently used dropped first (a
#: dropped header asked for again is read again: checked against its pin, ~80 ms for 15,625
#: tensors). A shard of 15,625 tensors (1,000,000 in 64 files) holds ~1.7 MB of columns, all
#: 64 of 200,000 tensors ~21 MB. Each pass over every file reads a dropped header again:
#: with room for a third of them, a 200,000-tensor rename read each header 2 times to plan
#: (the tensors by file, then the unused ones) and 5 to apply (and the layout, the copies'
#: runs, the writes), never more within a pass.
HEADER_CACHE_BYTES = 32 << 20


class LazyTensors(Mapping[str, TensorInfo]):
    """The tensors of a sharded checkpoint, keyed by the index; a shard's header is read
    the first time one of its tensors is looked up, and again if it was dropped from the
    cache of recent headers (``HEADER_CACHE_BYTES``). Length comes from the index alone;
    iterating reads every header, file by file, in offset order. A read header is kept as
    columns (``ShardColumns``): a ``TensorInfo`` is made when looked up. The index is a
    ``ShardIndex`` (a key's hash -> its file: no string per key held)."""

    def __init__(
        self,
        weight_map: Mapping[str, str],
        files: tuple[str, ...],
        load: Callable[[str], ShardColumns],
        *,
        cache_bytes: int | None = None,
    ) -> None:
        index = weight_map if isinstance(weight_map, ShardIndex) else ShardIndex.from_mapping(weight_map, files)
        self.weight_map = index
        self._files = index.files
        self._file_number = index.number  # bound once: asked several times a tensor
        self._clashes = index.clashes
        self._load = load  # file -> its tensors, from its header (read now); ``check_shard`` checks them
        self._cache: OrderedDict[str, ShardColumns] = OrderedDict()
        self._cache_bytes = HEADER_CACHE_BYTES if cache_bytes is None else cache_bytes
        self._held = 0
        self._sizes: dict[str, int] = {}
        #: every file whose header was read at least once, in the order first read
        self._read: dict[str, None] = {}
        #: header reads so far, a file read again after it was dropped counting again
        self.header_reads = 0
        self._last = ""  # the file last looked up: most lookups ask the same one again
        self._cache_lock = threading.Lock()
        # one read of a header when two threads ask for it at once; other headers meanwhile
        self._locks = {file: threading.Lock() for file in files}

    @property
    def loaded_files(self) -> tuple[str, ...]:
        """The shards whose headers have been read so far (held or not)."""
        return tuple(self._read)

    def is_loaded(self, file: str) -> bool:
        """Whether the header of ``file`` has been read (it may since have been dropped)."""
        return file in self._read

    def keys_of(self, file: str) -> Sequence[str]:
        """The keys the index assigns to ``file``, sorted; no header is read (a held one's
        keys are its header's, which agree with the index)."""
        columns = self._cache.get(file)
        return columns.sorted_keys if columns is not None else self.weight_map.keys_of(file)

    def shard(self, file: str) -> ShardColumns:
        """The tensors of one shard, a read-only mapping in offset order (its header is read
        if it is not held)."""
        columns = self._cache.get(file)
        if columns is not None:
            if file != self._last:
                self._last = file
                with self._cache_lock:
                    if file in self._cache:
                        self._cache.move_to_end(file)
            return columns
        with self._locks.get(file) or threading.Lock():
            columns = self._cache.get(file)
            if columns is None:
                columns = self._load(file)
                self._keep(file, columns)
        self._last = file
        return columns

    def _keep(self, file: str, columns: ShardColumns) -> None:
        size = columns.held_bytes()
        with self._cache_lock:
            self.header_reads += 1
            self._read[file] = None
            self._cache[file] = columns
            self._sizes[file] = size
            self._held += size
            while self._held > self._cache_bytes and len(self._cache) > 1:
                dropped, _ = self._cache.popitem(last=False)
                self._held -= self._sizes.pop(dropped)

    def check_shard(self, file: str, columns: ShardColumns, *, label: str) -> None:
        """Raise unless ``columns``, shard ``file``'s header just read, holds exactly the
        keys the index maps to it (``check_shard_matches_index``'s errors)."""
        index = self.weight_map
        number = index.file_number(file)
        if index.clashes:
            agrees = all(number in index.numbers(key) for key in columns.sorted_keys)
        else:
            lookup = index.number
            agrees = all(lookup(key) == number for key in columns.sorted_keys)
        if agrees and len(columns) == index.count(file):
            return
        # the exact strings, for the error: this file's keys read again from the index
        listed = index.keys_of(file)
        homes = {key: index[key] for key in columns.sorted_keys if key in index}
        homes.update(dict.fromkeys(listed, file))
        check_shard_matches_index(homes, dict.fromkeys(listed, file), file, columns, label=label)

    def read_shards(self, files: Sequence[str], readers: int) -> None:
        """Read the headers of ``files`` not read yet, ``readers`` at a time (held while the
        cache has room: the others are read again when asked for)."""
        todo = [file for file in files if file not in self._read]
        if len(todo) > 1 and readers > 1:
            with ThreadPoolExecutor(max_workers=min(readers, len(todo))) as pool:
                for _ in pool.map(self.shard, todo):  # the first error, if any, raised here
                    pass

    def __getitem__(self, key: str) -> TensorInfo:
        # most often the key is in the shard asked last: its header finds it (exactly: it
        # agrees with the index) without the index's lookup (~1 us)
        last = self._cache.get(self._last)
        info = last.find(key) if last is not None and not self._clashes else None
        if info is not None:
            return info
        number = self._file_number(key) if isinstance(key, str) else -1
        if number < 0 or self._clashes:
            return self._clashing(key)
        info = self.shard(self._files[number]).find(key)
        if info is None:
            raise KeyError(key)
        return info

    def _clashing(self, key: str) -> TensorInfo:
        """``self[key]`` when two keys of the index share a hash: each candidate file's
        header says whether it holds ``key``."""
        index = self.weight_map
        for number in index.numbers(key):
            columns = self.shard(index.files[number])
            if key in columns:
                return columns[key]
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        """By the index, and where it holds a key of the same hash, by that file's header
        (which holds the key strings): exact, reading a header only for a key it holds."""
        index = self.weight_map
        if not isinstance(key, str) or key not in index:
            return False
        return any(key in self.shard(index.files[number]) for number in index.numbers(key))

    def __iter__(self) -> Iterator[str]:
        for file in self._files:
            yield from self.shard(file)

    def __len__(self) -> int:
        return len(self.weight_map)


class LazyShards(Checkpoint):
    """What a checkpoint whose ``tensors`` may be a ``LazyTensors`` answers from its index
    alone (a base of the local and the Hub checkpoints)."""

    def tensors_of_file(self, file: str) -> list[TensorInfo]:
        """Every tensor of ``file``, from its own header alone: the base class scans
        ``tensors``, which would read every other shard's header."""
        if not isinstance(self.tensors, LazyTensors):
            return super().tensors_of_file(file)
        if file not in self.files:
            return []
        return self.tensors.shard(file).infos()

    def file_of(self, key: str) -> str:
        if not isinstance(self.tensors, LazyTensors) or self.tensors.weight_map.clashes:
            return super().file_of(key)
        return self.tensors.weight_map[key]

    def tensor_keys(self) -> Collection[str]:  # type: ignore[override]
        """Every key, in the index's order, read again from the index each time it is
        iterated (no list of every key is made)."""
        if not isinstance(self.tensors, LazyTensors):
            return super().tensor_keys()
        return _IndexKeys(self.tensors.weight_map)

    #: headers read at once by ``read_headers`` (over the network, the round trips overlap)
    header_readers = 1

    def read_headers(self, files: Sequence[str]) -> None:
        if isinstance(self.tensors, LazyTensors):
            self.tensors.read_shards(files, self.header_readers)

    def unread_header_keys(self, file: str) -> Sequence[str] | None:
        if not isinstance(self.tensors, LazyTensors) or self.tensors.is_loaded(file):
            return None
        return self.tensors.keys_of(file)


class _IndexKeys(Collection[str]):
    """The keys of an index, streamed from it each time they are iterated."""

    def __init__(self, index: Mapping[str, str]) -> None:
        self._index = index

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: object) -> bool:
        return key in self._index
