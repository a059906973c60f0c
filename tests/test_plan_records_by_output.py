"""A source tensor a rule without ops copies whole into one output (keep, rename, cast) is
held in the plan as that output, its record made when read (issue 36, memory per
tensor): the records every reader sees say what they always said, in the same order;
the plan holds no ``TensorRecord`` for such a tensor, and planning no producer object
for its output."""

from __future__ import annotations

import gc
import json
import pickle
import struct
from pathlib import Path

import pytest
from conftest import read_audit

from ckptxform import api
from ckptxform.engine.plan import planner
from ckptxform.engine.plan.recipes import TensorRecord
from ckptxform.errors import PlanError


def _source(root: Path, tensors: dict[str, str]) -> None:
    """One safetensors file of [2, 4] zero tensors, key -> dtype."""
    root.mkdir(parents=True)
    header, offset = {}, 0
    for key, dtype in tensors.items():
        size = 8 * (4 if dtype == "F32" else 2)
        header[key] = {"dtype": dtype, "shape": [2, 4], "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    (root / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(offset))


_RULES = """\
version: 1
name: records
sources:
  model: {path: ./src}
convert: model
tensors:
  - match: 'keep\\..*'
  - match: 'cast\\..*'
    cast: float32
  - match: 'ren\\.(.*)'
    rename: 'renamed.\\1'
  - match: 'rencast\\.(.*)'
    rename: 'rc.\\1'
    cast: float32
  - key: 'tpl.{N}.w'
    to: 'templ.{N}.w'
  - key: 'tkeep.{N}.w'
    to: 'tkeep.{N}.w'
    cast: float32
  - match: 'f32\\..*'
    cast: float32
  - match: 'lent\\..*'
add:
  extra: {source: model, tensor: lent.a}
"""

#: (key, action, target, reason) as the audit has always said them
_EXPECTED = [
    ("keep.a", "loaded", "keep.a", "matched"),
    ("cast.a", "cast", "cast.a", "matched, cast BF16 -> F32"),
    ("ren.a", "renamed", "renamed.a", "matched, renamed to 'renamed.a'"),
    ("rencast.a", "renamed", "rc.a", "matched, renamed to 'rc.a', cast BF16 -> F32"),
    ("f32.a", "loaded", "f32.a", "matched"),
    # copied by its rule and by ``add``: the first verdict kept, both reasons said
    ("lent.a", "loaded", "lent.a", "matched; added as 'extra'"),
    # a template rule's groups are planned once every tensor is matched
    ("tpl.0.w", "renamed", "templ.0.w", "matched -> 'templ.0.w'"),
    ("tkeep.0.w", "loaded", "tkeep.0.w", "matched -> 'tkeep.0.w', cast BF16 -> F32"),
]


def _rules(tmp_path: Path, text: str = _RULES) -> Path:
    _source(tmp_path / "src", {key: "F32" if key.startswith("f32") else "BF16" for key, *_ in _EXPECTED})
    (tmp_path / "rules.yaml").write_text(text)
    return tmp_path / "rules.yaml"


def test_the_records_of_tensors_copied_whole_say_what_they_always_said(tmp_path: Path) -> None:
    plan = api.plan(_rules(tmp_path))
    got = [(r.key, r.action, r.target, r.reason) for r in plan.records]
    assert got == _EXPECTED
    at = f"{tmp_path / 'rules.yaml'}:"
    assert [(r.source, r.shape, r.dtype, r.rule) for r in plan.records][:2] == [
        ("model", (2, 4), "BF16", f"{at}7"), ("model", (2, 4), "BF16", f"{at}8")]
    assert plan.counts() == {"loaded": 4, "cast": 1, "renamed": 3}, plan.counts()
    assert plan.records[3] == list(plan.records)[3] and plan.records[-2:] == tuple(plan.records)[-2:]
    again = pickle.loads(pickle.dumps(plan))
    assert again.records == plan.records == tuple(plan.records)

    result = api.apply(tmp_path / "rules.yaml", out=tmp_path / "out", fsync=False)
    events = [e for e in read_audit(result.out) if e["event"] == "tensor"]
    assert [(e["key"], e["action"], e["target"], e["reason"]) for e in events] == _EXPECTED
    assert events[1] == {"event": "tensor", "source": "model", "key": "cast.a", "action": "cast",
                         "target": "cast.a", "shape": [2, 4], "dtype": "BF16", "rule": f"{at}8",
                         "reason": "matched, cast BF16 -> F32"}


def _refusal(rules: Path) -> str:
    with pytest.raises(PlanError) as err:
        api.plan(rules)
    return str(err.value)


def test_rules_sharing_a_line_keep_their_own_records(tmp_path: Path) -> None:
    """Two rules on one line of a flow-style file have one position, which an output names:
    their tensors' records and messages are held, not derived from it."""
    flow = ("version: 1\nname: flow\nsources:\n  model: {path: ./src}\nconvert: model\n"
            "tensors: [{match: 'tpl\\.(.*)', rename: 'x.\\1'}, {key: 'ren.{N}', to: 'x.{N}'}, {match: '.*'}]\n")
    _source(tmp_path / "src", {"tpl.a": "BF16", "ren.b": "BF16", "keep": "BF16"})
    (tmp_path / "rules.yaml").write_text(flow)
    plan = api.plan(tmp_path / "rules.yaml")
    assert [(r.key, r.action, r.reason) for r in plan.records] == [
        ("tpl.a", "renamed", "matched, renamed to 'x.a'"), ("keep", "loaded", "matched"),
        ("ren.b", "renamed", "matched -> 'x.b'")]
    _source(tmp_path / "src2", {"tpl.a": "BF16", "ren.a": "BF16"})
    (tmp_path / "rules.yaml").write_text(flow.replace("./src", "./src2"))
    at = f"{tmp_path / 'rules.yaml'}:6"
    assert _refusal(tmp_path / "rules.yaml").startswith(
        f"tensors[1] ({at}) (from model:ren.a) and tensors[0] ({at}) (from model:tpl.a) both write output key "
        "'x.a'; two tensors")


def test_a_producer_derived_from_its_output_is_named_as_before(tmp_path: Path) -> None:
    _source(tmp_path / "src", {"a": "BF16", "b": "BF16"})
    (tmp_path / "rules.yaml").write_text(
        "version: 1\nname: twice\nsources:\n  model: {path: ./src}\nconvert: model\ntensors:\n"
        "  - match: 'a(.*)'\n    rename: 'x\\1'\n  - match: 'b(.*)'\n    rename: 'x\\1'\n")
    at = f"{tmp_path / 'rules.yaml'}:"
    assert _refusal(tmp_path / "rules.yaml").startswith(
        f"tensors[1] ({at}9) (from model:b) and tensors[0] ({at}7) (from model:a) both write output key 'x'; "
        "two tensors")


def _alive(kind: str) -> int:
    return sum(1 for o in gc.get_objects() if type(o).__name__ == kind)


def test_a_plan_holds_no_record_or_producer_object_per_tensor_copied_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    count = 2000
    _source(tmp_path / "src", {f"model.layers.{i}.w": "BF16" for i in range(count)})
    (tmp_path / "rules.yaml").write_text(
        "version: 1\nname: many\nsources:\n  model: {path: ./src}\nconvert: model\ntensors:\n"
        "  - match: 'model\\.layers\\.(\\d+)\\.w'\n    rename: 'layers.\\1.w'\n")
    during: list[int] = []
    check = planner.check_requirements
    # counted against what earlier tests left alive (a suite's leftovers are not this plan's;
    # a refused plan's are garbage in cycles with its traceback: collected first)
    gc.collect()
    records_before = _alive(TensorRecord.__name__)
    reads_before = _alive("RuleRead") + _alive("_RuleRead")

    def counting(*args: object) -> None:  # called once every output is planned
        during.append(_alive("RuleRead") + _alive("_RuleRead") - reads_before)
        check(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(planner, "check_requirements", counting)
    plan = api.plan(tmp_path / "rules.yaml")
    assert len(plan.records) == count and len(plan.outputs) == count
    # each held as its output (~104 bytes a tensor as a TensorRecord), each producer said by
    # its output (a RuleRead and a dict entry, ~95 bytes an output while planning)
    assert during == [0]
    assert _alive(TensorRecord.__name__) - records_before < 10
    assert sum(1 for _ in plan.records) == count
