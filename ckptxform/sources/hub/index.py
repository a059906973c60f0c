"""The tensor index of a Hub repo: a mapping over ``model.safetensors.index.json`` that
reads a shard's header only when one of its tensors is looked up, and the repo's small
JSON files read strictly."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ckptxform.sources.base import TensorInfo
from ckptxform.sources.strict_json import parse_json_object

__all__ = ["LazyTensors", "load_json"]


class LazyTensors(Mapping[str, TensorInfo]):
    """The tensors of a sharded checkpoint, keyed by the index; a shard's header is read
    the first time one of its tensors is looked up. Membership and length come from the
    index alone; iterating reads every header, file by file, in offset order."""

    def __init__(
        self,
        weight_map: Mapping[str, str],
        files: tuple[str, ...],
        load: Callable[[str, Mapping[str, str]], list[TensorInfo]],
    ) -> None:
        self.weight_map = weight_map
        self._files = files
        self._load = load  # (file, the part of the weight map naming it) -> its tensors
        self._by_file: dict[str, dict[str, str]] = {}
        for key, file in weight_map.items():
            self._by_file.setdefault(file, {})[key] = file
        self._shards: dict[str, dict[str, TensorInfo]] = {}

    @property
    def loaded_files(self) -> tuple[str, ...]:
        """The shards whose headers have been read so far."""
        return tuple(self._shards)

    def shard(self, file: str) -> dict[str, TensorInfo]:
        """The tensors of one shard (its header is read the first time)."""
        if file not in self._shards:
            self._shards[file] = {t.key: t for t in self._load(file, self._by_file.get(file, {}))}
        return self._shards[file]

    def __getitem__(self, key: str) -> TensorInfo:
        return self.shard(self.weight_map[key])[key]

    def __contains__(self, key: object) -> bool:
        return key in self.weight_map

    def __iter__(self) -> Iterator[str]:
        for file in self._files:
            yield from self.shard(file)

    def __len__(self) -> int:
        return len(self.weight_map)


def load_json(path: Path, label: str) -> dict[str, Any]:
    """A repo's ``config.json``, read strictly (duplicate keys and NaN refused)."""
    return parse_json_object(path.read_bytes(), label, what="config", fix="re-upload it")
