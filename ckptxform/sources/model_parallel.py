"""Meta's model-parallel checkpoints as one source: ``consolidated.00.pth`` ...
``consolidated.NN.pth`` (+ ``params.json``), each file one rank's piece of every tensor.

Meta's ``ColumnParallelLinear`` splits a weight's rows across the ranks, ``RowParallelLinear``
and ``ParallelEmbedding`` its columns; norms and ``rope.freqs`` are replicated. Which is which
is model knowledge, so the rule says it (the ``concat_shards`` op); the source only knows
the files. ``tensors`` are the keys as shard 0 holds them; ``shard_tensors`` gives each
shard's piece, which a ``concat_shards`` program reads. A tensor read whole (no
``concat_shards``: a replicated one) is read from shard 0 and every other shard's copy is
compared while it is read, so a split tensor can never pass for a replicated one.

Every shard is a ``.pth`` opened by ``torch_bin``: its tensors are byte ranges of the file
(torch's zip stores each storage raw), read with ``pread``. The files must be ``consolidated.00.pth`` .. ``consolidated.{N-1}.pth`` with no
gap, hold the same keys, and each key the same dtype and shape in every file (Meta splits
every tensor equally): anything else is one error naming the files.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..digits import ascii_int
from ..errors import CheckpointFormatError, SourceNotFoundError, UsageError, quote_keys
from .base import Checkpoint, ShardInfo, TensorInfo
from .pins import FilePin

_SHARD = re.compile(r"^consolidated\.(\d{2,})\.pth$")


def shard_name(index: int) -> str:
    """The file name Meta's checkpoints give shard ``index`` (two digits at least)."""
    return f"consolidated.{index:02d}.pth"


def shard_files(directory: Path) -> tuple[str, ...]:
    """The ``consolidated.NN.pth`` files of ``directory`` in rank order (none: ``()``); a gap
    in the numbering is refused, naming the files missing."""
    found: dict[int, str] = {}
    for entry in directory.iterdir():
        matched = _SHARD.match(entry.name)
        rank = ascii_int(matched.group(1)) if matched else None
        if rank is not None and entry.name == shard_name(rank):  # not consolidated.007.pth beside .07
            found[rank] = entry.name
    if not found:
        return ()
    missing = [shard_name(i) for i in range(max(found) + 1) if i not in found]
    if missing:
        raise SourceNotFoundError(
            f"{directory}: holds model-parallel shards {quote_keys(sorted(found.values()), 4)} but not "
            f"{quote_keys(missing, 4)}; download the missing shard file(s) beside the others",
            path=str(directory / missing[0]))
    return tuple(found[i] for i in range(len(found)))


def missing_shards(files: Sequence[str], count: int, root: Path | None) -> str:
    """How an error names the shards a checkpoint lacks when it needs ``count`` and has
    ``files`` (and, when they lie in ``root`` already, that the directory must be given)."""
    present = set(files)
    names = [shard_name(i) for i in range(count) if shard_name(i) not in present]
    if len(names) + len(present) != count:  # not Meta's names: say how many
        return f"{count - len(present)} of its {count} shard files are missing"
    one = len(names) == 1
    text = f"{quote_keys(names, 4)} {'is' if one else 'are'} missing"
    if root is not None and all((root / n).exists() for n in names):
        return text + (f" from this source, but {root} holds {'it' if one else 'them'}: give the directory, not one "
                       "shard's file")
    where = f" from {root}" if root is not None else ""
    return text + where + f"; download {'it' if one else 'them'} beside the others"


