"""Sharded stand-ins written the way ``save_pretrained`` writes big checkpoints:
contiguous runs of tensors of about equal bytes per shard, an index, and a weight and
its scale free to land in different shards (real checkpoints do that too).

Tensors are made one module at a time and each shard is written once full, so building
a multi-GB stand-in needs the memory of one shard, not of the checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ckptxform.errors import UsageError
from ckptxform.standins.tensors import dtypes_of, save_safetensors, shapes_of, write_json

if TYPE_CHECKING:
    import numpy as np

__all__ = ["ShardedFiles", "balanced_runs", "write_sharded"]

#: a module's tensors, made on demand: key -> tensor
Maker = Callable[[], "dict[str, np.ndarray]"]  # or torch tensors (quantized builders)


@dataclass(frozen=True)
class ShardedFiles:
    """What ``write_sharded`` wrote."""

    files: tuple[str, ...]
    weight_map: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]


def balanced_runs(sizes: Sequence[int], shards: int) -> list[int]:
    """The shard (0-based) of each item: ``shards`` contiguous, non-empty runs of about
    equal total size, in order."""
    if not 1 <= shards <= len(sizes):
        raise UsageError(f"cannot split {len(sizes)} tensors into {shards} non-empty shards; "
                         "use fewer shards or a bigger stand-in")
    total, acc, shard, used = sum(sizes), 0, 0, 0
    out = []
    for i, size in enumerate(sizes):
        short = len(sizes) - i == shards - shard - 1  # exactly one item left per later shard
        if used and shard < shards - 1 and (acc >= total * (shard + 1) / shards or short):
            shard, used = shard + 1, 0
        out.append(shard)
        used += 1
        acc += size
    return out


def write_sharded(out: Path, names: Sequence[str], modules: Iterable[tuple[Sequence[tuple[str, int]], Maker]],
                  placement: Callable[[list[int]], list[int]]) -> ShardedFiles:
    """Write ``modules`` (each: its ``(key, nbytes)`` list and a maker of its tensors) into
    the shard files ``names``; ``placement`` maps every tensor's size, in order, to its
    shard. Writes ``model.safetensors.index.json`` beside them."""
    modules = list(modules)
    sizes = [n for keys, _ in modules for _, n in keys]
    shard_of = placement(sizes)
    weight_map: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    pending: dict[int, dict[str, np.ndarray]] = {}
    position = 0

    def flush(shard: int) -> None:
        tensors = pending.pop(shard)
        save_safetensors(tensors, out / names[shard])
        shapes.update(shapes_of(tensors))
        dtypes.update(dtypes_of(tensors))

    out.mkdir(parents=True, exist_ok=True)
    for keys, make in modules:
        made = make()
        for key, _ in keys:
            shard = shard_of[position]
            position += 1
            for earlier in [s for s in pending if s < shard]:
                flush(earlier)
            pending.setdefault(shard, {})[key] = made[key]
            weight_map[key] = names[shard]
    for shard in sorted(pending):
        flush(shard)
    total = sum(sizes)
    write_json(out / "model.safetensors.index.json",
               {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    return ShardedFiles(tuple(names), weight_map, shapes, dtypes)
