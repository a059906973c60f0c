"""JSON read strictly (ckptxform/sources/strict_json.py): a key given twice in any object is
refused wherever it hides, and a shard index is read without holding its pairs or its bytes."""

from __future__ import annotations

import json
import tracemalloc
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptxform.errors import CheckpointFormatError
from ckptxform.sources.safetensors_header import parse_index_json
from ckptxform.sources.strict_json import parse_json

TWICE = "twice in one JSON object; each name must appear once (the file is corrupt or crafted)"


@pytest.mark.parametrize(("text", "key"), [
    ('{"a": 1, "a": 2}', "'a'"),
    ('{"m": {"x": {"k": 1, "k": 1}}}', "'k'"),
    ('[{"k": 1}, {"j": 1, "j" : 2}]', "'j'"),
    # strings that hold what a key ends with: an escaped quote, a colon, backslashes
    (r'{"a\"": 1, "b\":": "\":", "a\"": 2}', "'a\"'"),
    (r'{"x": "\\\":", "y\\": 1, "y\\"' + '\n\t:\r 2}', "'y\\\\'"),
    ('{"\\u0061": 1, "a": 2}', "'a'"),
])
def test_a_key_twice_is_refused_wherever_it_is(text: str, key: str) -> None:
    with pytest.raises(CheckpointFormatError) as err:
        parse_json(text.encode(), "f.json", what="index", fix="re-download it")
    assert str(err.value) == f"f.json: index has key {key} {TWICE}"


@pytest.mark.parametrize("text", [
    r'{"a\"": 1, "a": 2, "b": {"a": 3}, "c": ["a", "a:", {"a": "a"}]}',
    '{"\\\\": "\\":", "\\\\\\"": ":", "k" :1}',
    '{}', '[]', '"a:"', '{"": {"": {"": null}}}',
])
def test_no_key_twice_reads_as_json_does(text: str) -> None:
    assert parse_json(text.encode(), "f.json", what="index", fix="x") == json.loads(text)


_keys = st.text(alphabet='ab":\\ \u00e9\n', max_size=3)
_values = st.recursive(st.none() | st.integers(-5, 5) | _keys,
                       lambda inner: st.lists(inner, max_size=3)
                       | st.lists(st.tuples(_keys, inner), max_size=4).map(lambda pairs: ("obj", pairs)),
                       max_leaves=12)


def _text(value: Any, space: str) -> str:
    """``value`` as JSON, an ("obj", pairs) an object that may repeat a key."""
    if isinstance(value, tuple):
        return "{" + ",".join(f"{json.dumps(k)}{space}:{space}{_text(v, space)}" for k, v in value[1]) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_text(v, space) for v in value) + "]"
    return json.dumps(value)


def _repeats(value: Any) -> bool:
    if isinstance(value, tuple):
        keys = [k for k, _ in value[1]]
        return len(set(keys)) != len(keys) or any(_repeats(v) for _, v in value[1])
    return isinstance(value, list) and any(_repeats(v) for v in value)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(_values, st.sampled_from(["", " ", "\n\t "]))
def test_a_key_twice_is_found_in_any_text(value: Any, space: str) -> None:
    text = _text(value, space)
    try:
        got = parse_json(text.encode(), "f.json", what="index", fix="x")
    except CheckpointFormatError as err:
        assert _repeats(value) and TWICE in str(err)
        return
    assert not _repeats(value) and got == json.loads(text)


def _index(count: int) -> bytes:
    return json.dumps({"metadata": {"total_size": 1}, "weight_map": {
        f"model.layers.{i // 3000}.experts.{i}.w{i % 3}.weight": f"model-{i % 64 + 1:05d}-of-00064.safetensors"
        for i in range(count)}}, indent=2).encode()


def test_a_shard_index_is_read_at_a_peak_of_a_few_times_its_size() -> None:
    # A million tensors' index is ~80 MB; its parse was the peak of planning them. The bytes
    # passed inline are freed once decoded, and no list of pairs is made.
    count = 30_000
    tracemalloc.start()
    try:
        blobs = [_index(count)]
        size = len(blobs[0])
        before = tracemalloc.get_traced_memory()[0]  # the file's bytes included
        tracemalloc.reset_peak()
        weight_map = parse_index_json(blobs.pop(), label="i.json", shard_suffix=".safetensors")
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert len(weight_map) == count
    # above the file's bytes: ~232 bytes a key (its text, json's strings and the weight_map
    # kept); ~391 with the bytes held through the parse and a tuple a pair
    assert peak / count < 300, (peak / count, size / count)
