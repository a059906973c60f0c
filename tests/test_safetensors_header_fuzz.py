"""Fuzzing the header and index parsers: whatever the bytes, the only exception that
escapes is ``CheckpointFormatError``; valid files parse to exactly what was written; and
on files the reference parser (the safetensors crate, through ``safetensors.deserialize``)
accepts, ckptxform agrees with it except where it is deliberately stricter."""

from __future__ import annotations

import contextlib
import itertools
import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import deserialize

from ckptxform.dtypes import DTYPE_SIZES, nbytes
from ckptxform.errors import CheckpointFormatError
from ckptxform.sources.base import TensorInfo
from ckptxform.sources.safetensors_header import (
    check_index_matches_shards,
    header_length,
    parse_header_json,
    parse_index_json,
    read_header,
)


# About 2,000 examples in all, a few seconds: cheap enough to run with every test run.
def fuzz(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


FILE = "model.safetensors"

names = st.text(st.characters(exclude_categories=("Cs",)), max_size=12).filter(
    lambda n: n != "__metadata__"
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)


def parse_file(raw: bytes) -> tuple[list[TensorInfo], dict[str, str]]:
    return read_header(lambda offset, n: raw[offset : offset + n], file=FILE, file_size=len(raw))


def encode(header: dict[str, Any], data: bytes, padding: int = 0) -> bytes:
    text = json.dumps(header).encode() + b" " * padding
    return len(text).to_bytes(8, "little") + text + data


@st.composite
def valid_layouts(
    draw: st.DrawFn,
) -> tuple[dict[str, Any], bytes, list[tuple[str, str, tuple[int, ...], bytes]]]:
    """A well-formed header (possibly with gaps between tensors), its data, and the
    (key, dtype, shape, bytes) it holds in offset order."""
    keys = draw(st.lists(names, unique=True, max_size=4))
    header: dict[str, Any] = {}
    metadata = draw(st.none() | st.dictionaries(names, names, max_size=3))
    if metadata is not None:
        header["__metadata__"] = metadata
    data = b""
    expected = []
    for key in keys:
        dtype = draw(st.sampled_from(sorted(DTYPE_SIZES)))
        shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
        data += bytes(draw(st.integers(0, 3)))  # a gap, allowed by ckptxform
        blob = draw(st.binary(min_size=nbytes(dtype, shape), max_size=nbytes(dtype, shape)))
        header[key] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [len(data), len(data) + len(blob)],
        }
        data += blob
        expected.append((key, dtype, shape, blob))
    return header, data, expected


@st.composite
def valid_files(draw: st.DrawFn) -> tuple[bytes, list[tuple[str, str, tuple[int, ...], bytes]]]:
    header, data, expected = draw(valid_layouts())
    return encode(header, data, draw(st.integers(0, 7))), expected


