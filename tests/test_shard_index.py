"""A sharded safetensors source holds ~10 bytes a tensor between lookups
(ckptxform/sources/shard_index.py, key_table.py, index_scan.py, lazy_index.py): its index as
a key's hash and file number, no key string, no dict of every key; the headers it read, a
few at a time. The index is scanned a block at a time, read exactly as json reads it, and
refused with the strict reader's own error."""

from __future__ import annotations

import gc
import json
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scale_growth import _many_tensors

from ckptxform.errors import CheckpointFormatError, FileTooLargeError, SourceChangedError
from ckptxform.fileio import read_small_file
from ckptxform.sources import lazy_index
from ckptxform.sources.header_columns import ShardColumns
from ckptxform.sources.lazy_index import LazyTensors
from ckptxform.sources.local import open_local
from ckptxform.sources.safetensors_header import parse_index_json
from ckptxform.sources.shard_index import open_shard_index


def _held_after_reading_every_tensor(root: Path, count: int) -> int:
    _many_tensors(root, count, shards=count // 250)  # 250 tensors a shard: a shard's columns, a constant
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        ckpt = open_local(root / "src")
        for key in ckpt.tensors:  # every header read, every tensor looked up
            assert ckpt.tensors[key].key == key
        assert ckpt.tensors.header_reads == count // 250  # file by file: none read twice
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
        ckpt.close()
    finally:
        tracemalloc.stop()
    return held


def test_an_opened_sharded_source_holds_a_few_bytes_a_tensor(tmp_path: Path, monkeypatch: Any) -> None:
    # headers kept: the one read last (the cache bound is bytes, not tensors: a plan of a
    # million tensors holds no more of them than one of a thousand)
    monkeypatch.setattr(lazy_index, "HEADER_CACHE_BYTES", 1)
    small = _held_after_reading_every_tensor(tmp_path / "n", 2000)
    large = _held_after_reading_every_tensor(tmp_path / "4n", 8000)
    # ~10 measured (8 for a key's hash and file, 1 of bucket starts); a dict of every key
    # (31) with its strings (87) and every header's columns held: ~147
    assert (large - small) / 6000 < 24, (small, large)


def test_a_header_read_again_is_read_from_the_file_it_pinned(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(lazy_index, "HEADER_CACHE_BYTES", 1)
    _many_tensors(tmp_path, 40, shards=4)
    with open_local(tmp_path / "src") as ckpt:
        first, second = ckpt.files[0], ckpt.files[1]
        key = ckpt.tensors.keys_of(first)[0]
        info = ckpt.tensors[key]
        ckpt.tensors[ckpt.tensors.keys_of(second)[0]]  # the first shard's header dropped
        assert ckpt.tensors[key] == info and ckpt.tensors.header_reads == 3
        assert ckpt.tensors.loaded_files == (first, second)
        path = tmp_path / "src" / first
        path.write_bytes(path.read_bytes())  # the same bytes, written again mid-run
        ckpt.tensors[ckpt.tensors.keys_of(second)[0]]
        with pytest.raises(SourceChangedError, match="written to"):
            ckpt.tensors[key]


def test_the_index_is_read_from_the_file_a_run_at_a_time(tmp_path: Path) -> None:
    _many_tensors(tmp_path, 4000, shards=8)
    index_path = tmp_path / "src" / "model.safetensors.index.json"
    weight_map = json.loads(index_path.read_text())["weight_map"]
    with open_local(tmp_path / "src") as ckpt:
        index = ckpt.tensors.weight_map
        assert index.scanned and len(index) == len(ckpt.tensors) == 4000
        assert list(ckpt.tensor_keys()) == list(weight_map)  # the index's order
        for file in ckpt.files:
            assert ckpt.unread_header_keys(file) == tuple(sorted(k for k, f in weight_map.items() if f == file))
        assert not ckpt.tensors.loaded_files
        assert all(ckpt.tensors.weight_map[key] == file for key, file in weight_map.items())
        assert "model.layers.0.experts.0.w0.weight" in ckpt.tensors and "nope" not in ckpt.tensors
        # an index changed since it was read is not read again as if it had not
        index_path.write_text(index_path.read_text().replace("w0.weight", "w9.weight"))
        with pytest.raises(SourceChangedError):
            ckpt.unread_header_keys(ckpt.files[2])  # not read, not the last asked


def test_an_index_is_scanned_at_a_peak_of_a_few_dozen_bytes_a_key(tmp_path: Path) -> None:
    count = 100_000
    path = tmp_path / "model.safetensors.index.json"
    path.write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": {
        f"model.layers.{i // 3000}.experts.{i}.w{i % 3}.weight": f"model-{i % 64 + 1:05d}-of-00064.safetensors"
        for i in range(count)}}, indent=2))
    gc.collect()
    tracemalloc.start()
    try:
        index = open_shard_index(path, label="i.json", shard_suffix=".safetensors", limit=1 << 30,
                                 read_bytes=path.read_bytes)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert index.scanned and len(index) == count
    # ~19 bytes a key at the peak (the scan's hashes and numbers, then the table) and 1 MB
    # blocks of text; json.loads' dict of strings: ~230 bytes a key above the text
    assert peak / count < 60 and held / count < 12, (peak / count, held / count)


