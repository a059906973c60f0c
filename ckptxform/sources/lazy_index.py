"""The tensor index of a sharded safetensors checkpoint (local or Hub): a mapping over its
``model.safetensors.index.json`` that reads a shard's header only when one of its tensors
is looked up, so a plan that needs two shards of a 60-shard verifier reads two headers.

What the index alone says (which keys exist, which file the index assigns each to) is
known without a read; a shard's header, once read, is checked against the index's part
for that shard (``check_index_matches_shards``, by the loader). An index that lies about a
shard whose header is never read (a key it does not hold, one it holds but the index puts
elsewhere, a file that is not a safetensors file at all) cannot be caught without reading
it: such a shard's keys are only listed, never read or written.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckptxform.sources.base import Checkpoint, TensorInfo
from ckptxform.sources.header_columns import ShardColumns

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


class LazyTensors(Mapping[str, TensorInfo]):
    """The tensors of a sharded checkpoint, keyed by the index; a shard's header is read
    the first time one of its tensors is looked up. Membership and length come from the
    index alone; iterating reads every header, file by file, in offset order. A read
    header is kept as columns (``ShardColumns``): a ``TensorInfo`` is made when looked up."""

    def __init__(
        self,
        weight_map: Mapping[str, str],
        files: tuple[str, ...],
        load: Callable[[str, Mapping[str, str]], ShardColumns],
    ) -> None:
        self.weight_map = weight_map
        self._files = files
        self._load = load  # (file, the part of the weight map naming it) -> its tensors
        #: each file's keys, as the index lists them (its string objects), in a list until
        #: first asked for, then sorted in a tuple: once, since they are asked per skipped
        #: key (a sort per call was quadratic); one of the two kept (both were 17 bytes a tensor)
        self._by_file: dict[str, list[str] | tuple[str, ...]] = {}
        for key, file in weight_map.items():
            self._by_file.setdefault(file, []).append(key)  # type: ignore[union-attr]
        self._shards: dict[str, ShardColumns] = {}
        # one read of a header when two threads ask for it at once; other headers meanwhile
        self._locks = {file: threading.Lock() for file in files}

    @property
    def loaded_files(self) -> tuple[str, ...]:
        """The shards whose headers have been read so far."""
        return tuple(self._shards)

    def is_loaded(self, file: str) -> bool:
        """Whether the header of ``file`` has been read."""
        return file in self._shards

    def keys_of(self, file: str) -> tuple[str, ...]:
        """The keys the index assigns to ``file``, sorted (once per file); no header is read."""
        keys = self._by_file.get(file, ())
        if type(keys) is not tuple:
            keys = self._by_file[file] = tuple(sorted(keys))
        return keys

    def shard(self, file: str) -> ShardColumns:
        """The tensors of one shard, a read-only mapping in offset order (its header is read
        the first time)."""
        if file not in self._shards:
            with self._locks.get(file) or threading.Lock():
                if file not in self._shards:
                    listed = self.keys_of(file)
                    columns = self._load(file, dict.fromkeys(listed, file))
                    columns.share_names(listed)  # just read: nothing else holds it yet
                    self._shards[file] = columns
        return self._shards[file]

    def read_shards(self, files: Sequence[str], readers: int) -> None:
        """Read the headers of ``files`` not read yet, ``readers`` at a time."""
        todo = [file for file in files if file not in self._shards]
        if len(todo) > 1 and readers > 1:
            with ThreadPoolExecutor(max_workers=min(readers, len(todo))) as pool:
                for _ in pool.map(self.shard, todo):  # the first error, if any, raised here
                    pass

    def __getitem__(self, key: str) -> TensorInfo:
        file = self.weight_map[key]
        columns = self._shards.get(file)  # read already, most often: no call to ``shard``
        return (columns if columns is not None else self.shard(file))[key]

    def __contains__(self, key: object) -> bool:
        return key in self.weight_map

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

    def tensor_keys(self) -> list[str]:
        if not isinstance(self.tensors, LazyTensors):
            return super().tensor_keys()
        return list(self.tensors.weight_map)

    #: headers read at once by ``read_headers`` (over the network, the round trips overlap)
    header_readers = 1

    def read_headers(self, files: Sequence[str]) -> None:
        if isinstance(self.tensors, LazyTensors):
            self.tensors.read_shards(files, self.header_readers)

    def unread_header_keys(self, file: str) -> Sequence[str] | None:
        if not isinstance(self.tensors, LazyTensors) or self.tensors.is_loaded(file):
            return None
        return self.tensors.keys_of(file)
