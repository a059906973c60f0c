"""The commit's table of written tensors finds each output's digest in the shard records;
records that do not cover the plan's outputs exactly are refused, never read at another
tensor's place."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ckptxform.engine.output.digest_table import TensorDigests
from ckptxform.engine.run.job import _WrittenTable


def _table(planned: list[str], recorded: list[str]) -> _WrittenTable:
    plan = SimpleNamespace(outputs=[SimpleNamespace(key=key) for key in planned])
    layout = SimpleNamespace(shards=[SimpleNamespace(file="model.safetensors")])
    digests = TensorDigests.from_raw(recorded, (bytes([n]) * 32 for n in range(len(recorded))))
    record = SimpleNamespace(file="model.safetensors", digests=digests, moved=((0, 0),) * len(recorded))
    return _WrittenTable(plan, layout, {"model.safetensors": record}, "blake3")  # type: ignore[arg-type]


def test_every_planned_output_is_found_in_the_records() -> None:
    assert len(_table(["b", "a"], ["a", "b"])) == 2


def test_an_output_no_record_has_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^no shard record has tensor 'b', which the plan writes$"):
        _table(["a", "b", "c"], ["c", "a"])


def test_a_recorded_tensor_the_plan_does_not_write_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^the record of model\.safetensors has tensor 'x', which the plan does not write$"):
        _table(["a"], ["a", "x"])