def test_two_keys_of_one_hash_are_told_apart_by_their_headers() -> None:
    class Same(str):
        def __hash__(self) -> int:
            return 7

    a, b = Same("a"), Same("b")
    columns = {"x.safetensors": ShardColumns("x.safetensors", 100, [(a, "F32", (1,), 0)]),
               "y.safetensors": ShardColumns("y.safetensors", 100, [(b, "F32", (2,), 0)])}
    tensors = LazyTensors({a: "x.safetensors", b: "y.safetensors"}, ("x.safetensors", "y.safetensors"),
                          columns.__getitem__)
    assert tensors.weight_map.clashes
    assert tensors[b].shape == (2,) and tensors[a].shape == (1,)
    assert b in tensors and Same("c") not in tensors
    with pytest.raises(KeyError):
        tensors[Same("c")]


# -- read as json reads it, refused as the strict reader refuses ------------------------------
_names = st.text(alphabet='ab".\\/ \u00e9\u2028\n\x01', max_size=4)
_files = st.sampled_from(["s1.safetensors", "s2.safetensors", "s\\u0031.safetensors", "../x.safetensors",
                          "s3.bin", 'a"b.safetensors'])
_others = st.sampled_from(['"metadata": {"total_size": 1}', '"metadata": {"a": NaN}', '"m": [1, {"k": 2, "k": 3}]',
                           '"weight_map": {}', '"x": 1e999', '"\\ud800": 1'])


def _index_text(pairs: list[tuple[str, str]], before: list[str], after: list[str], space: str) -> str:
    body = ",".join(f"{space}{json.dumps(k)}{space}:{space}\"{f}\"" for k, f in pairs)
    members = [*before, f'"weight_map"{space}:{space}{{{body}{space}}}', *after]
    return "{" + f",{space}".join(members) + space + "}"


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(_names, _files), max_size=8), st.lists(_others, max_size=2),
       st.lists(_others, max_size=2), st.sampled_from(["", " ", "\n\t "]))
def test_a_scanned_index_reads_as_the_strict_reader_does(tmp_path_factory: Any, pairs: list[tuple[str, str]],
                                                         before: list[str], after: list[str], space: str) -> None:
    path = tmp_path_factory.mktemp("i") / "model.safetensors.index.json"
    path.write_text(_index_text(pairs, before, after, space), encoding="utf-8")
    try:
        expected: Any = parse_index_json(path.read_bytes(), label="i.json", shard_suffix=".safetensors")
    except CheckpointFormatError as err:
        expected = str(err)
    try:
        index = open_shard_index(path, label="i.json", shard_suffix=".safetensors", limit=1 << 20,
                                 read_bytes=path.read_bytes)
    except CheckpointFormatError as err:
        assert str(err) == expected
        return
    assert isinstance(expected, dict), expected
    assert index.scanned and dict(index.items()) == expected and list(index) == list(expected)
    for file in index.files:
        assert index.keys_of(file) == tuple(sorted(k for k, f in expected.items() if f == file))


def test_an_index_too_large_is_refused_as_before(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors.index.json"
    path.write_text(json.dumps({"weight_map": {f"k{i}": "a.safetensors" for i in range(100)}}))
    with pytest.raises(FileTooLargeError, match="too large"):
        open_shard_index(path, label="i.json", shard_suffix=".safetensors", limit=100,
                         read_bytes=lambda: read_small_file(path, 100, what="a shard index"))
