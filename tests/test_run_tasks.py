"""Shard tasks carry their slice of the plan: workers execute, never plan; one progress bar.

The 13-shard job of tests/test_resume.py (same stand-ins and rules). Every worker entry
(``tasks.run_shard``, in the process pool and on Ray) forbids planning in its process
(``planner.forbid_planning``): a worker that called the planner would fail its task,
so a run that finishes is a run whose workers never planned. tests/test_ray_executor.py
runs the same job on Ray.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from test_resume import (  # noqa: F401 (fixtures: reference, rules, standins)
    SHARDS, command, files, reference, rules, run, standins)

from ckptxform import api
from ckptxform.engine.output.jobdir import JobDir, job_identity
from ckptxform.engine.output.digest import run_digest
from ckptxform.engine.plan import planner
from ckptxform.engine.run.execute import execute, layout_of
from ckptxform.engine.run.shard_plan import CODEC, load_run_plan, slice_plan
from ckptxform.engine.run.tasks import first_etags, shard_tasks
from ckptxform.errors import CkptxformError, OutputError, PlanError, SourceChangedError
from ckptxform.standins import HeadlineStandins


def test_a_jobs_2_run_of_the_13_shard_job_never_plans_in_a_worker(
        rules: Path, standins: HeadlineStandins, reference: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run(command(rules, standins, out, "--jobs", "2"))
    assert proc.returncode == 0, proc.stderr  # a worker that planned would have failed its shard
    assert files(out) == reference
    assert len(list(out.glob("*.safetensors"))) == SHARDS


def test_a_process_that_must_not_plan_refuses_to(rules: Path, standins: HeadlineStandins,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """What every worker sets before its task: the guard the test above relies on."""
    monkeypatch.setattr(planner, "_NO_PLANNING", "a shard worker executes its task's slice of the run's plan")
    with pytest.raises(PlanError, match=r"^internal error: this process must not plan: a shard worker "):
        api.plan(rules, sources=standins.sources)


def test_the_job_directory_holds_the_run_plan_as_json_and_a_task_only_names_its_shard(
        rules: Path, standins: HeadlineStandins, tmp_path: Path) -> None:
    plan, opened = api.plan_open(rules, sources=standins.sources)
    with opened:
        layout = layout_of(plan, opened)
        job = JobDir(tmp_path / "out", job_identity(layout, "blake3", run_digest(plan)), fsync=False)
        job.open(layout, resume=False)
        tasks = shard_tasks(plan, opened, layout, job, list(range(len(layout.shards))))
        expected = slice_plan(plan, opened, list(layout.shards), first_etags(opened))
        assert load_run_plan(job, tasks[0].plan) == expected  # its shards made while the sources are open
    assert len(tasks) == SHARDS
    assert {task.plan for task in tasks} == {f"plan-{os.uname().nodename}-{os.getpid()}.json"}
    data = json.loads((job.path / tasks[0].plan).read_text())  # plain JSON: no pickle, no code
    assert CODEC.decode(data["plan"], "plan.json") == replace(expected, shards={})
    assert list(data["shards"]) == [task.file for task in tasks]  # a file a shard: a worker reads its own
    for task, shard in zip(tasks, layout.shards):
        work = CODEC.decode(json.loads((job.path / data["shards"][task.file]).read_text())["shard"], "plan.json")
        assert [o.key for o in work.outputs] == [p.spec.key for p in shard.tensors]
        assert work.shard.header == shard.header and work.shard.offsets == shard.offsets
        assert {key for _, key in work.reads} >= {ref.key for o in work.outputs for ref in o.recipe.inputs}
        pickled = pickle.dumps(task)  # what goes to a worker: the job directory and the shard
        for absent in (b"RuleSet", b"Checkpoint", b"OutputPlan"):
            assert absent not in pickled, absent


@pytest.mark.parametrize("edit, why", [
    (lambda plan: {**plan, "type": "Popen"}, r"\{'type': 'Popen', 'fields': .* is not a value a plan holds"),
    (lambda plan: {"op": "no_such_verb"}, r"\{'op': 'no_such_verb'\} is not a value a plan holds"),
    (lambda plan: {**plan, "fields": {**plan["fields"], "shell": "rm -rf /"}},
     r"not a RunPlan of a plan: .*unexpected keyword argument 'shell'"),
])
def test_an_edited_plan_file_is_refused_naming_it(edit: Any, why: str, rules: Path, standins: HeadlineStandins,
                                                  tmp_path: Path) -> None:
    plan, opened = api.plan_open(rules, sources=standins.sources)
    with opened:
        layout = layout_of(plan, opened)
        job = JobDir(tmp_path / "out", job_identity(layout, "blake3", run_digest(plan)), fsync=False)
        job.open(layout, resume=False)
        [task] = shard_tasks(plan, opened, layout, job, [0])
    path = job.path / task.plan
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "plan": edit(data["plan"])}))
    with pytest.raises(OutputError, match=rf"^{re.escape(str(path))}: {why}"):
        load_run_plan(job, task.plan)


def test_a_worker_that_finds_a_pinned_file_changed_fails_naming_it(
        rules: Path, standins: HeadlineStandins, tmp_path: Path) -> None:
    drafter = tmp_path / "drafter"
    shutil.copytree(standins.sources["drafter"], drafter)
    weights = sorted(drafter.glob("*.safetensors"))[0]
    plan, opened = api.plan_open(rules, sources={**standins.sources, "drafter": str(drafter)})
    with opened:
        os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
        with pytest.raises(SourceChangedError) as caught:
            execute(plan, opened, tmp_path / "out", jobs=2)
    assert re.fullmatch(rf"shard 'model-000\d\d-of-00013\.safetensors': {re.escape(repr(str(weights.resolve())))} "
                        r"changed while ckptxform was reading it \(it was written to\); no output was written; "
                        r"rerun once nothing writes to it", str(caught.value)), str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]  # no output, no job, no lock


def test_a_worker_that_cannot_open_a_pinned_source_fails_naming_it(
        rules: Path, standins: HeadlineStandins, tmp_path: Path) -> None:
    drafter = tmp_path / "drafter"
    shutil.copytree(standins.sources["drafter"], drafter)
    plan, opened = api.plan_open(rules, sources={**standins.sources, "drafter": str(drafter)})
    with opened:
        drafter.rename(tmp_path / "moved")
        with pytest.raises(CkptxformError) as caught:
            execute(plan, opened, tmp_path / "out", jobs=2)
    assert re.match(rf"shard 'model-000\d\d-of-00013\.safetensors': source 'drafter': {re.escape(repr(str(drafter)))} "
                    "does not exist", str(caught.value)), str(caught.value)
    assert not (tmp_path / "out").exists()


def test_one_bar_over_every_worker_reaches_100_percent(
        rules: Path, standins: HeadlineStandins, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = api.apply(rules, out=tmp_path / "out", sources=standins.sources, jobs=2, progress=True)
    err = capsys.readouterr().err
    states = re.findall(r"apply:\s+(\d+)%\|[^|]*\| ([\d.]+[kMG]?)/([\d.]+[kMG]?)", err)
    assert states, err
    assert states[-1][0] == "100" and states[-1][1] == states[-1][2], err
    # (how often it moves on the way depends on timing: workers report every 50 ms; not asserted)
    assert result.bytes_written == result.plan.total_bytes
