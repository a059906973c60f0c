"""The output layout holds ranks into the plan's outputs, not the outputs: each shard's
specs, offsets and header are made when asked for, and are the bytes a layout of its own
specs has."""

from __future__ import annotations

import copy
import json
from array import array
from collections.abc import Sequence
from dataclasses import replace

import pytest

from ckptxform.engine.plan.layout import OutputTensorSpec, ShardLayout, plan_layout
from ckptxform.errors import OutputError
from ckptxform.engine.run.shard_plan import CODEC


class MadeOnAccess(Sequence):
    """Items copied on every access, counting the accesses: nothing can hold them."""

    def __init__(self, items: list[OutputTensorSpec]) -> None:
        self._items, self.made = items, 0

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i):
        if isinstance(i, slice):
            self.made += len(range(*i.indices(len(self))))
            return tuple(copy.copy(item) for item in self._items[i])
        self.made += 1
        return copy.copy(self._items[i])


def specs(count: int) -> list[OutputTensorSpec]:
    return [OutputTensorSpec(f"layers.{i:04d}.w", "BF16", (i % 5, 3)) for i in range(count)]


def test_a_shard_holds_a_run_of_ranks_and_makes_the_same_bytes_as_its_own_specs() -> None:
    items = MadeOnAccess(specs(50))
    layout = plan_layout(items, max_shard_size=60, metadata={"format": "pt"})
    assert len(layout.shards) > 3
    assert [s.ranks for s in layout.shards] == [range(s.ranks.start, s.ranks.stop) for s in layout.shards]
    made = items.made
    for shard in layout.shards:
        own = ShardLayout.of(file=shard.file, header=shard.header, specs=shard.specs, offsets=shard.offsets,
                             data_nbytes=shard.data_nbytes)
        alone = plan_layout(list(shard.specs), max_shard_size=None, metadata={"format": "pt"}).shards[0]
        assert shard.header == own.header == alone.header and shard.header_nbytes == len(shard.header)
        assert list(shard.offsets) == list(alone.offsets) == [p.offset for p in shard.tensors]
        assert [shard.offset(j) for j in range(shard.count)] == list(shard.offsets)
    assert items.made > made  # made again when asked: the layout kept none


def test_copies_leading_out_of_key_order_are_held_as_ranks() -> None:
    # the odd ones are copied unchanged, from offsets in reverse key order: they lead
    items = specs(9)
    copied = {s.key: ("src:a.safetensors", 1000 - i) for i, s in enumerate(items) if i % 2}
    [shard] = plan_layout(items, max_shard_size=None, copied_from=copied).shards
    assert isinstance(shard.ranks, array) and list(shard.ranks) == [7, 5, 3, 1, 0, 2, 4, 6, 8]
    assert [s.key for s in shard.specs] == [items[r].key for r in shard.ranks]


def test_the_index_walked_in_key_order_is_the_merged_one() -> None:
    items = MadeOnAccess(specs(40))
    layout = plan_layout(items, max_shard_size=50)
    assert layout.keyed is items
    merged = replace(layout, keyed=None)  # each shard's sorted keys merged
    walked = list(layout.keys_with_files())
    assert walked == list(merged.keys_with_files()) == sorted(walked)
    assert dict(walked) == merged.index_json()["weight_map"] and len(walked) == 40


def test_a_task_carries_its_shard_standalone_through_the_codec() -> None:
    shard = plan_layout(MadeOnAccess(specs(30)), max_shard_size=40).shards[1]
    alone = shard.standalone()
    assert alone.ranks == range(shard.count) and alone.header == shard.header
    assert CODEC.decode(json.loads(json.dumps(CODEC.encode(alone))), "plan.json") == alone
    with_bytes = shard.standalone(header=True)
    assert with_bytes.made_from == shard.header and list(with_bytes.offsets) == list(shard.offsets)


@pytest.mark.parametrize("bounds", [[0, 1], [1, 2, 3, 4], [0, 1, 0]])
def test_an_edited_range_is_refused(bounds: list[int]) -> None:
    data = CODEC.encode(range(3))
    assert CODEC.decode(data, "plan.json") == range(3)
    with pytest.raises(OutputError, match="is not a value a plan holds"):
        CODEC.decode({"range": bounds}, "plan.json")
