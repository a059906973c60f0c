"""``apply --executor ray`` on a real local Ray cluster of two nodes (``ray.cluster_utils.Cluster``,
stopped by the handles of the processes it started, never ``ray stop``).

Needs the 'ray' extra (``pip install torch==2.13.0 -e ".[test,ray]"``); CI runs it in its
own step (``pytest -m ray``). Same stand-ins and rules as tests/test_resume.py: outputs are
compared byte for byte with its uninterrupted ``--jobs 1`` run; the Hub cases are those of
tests/test_hub_shards.py, against its ``--jobs 1`` run.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_hub_e2e import Served, served  # noqa: F401 (fixture: served)
from test_hub_shards import (  # noqa: F401 (fixtures: one_process, sharded_rule)
    SHARDS, apply_from_hub, assert_one_task_failed, assert_same_output, changed_on_the_cdn, fetches, one_process,
    sharded_rule, written_shard)
from test_resume import (  # noqa: F401 (fixtures: reference, rules, standins)
    cmdline, command, files, job_dirs, reference, rules, run, run_killing_one, standins)

from ckptxform.errors import SourceChangedError
from ckptxform.standins import HeadlineStandins

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A head node and a second node, one CPU each, so that tasks land on both. Skipped
    here, not at import, so that another step's ``-m`` deselects these tests cleanly."""
    pytest.importorskip("ray", reason="the Ray executor's tests need the 'ray' extra: "
                                      "pip install torch==2.13.0 -e '.[test,ray]'")
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        nodes.add_node(num_cpus=1)
        nodes.wait_for_nodes()
        yield nodes
    finally:
        nodes.shutdown()


def on_ray(rules: Path, standins: HeadlineStandins, out: Path, cluster: Any, *extra: str) -> list[str]:
    return command(rules, standins, out, "--executor", "ray", "--ray-address", cluster.address, *extra)


def test_the_cluster_has_two_nodes(cluster: Any) -> None:
    assert len(cluster.list_all_nodes()) == 2


def test_output_and_audit_are_the_local_executors(rules: Path, standins: HeadlineStandins, cluster: Any,
                                                   reference: dict[str, str], tmp_path: Path) -> None:
    """The 13-shard job; each task forbids planning in its worker (tests/test_run_tasks.py),
    so a run that finishes is one whose Ray workers never planned."""
    out = tmp_path / "out"
    proc = run(on_ray(rules, standins, out, cluster))
    assert proc.returncode == 0, proc.stderr
    assert files(out) == reference
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_exception_in_one_task_is_one_clean_error_naming_its_shard_and_no_output(
        served: Served, sharded_rule: Path, one_process: Path, cluster: Any, tmp_path: Path) -> None:
    """The verifier's file changes on the CDN after the plan read its header (why this
    failure: tests/test_hub_shards.py, where ``--jobs 2`` meets it too): only the task that
    reads its rows fails, with the error ``--jobs 2`` gives; the others finish or are
    cancelled, and a rerun keeps those that finished."""
    shard = written_shard(one_process, "lm_head.weight")
    try:
        reason = changed_on_the_cdn(served, tmp_path)
        proc = apply_from_hub(served, sharded_rule, tmp_path, "--executor", "ray", "--ray-address", cluster.address)
    finally:
        served.server.clear_faults()
    kept = assert_one_task_failed(proc, tmp_path, shard, reason)

    again = apply_from_hub(served, sharded_rule, tmp_path, "--executor", "ray", "--ray-address", cluster.address,
                           "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["shards_kept"] == kept
    assert_same_output(tmp_path / "out", one_process)


def test_a_hub_sources_output_and_audit_are_the_local_executors(
        served: Served, sharded_rule: Path, one_process: Path, cluster: Any, tmp_path: Path) -> None:
    """The tasks take the run's HF_* settings (which Hub, which cache) and send their
    fetch events back in their records: the audit is one process's."""
    proc = apply_from_hub(served, sharded_rule, tmp_path, "--executor", "ray", "--ray-address", cluster.address)
    assert proc.returncode == 0, proc.stderr
    assert_same_output(tmp_path / "out", one_process)
    assert len(fetches(tmp_path / "out")) == SHARDS + 1


def test_sources_changed_after_the_plan_make_every_worker_refuse_in_one_clean_error(
        rules: Path, standins: HeadlineStandins, cluster: Any, tmp_path: Path) -> None:
    """The drafter's weights change after the run planned them: every task opens the
    pinned sources, finds the file's pin moved and refuses; the run reports one task's
    error, naming its shard and the file, and leaves nothing (no shard finished, so there
    is nothing to resume)."""
    import shutil

    from ckptxform import api
    from ckptxform.engine.run.execute import execute
    from ckptxform.engine.run.options import RunOptions

    drafter = tmp_path / "drafter"
    shutil.copytree(standins.sources["drafter"], drafter)
    plan, opened = api.plan_open(rules, sources={**standins.sources, "drafter": str(drafter)})
    try:
        weights = sorted(drafter.glob("*.safetensors"))[0]
        os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
        out = tmp_path / "out"
        with pytest.raises(SourceChangedError) as caught:
            execute(plan, opened, out, progress=False,
                    options=RunOptions(executor="ray", ray_address=cluster.address))
    finally:
        opened.close()
    assert re.fullmatch(rf"shard 'model-000\d\d-of-00013\.safetensors': {re.escape(repr(str(weights.resolve())))} "
                        r"changed while ckptxform was reading it \(it was written to\); no output was written; "
                        r"rerun once nothing writes to it", str(caught.value)), str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]  # no output, no job, no lock


def test_tasks_take_the_runs_hub_settings_but_never_its_token() -> None:
    """A worker must read the Hub the run planned against; a token passed to Ray
    would be kept in the cluster's metadata."""
    from ckptxform.engine.run.ray import task_settings

    run_env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": "/shared/hf", "HF_HUB_OFFLINE": "1",
               "HF_TOKEN": "hf_secret", "CKPTXFORM_HUB_LINK": "rtt=0.05,bandwidth=1e5", "PATH": "/usr/bin",
               "HOME": "/root"}
    assert task_settings(run_env) == {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": "/shared/hf",
                                      "HF_HUB_OFFLINE": "1", "CKPTXFORM_HUB_LINK": "rtt=0.05,bandwidth=1e5"}


def test_a_worker_killed_once_is_retried_and_the_output_is_still_correct(
        rules: Path, standins: HeadlineStandins, cluster: Any, reference: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"

    def busy_ray_worker(_run: int) -> list[int]:
        return [pid for pid in _pids() if cmdline(pid).startswith(b"ray::_ray_shard")]

    proc = run_killing_one(on_ray(rules, standins, out, cluster, "--json"), busy_ray_worker)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["status"] == "ok"
    assert files(out) == reference
    assert job_dirs(out) == []


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]