@st.composite
def byte_mutated_files(draw: st.DrawFn) -> bytes:
    raw = bytearray(draw(valid_files())[0])
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(raw)))
        kind = draw(st.sampled_from(["set", "delete", "insert", "digit"]))
        if kind == "set" and at < len(raw):
            raw[at] = draw(st.integers(0, 255))
        elif kind == "delete":
            del raw[at : at + draw(st.integers(1, 4))]
        elif kind == "insert":
            raw[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif at < len(raw):
            raw[at] = ord(draw(st.sampled_from('0123456789-"[]{},:')))
    return bytes(raw)


@st.composite
def value_mutated_files(draw: st.DrawFn) -> bytes:
    """Valid JSON with one or two wrong values: where the interesting checks live."""
    header, data, _ = draw(valid_layouts())
    keys = [k for k in header if k != "__metadata__"]
    for _ in range(draw(st.integers(1, 2))):
        if not keys:
            break
        entry = header[draw(st.sampled_from(keys))]
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        kind = draw(st.sampled_from(["nudge", "replace", "drop"]))
        if kind == "drop":
            entry.pop(field, None)
        elif kind == "replace":
            entry[field] = draw(json_values | st.sampled_from(["F4", "I128", "BF16", "U8"]))
        elif isinstance(entry.get(field), list) and entry[field]:
            at = draw(st.integers(0, len(entry[field]) - 1))
            if type(entry[field][at]) is int:
                entry[field][at] += draw(st.integers(-9, 9))
    data = data[: draw(st.integers(0, len(data)))] if draw(st.booleans()) else data
    return encode(header, data)


def check_invariants(raw: bytes, tensors: list[TensorInfo]) -> None:
    assert [t.offset for t in tensors] == sorted(t.offset for t in tensors)
    assert len({t.key for t in tensors}) == len(tensors)
    data_start = 8 + header_length(raw[:8], file_size=len(raw), label=FILE)
    spans = sorted((t.offset, t.offset + t.nbytes) for t in tensors if t.nbytes)
    for t in tensors:
        assert data_start <= t.offset and t.offset + t.nbytes <= len(raw)
        assert t.nbytes == nbytes(t.dtype, t.shape)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


def covers_data_exactly(raw: bytes, tensors: list[TensorInfo]) -> bool:
    """What the safetensors crate requires: spans back to back from the data start."""
    end = 8 + int.from_bytes(raw[:8], "little")
    for begin, stop in sorted((t.offset, t.offset + t.nbytes) for t in tensors):
        if begin != end:
            return False
        end = stop
    return end == len(raw)


def reference(raw: bytes) -> dict[str, tuple[str, tuple[int, ...], bytes]] | None:
    try:
        return {k: (v["dtype"], tuple(v["shape"]), bytes(v["data"])) for k, v in deserialize(raw)}
    except Exception:  # the reference rejected the file; any exception type will do
        return None


@fuzz(250)
@given(valid_files())
def test_valid_files_parse_to_what_was_written(case: tuple[bytes, list[Any]]) -> None:
    raw, expected = case
    tensors, _ = parse_file(raw)
    got = [(t.key, t.dtype, t.shape, raw[t.offset : t.offset + t.nbytes]) for t in tensors]
    assert sorted(got, key=lambda g: g[0]) == sorted(expected, key=lambda e: e[0])
    check_invariants(raw, tensors)


@fuzz(500)
@given(byte_mutated_files() | value_mutated_files())
def test_mutated_files_fail_cleanly_and_agree_with_the_reference(raw: bytes) -> None:
    theirs = reference(raw)
    try:
        tensors, _ = parse_file(raw)
    except CheckpointFormatError as err:
        # Deliberately stricter than the crate: a repeated key (the crate keeps the last
        # one) and dtypes ckptxform cannot convert. Nothing else may be refused.
        assert (
            theirs is None or "twice in one JSON object" in str(err) or "unknown dtype" in str(err)
        ), str(err)
        assert "\n" not in str(err)
        return
    check_invariants(raw, tensors)
    ours = {t.key: (t.dtype, t.shape, raw[t.offset : t.offset + t.nbytes]) for t in tensors}
    if theirs is not None:
        assert ours == theirs
    else:  # deliberately looser: gaps between tensors are accepted
        assert not covers_data_exactly(raw, tensors)


@fuzz(500)
@given(st.binary(max_size=64), st.none() | st.integers(0, 2**70))
def test_random_bytes_fail_cleanly(raw: bytes, file_size: int | None) -> None:
    with contextlib.suppress(CheckpointFormatError):
        header_length(raw[:8], file_size=file_size, label=FILE)
    with contextlib.suppress(CheckpointFormatError):
        parse_header_json(raw, file=FILE, file_size=file_size)
    with contextlib.suppress(CheckpointFormatError):
        parse_file(len(raw).to_bytes(8, "little") + raw)


entries = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.sampled_from(sorted(DTYPE_SIZES)) | json_values,
        "shape": st.lists(st.integers(-2, 4), max_size=3) | json_values,
        "data_offsets": st.lists(st.integers(-2, 40), max_size=3) | json_values,
    },
)


@fuzz(300)
@given(
    st.dictionaries(names | st.just("__metadata__"), entries | json_values, max_size=4)
    | json_values,
    st.binary(max_size=48),
)
def test_random_json_structures_fail_cleanly(header: Any, data: bytes) -> None:
    blob = json.dumps(header).encode()
    try:
        tensors, _ = parse_header_json(blob, file=FILE, file_size=8 + len(blob) + len(data))
    except CheckpointFormatError:
        return
    check_invariants(len(blob).to_bytes(8, "little") + blob + data, tensors)


indexes = st.fixed_dictionaries(
    {},
    optional={
        "weight_map": st.dictionaries(names, names | json_values, max_size=4) | json_values,
        "metadata": json_values,
    },
)


@fuzz(250)
@given(indexes | json_values)
def test_random_indexes_fail_cleanly(index: Any) -> None:
    try:
        weight_map = parse_index_json(
            json.dumps(index).encode(), label="i.json", shard_suffix=".safetensors"
        )
    except CheckpointFormatError:
        return
    assert all(
        v.endswith(".safetensors") and "/" not in v and "\\" not in v for v in weight_map.values()
    )


shard_names = st.sampled_from(["a.safetensors", "b.safetensors", "c.safetensors"])


@fuzz(250)
@given(
    st.dictionaries(st.sampled_from("pqrstu"), shard_names),
    st.dictionaries(shard_names, st.lists(st.sampled_from("pqrstu"), unique=True)),
)
def test_index_check_accepts_exactly_consistent_shards(
    weight_map: dict[str, str], shard_keys: dict[str, list[str]]
) -> None:
    # The caller reads every shard the index names, so each is in shard_keys.
    shard_keys = {s: shard_keys.get(s, []) for s in {*shard_keys, *weight_map.values()}}
    actual = [(k, s) for s, keys in shard_keys.items() for k in keys]
    consistent = sorted(actual) == sorted(weight_map.items())
    try:
        check_index_matches_shards(weight_map, shard_keys, label="i.json")
    except CheckpointFormatError:
        assert not consistent
    else:
        assert consistent
