"""The commit's written tensors are merged from the shard records in key order, each
output with its own digest; records that do not cover the plan's outputs exactly are
refused, never read at another tensor's place."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from ckptxform.engine.output.digest_table import TensorDigests
from ckptxform.engine.output.shard_record import ShardRecord, read_record
from ckptxform.engine.run.written_order import written_in_order
from ckptxform.errors import OutputError


def _written(tmp_path: Path, planned: list[str], recorded: dict[str, list[str]]) -> list[tuple[str, str, str]]:
    """(key, file, digest) of each written tensor, ``recorded``: file -> its keys in file order."""
    plan = SimpleNamespace(outputs=[SimpleNamespace(key=key, shape=(2,), dtype="BF16", nbytes=4, origin=dict)
                                    for key in sorted(planned)])
    shards = [SimpleNamespace(file=file) for file in recorded]
    job = SimpleNamespace(identity={"algorithm": "blake3"}, path=tmp_path,
                          record_path=lambda shard: tmp_path / f"{shard.file}.record.json")
    for file, keys in recorded.items():
        digests = TensorDigests.from_raw(keys, (key.encode().ljust(32, b".") for key in keys))
        with job.record_path(SimpleNamespace(file=file)).open("w") as out:
            ShardRecord(file, 0, "", "blake3", digests, 0, 0, (), 0, ((0, 0),) * len(keys)).write(out)
    layout = SimpleNamespace(shards=shards)
    return [(w.key, w.file, w.digest) for w in written_in_order(plan, layout, job)]  # type: ignore[arg-type]


def _digest(key: str) -> str:
    return key.encode().ljust(32, b".").hex()


def test_every_planned_output_is_found_in_the_records_in_key_order(tmp_path: Path) -> None:
    # key ranges that interleave across shards, each shard's keys out of order in its file
    written = _written(tmp_path, ["a", "b", "c", "d", "e"], {"one.safetensors": ["d", "a"],
                                                             "two.safetensors": ["e", "b", "c"]})
    assert written == [("a", "one.safetensors", _digest("a")), ("b", "two.safetensors", _digest("b")),
                       ("c", "two.safetensors", _digest("c")), ("d", "one.safetensors", _digest("d")),
                       ("e", "two.safetensors", _digest("e"))]


def test_an_output_no_record_has_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^no shard record has tensor 'b', which the plan writes$"):
        _written(tmp_path, ["a", "b", "c"], {"model.safetensors": ["c", "a"]})
    with pytest.raises(ValueError, match=r"^no shard record has tensor 'c', which the plan writes$"):
        _written(tmp_path, ["a", "b", "c"], {"model.safetensors": ["b", "a"]})


def test_a_recorded_tensor_the_plan_does_not_write_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^the record of model\.safetensors has tensor 'x', which the plan does not write$"):
        _written(tmp_path, ["a"], {"model.safetensors": ["a", "x"]})


def test_a_record_whose_lines_are_out_of_key_order_is_refused(tmp_path: Path) -> None:
    """The merge relies on each record's key order: a record edited out of it is not read."""
    _written(tmp_path, ["a", "b"], {"model.safetensors": ["a", "b"]})
    path = tmp_path / "model.safetensors.record.json"
    head, first, second = path.read_text().splitlines(keepends=True)
    path.write_text(head + second + first)
    assert read_record(path) is None  # a rerun does not keep it
    plan = SimpleNamespace(outputs=[SimpleNamespace(key=key, shape=(2,), dtype="BF16", nbytes=4, origin=dict)
                                    for key in "ab"])
    job = SimpleNamespace(identity={"algorithm": "blake3"}, path=tmp_path, record_path=lambda shard: path)
    layout = SimpleNamespace(shards=[SimpleNamespace(file="model.safetensors")])
    with pytest.raises((OutputError, ValueError)):  # never merged out of order
        list(written_in_order(plan, layout, job))  # type: ignore[arg-type]
    path.write_text(head + first + '["b", 1,\n')  # cut short
    with pytest.raises(OutputError, match="the record of finished shard 'model.safetensors'"):
        list(written_in_order(plan, layout, job))  # type: ignore[arg-type]


def test_a_record_reads_back_as_it_was_written(tmp_path: Path) -> None:
    keys = ["z", "a\nb", "\u00e9", "m"]
    digests = TensorDigests.from_raw(keys, (bytes([n]) * 32 for n in range(len(keys))))
    record = ShardRecord("model.safetensors", 96, "ab" * 32, "blake3", digests, 7, 8, ({"event": "fetch"},), 3,
                         ((0, 2), (1, 1), (0, 0), (2, 0)))
    path = tmp_path / "r.record.json"
    with path.open("w") as out:
        record.write(out)
    assert read_record(path) == record
    head, *lines = path.read_text().splitlines(keepends=True)
    for broken in ('["a"]\n', '[]\n', '{}\n', '["a", 9, "00", 0, 0]\n', '["a", 0, "0", 0, 0]\n', "["):
        path.write_text(head + broken + "".join(lines[1:]))
        assert read_record(path) is None, broken


def test_the_written_tensors_an_apply_returns_are_its_audit_s(tmp_path: Path) -> None:
    """``ApplyResult.written`` reads the audit's ``written`` records back when asked for,
    by index (past and across its marks), slice and iteration, in key order."""
    from test_scale_growth import _many_tensors

    from ckptxform.api import apply
    from ckptxform.engine.run.result import MARK_EVERY, WrittenTensor

    count = 2 * MARK_EVERY + 8  # 4 source files of as many tensors
    result = apply(_many_tensors(tmp_path, count), out=tmp_path / "out", jobs=1, fsync=False)
    events = [json.loads(line) for line in (tmp_path / "out" / "ckptxform_audit.jsonl").read_text().splitlines()]
    expected = [WrittenTensor.from_event(e) for e in events if e["event"] == "written"]
    assert len(expected) == count and [w.key for w in expected] == sorted(w.key for w in expected)
    written = result.written
    assert len(written) == count and list(written) == expected
    for i in (0, 1, MARK_EVERY - 1, MARK_EVERY, MARK_EVERY + 1, 2 * MARK_EVERY, count - 1, -1, -count):
        assert written[i] == expected[i], i
    assert written[MARK_EVERY - 2:MARK_EVERY + 3] == tuple(expected[MARK_EVERY - 2:MARK_EVERY + 3])
    assert written[::97] == tuple(expected[::97]) and written[5:2] == ()
    with pytest.raises(IndexError):
        written[count]