class ModelParallelCheckpoint(Checkpoint):
    """The shards of one model-parallel checkpoint (each a single-file checkpoint), read
    as one source; build it with ``open_model_parallel``."""

    def __init__(self, *, location: str, name: str | None, root: Path, shards: Sequence[Checkpoint]) -> None:
        self.location = location
        self.name = name
        self.root = root
        self._shards = tuple(shards)
        self.files = tuple(f for shard in self._shards for f in shard.files)
        self.tensors = dict(shards[0].tensors)
        self._pieces = {key: tuple(ShardInfo(s.tensors[key].key, s.tensors[key].dtype, s.tensors[key].shape,
                                             s.tensors[key].file, s.tensors[key].offset, s.tensors[key].nbytes,
                                             shard=i)
                                   for i, s in enumerate(self._shards))
                        for key in self.tensors}

    def shard_tensors(self, key: str) -> tuple[TensorInfo, ...]:
        return self._pieces[key]

    def config(self, name: str = "config.json") -> dict[str, Any] | None:
        return self._shards[0].config(name)

    def read(self, info: TensorInfo, start: int = 0, length: int | None = None) -> bytes:
        length = self._checked_range(info, start, length)
        if isinstance(info, ShardInfo):
            if self._pieces.get(info.key, ())[info.shard:info.shard + 1] != (info,):
                raise UsageError(f"{self.location}: {info.key!r} of {info.file!r} is not a shard of this checkpoint")
            shard = self._shards[info.shard]
            return shard.read(shard.tensors[info.key], start, length)
        if self.tensors.get(info.key) != info:
            raise UsageError(f"{self.location}: tensor {info.key!r} is not part of this checkpoint; read a "
                             "TensorInfo taken from its .tensors")
        first = self._shards[0].read(self._shards[0].tensors[info.key], start, length)
        for shard in self._shards[1:]:
            other = shard.read(shard.tensors[info.key], start, length)
            if other != first:
                at = start + next(i for i, (a, b) in enumerate(zip(first, other)) if a != b)
                raise CheckpointFormatError(
                    f"{self.root}: tensor {info.key!r} differs between {self._shards[0].files[0]} and "
                    f"{shard.files[0]} (byte {at}): it is split across the model-parallel shards, not "
                    "replicated; concatenate it in the rule (ops: [{concat_shards: {dim: D}}])",
                    path=str(self.root / shard.files[0]), key=info.key)
        return first

    def list_files(self) -> tuple[str, ...]:
        return self._shards[0].list_files()

    def file_path(self, name: str) -> Path:
        return self._shards[0].file_path(name)

    def pins(self) -> tuple[FilePin, ...]:
        pins = {pin.path: pin for shard in self._shards for pin in shard.pins()}
        return tuple(pins[p] for p in sorted(pins))

    def local_paths(self) -> tuple[Path, ...]:
        return (Path(self.location).resolve(), *(Path(pin.path) for pin in self.pins()))

    def close(self) -> None:
        for shard in self._shards:
            shard.close()


def open_model_parallel(root: Path, files: Sequence[str], *, location: str, name: str | None,
                        open_file: Callable[[str], Checkpoint]) -> ModelParallelCheckpoint:
    """``files`` of ``root`` (in rank order), each opened by ``open_file``, checked to be the
    shards of one checkpoint."""
    shards: list[Checkpoint] = []
    try:
        for file in files:
            shards.append(open_file(file))
        _check_alike(root, shards)
    except BaseException:
        for shard in shards:
            shard.close()
        raise
    return ModelParallelCheckpoint(location=location, name=name, root=root, shards=shards)


def _check_alike(root: Path, shards: Sequence[Checkpoint]) -> None:
    first, want = shards[0].files[0], shards[0].tensors
    for shard in shards[1:]:
        have: Mapping[str, TensorInfo] = shard.tensors
        lacks, extra = [k for k in want if k not in have], [k for k in have if k not in want]
        if lacks or extra:
            what = (f"lacks {quote_keys(lacks, 3)}, which {first} holds" if lacks
                    else f"holds {quote_keys(extra, 3)}, which {first} lacks")
            raise CheckpointFormatError(
                f"{root / shard.files[0]}: {what}; the files are not the model-parallel shards of one "
                "checkpoint (every shard holds every key): re-download them", path=str(root / shard.files[0]),
                key=(lacks or extra)[0])
        for key, info in want.items():
            other = have[key]
            if (other.dtype, other.shape) != (info.dtype, info.shape):
                raise CheckpointFormatError(
                    f"{root}: tensor {key!r} is {info.dtype} {list(info.shape)} in {first} but {other.dtype} "
                    f"{list(other.shape)} in {shard.files[0]}; the model-parallel shards of one checkpoint hold "
                    "equal pieces of every tensor: these files are not one checkpoint's (re-download them)",
                    path=str(root / shard.files[0]), key=key)
