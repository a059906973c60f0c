"""The hostile-input suite, round 3 (issue 37): DCP, torch_dist, model-parallel and
quantize inputs built by the tools' own writers, then damaged.

Each CLI case runs the real command in a subprocess through ``Case`` (tests/test_hostile_inputs.py):
the one error line and the exit code asserted, no output, no temporary sibling, sources
unchanged. Growth is asserted by counting work, never by timing.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO
from test_hostile_inputs import Case

from ckptxform.errors import CheckpointFormatError
from ckptxform.sources.chunks import ChunkGrid
from ckptxform.sources.lazy_index import LazyShards, LazyTensors


@pytest.fixture
def case(tmp_path: Path, run_cli: Any) -> Case:
    return Case(tmp_path, run_cli)


# ---------------------------------------------------------------- 9: quadratic steps


class _Counted(Sequence):  # type: ignore[type-arg]
    """A sequence that counts how often an item is looked up."""

    def __init__(self, items: list[Any]) -> None:
        self.items, self.lookups = items, 0

    def __getitem__(self, index: Any) -> Any:
        self.lookups += 1
        return self.items[index]

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Any:
        self.lookups += len(self.items)
        return iter(self.items)


def _tiling_lookups(count: int) -> int:
    """Chunk lookups of the tiling check of a [4, count] tensor saved as ``count`` column chunks."""
    boxes = _Counted([((0, i), (4, 1)) for i in range(count)])
    ChunkGrid((4, count), 2, boxes, label="t", names=[str(i) for i in range(count)])
    return boxes.lookups


def test_the_chunk_tiling_check_grows_linearly() -> None:
    small, large = _tiling_lookups(500), _tiling_lookups(5000)
    assert large <= 12 * small, (small, large)  # 10x the chunks: ~10x the work (quadratic: 100x)


def test_a_staggered_chunk_layout_is_refused_not_checked_for_ever() -> None:
    # n row bands, each cut at its own column: every chunk edge cuts every band
    n = 1600
    boxes = [((r, 0), (1, 1 + r)) for r in range(n)] + [((r, 1 + r), (1, n - r)) for r in range(n)]
    with pytest.raises(CheckpointFormatError, match="staggered into more than"):
        ChunkGrid((n, n + 1), 2, boxes, label="t", names=[str(i) for i in range(2 * n)])


def test_chunks_that_overlap_in_a_grid_are_still_found() -> None:
    boxes = [((0, 0), (2, 2)), ((2, 0), (2, 2)), ((0, 2), (4, 2)), ((1, 1), (1, 1))]
    with pytest.raises(CheckpointFormatError, match="chunks a and d overlap"):
        ChunkGrid((4, 4), 2, boxes, label="t", names=["a", "b", "c", "d"])


class _Key(str):
    """A key that counts the comparisons made between keys."""

    compared = 0

    def __lt__(self, other: object) -> bool:
        _Key.compared += 1
        return str.__lt__(self, other)  # type: ignore[operator]


class _Sharded(LazyShards):
    def __init__(self, tensors: LazyTensors) -> None:
        self.tensors = tensors

    def read(self, *args: Any, **kwargs: Any) -> bytes:
        raise AssertionError("no tensor is read")

    def config(self, *args: Any, **kwargs: Any) -> None:
        return None


def _lookup_comparisons(count: int) -> int:
    """Key comparisons of asking, for each of ``count`` skipped keys, its unread shard's keys."""
    weight_map = {_Key(f"k{i:07d}"): "skipped.safetensors" for i in reversed(range(count))}
    ckpt = _Sharded(LazyTensors(weight_map, ("skipped.safetensors",), lambda file, part: []))
    _Key.compared = 0
    for _ in range(count):
        assert len(ckpt.unread_header_keys("skipped.safetensors") or ()) == count
    return _Key.compared


def test_the_keys_of_an_unread_shard_are_sorted_once_not_per_lookup() -> None:
    small, large = _lookup_comparisons(300), _lookup_comparisons(3000)
    assert large <= 20 * small, (small, large)  # n log n (quadratic: ~100x)


# ---------------------------------------------------------------- 7, 8: a source config's regexes


def _compressed_fp8_source(case: Any, ignore: list[str], module: str = "model.layers.0.mlp.down_proj") -> None:
    import json

    import torch
    from test_hostile_inputs import make_source

    config = {"quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ignore,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}}}}}
    make_source(case.root / "m", {f"{module}.weight": torch.ones(2, 2).to(torch.float8_e4m3fn),
                                  f"{module}.weight_scale": torch.ones(2, 1)}, config=json.dumps(config))


def test_an_ignore_pattern_of_the_source_config_that_does_not_compile_is_named(case: Any) -> None:
    _compressed_fp8_source(case, ["lm_head", "re:model.(layers"])
    case.fails("plan", "fp8_to_bf16", "--source", "model=m", code=1, line=(
        f"error: tensors[0].ops[0] dequant_scaled ({REPO / 'rules' / 'fp8_to_bf16.yaml'}:36): "
        "quantization_config.ignore[1] 're:model.(layers' is not a regular expression (missing ) at position 13); "
        "fix the pattern in the source's config.json"))


def test_a_catastrophic_ignore_pattern_of_the_source_config_is_stopped_not_run_for_ever(case: Any) -> None:
    _compressed_fp8_source(case, ["re:(a|aa)+$"], module="a" * 200 + "b")
    case.fails("plan", "fp8_to_bf16", "--source", "model=m", code=1, line=(
        "error: quantization_config.ignore: 're:(a|aa)+$' was stopped after 1 s on the 201-character module "
        "'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa...': it backtracks catastrophically; rewrite "
        "it without nested or overlapping repetition such as '(a+)+'"))


# ---------------------------------------------------------------- 12: a special file as an extends base


@pytest.mark.parametrize(("make", "kind"), [
    (lambda p: __import__("os").mkfifo(p), "a FIFO (named pipe)"),
    (lambda p: p.symlink_to("/dev/zero"), "a character device"),
    (lambda p: p.mkdir(), "a directory"),
])
def test_an_extends_base_that_is_no_regular_file_is_named_as_the_rule_path_is(case: Case, make: Any,
                                                                              kind: str) -> None:
    make(case.root / "base.yaml")
    (case.root / "r.yaml").write_text("version: 1\nextends: base.yaml\n")
    case.fails("validate", "r.yaml", code=2, line=(
        f"r.yaml:2:10: extends: 'base.yaml' is {kind}, not a regular file (base.yaml); give the path of a YAML file"))
