"""A plan is a value (issue 21 item 2): ``api.plan`` returns it with its sources closed,
it holds no open checkpoint (it pickles, and no file of a source stays open), and the
handle ``api.plan_open`` returns beside it is what a run reads through."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

from ckptxform import api
from ckptxform.engine.run.execute import execute
from ckptxform.standins.headline import HeadlineStandins


def _open_files_under(root: Path) -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(root)):
            out.append(target)
    return out


def test_a_plan_holds_no_open_source(headline: HeadlineStandins, headline_rule: Path) -> None:
    root = Path(headline.sources["drafter"]).resolve().parent
    plan = api.plan(headline_rule, sources=headline.sources)
    assert _open_files_under(root) == []
    again = pickle.loads(pickle.dumps(plan))  # a value: an open checkpoint (a lock, a descriptor) would not pickle
    assert again.outputs == plan.outputs and again.records == plan.records
    pinned = {pin.path for pin in plan.files_read()}
    assert str(Path(headline.sources["drafter"]).resolve() / "model.safetensors") in pinned


def test_the_open_sources_are_the_callers_to_close(headline: HeadlineStandins, headline_rule: Path,
                                                   tmp_path: Path) -> None:
    root = Path(headline.sources["drafter"]).resolve().parent
    plan, opened = api.plan_open(headline_rule, sources=headline.sources)
    with opened:
        result = execute(plan, opened, tmp_path / "out", progress=False)
        assert result.plan is plan
    assert _open_files_under(root) == []
    assert (tmp_path / "out" / "model.safetensors").is_file()
