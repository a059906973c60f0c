"""Shard tasks in worker processes reading Hub sources: ``apply --jobs 2`` against one
process, with the real ``ckptxform`` command and the real huggingface_hub client against
``hubserver.HubServer`` (the repos of tests/test_hub_e2e.py), the headline rule cut into
5 output shards. tests/test_ray_executor.py runs the same cases on a Ray cluster.

What differs between two runs of the same conversion, and only that, is left out of the
audits compared (``comparable``): the run's start time and each fetch's ``seconds``. The
link is ``TEST_LINK`` (``CKPTXFORM_HUB_LINK``), so a fetch's ``estimate`` is the same in
every process; with a measured link it would hold each process's own measurement. And a
file that several shards read and a download fetches could legitimately say ``download``
in two workers where one process downloads it once and then finds it ``cached``; no file
here is downloaded (ranges beat a download on this slow link).
"""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, error_lines, read_audit
from hubserver import hub_file
from test_hub_e2e import (  # noqa: F401 (fixture: served)
    REPOS, RULE, Served, lm_head_shard, served, sources)
from test_resume import files, job_dirs, records

SHARDS = 5  # what max_shard_size 64KB makes of the e2e stand-ins


@pytest.fixture(scope="module")
def sharded_rule(tmp_path_factory: pytest.TempPathFactory) -> Path:
    text = (REPO / RULE).read_text()
    assert text.count("  max_shard_size: 5GB") == 1
    path = tmp_path_factory.mktemp("hub-shards-rules") / "sharded.yaml"
    path.write_text(text.replace("  max_shard_size: 5GB", "  max_shard_size: 64KB"))
    return path


def apply_from_hub(served: Served, rule: Path, run_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """``apply`` of ``rule`` from the three repos into ``run_dir/out``, with a Hugging Face
    cache of its own (so that each run fetches what the conversion needs)."""
    return served.cli(served.env(run_dir / "home"), "apply", rule, *sources(served, "main"),
                      "--out", run_dir / "out", *extra)


@pytest.fixture(scope="module")
def one_process(served: Served, sharded_rule: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output of ``--jobs 1``: what every executor must write."""
    run_dir = tmp_path_factory.mktemp("hub-shards-one-process")
    proc = apply_from_hub(served, sharded_rule, run_dir, "--jobs", "1")
    assert proc.returncode == 0, proc.stderr
    assert len(list((run_dir / "out").glob("*.safetensors"))) == SHARDS
    return run_dir / "out"


def comparable(out: Path) -> list[dict[str, Any]]:
    """The audit of ``out`` without what legitimately differs between two runs."""
    events = read_audit(out)
    for event in events:
        if event["event"] == "run":
            del event["started"]
        elif event["event"] == "fetch":
            event.pop("seconds", None)  # a cached file's event has none
        elif event["event"] == "summary":
            del event["jobs"]  # how many processes ran it, and why
    return events


def fetches(out: Path) -> list[tuple[str, str, str]]:
    return [(e["source"], e["file"], e["choice"]) for e in read_audit(out) if e["event"] == "fetch"]


def assert_same_output(out: Path, one_process: Path) -> None:
    assert {k: v for k, v in files(out).items() if k != "ckptxform_audit.jsonl"} == \
        {k: v for k, v in files(one_process).items() if k != "ckptxform_audit.jsonl"}
    assert comparable(out) == comparable(one_process)


def test_worker_processes_audit_the_hub_fetches_one_process_audits(
        served: Served, sharded_rule: Path, one_process: Path, tmp_path: Path) -> None:
    """Each shard's fetch events travel back in its record: the workers' fetches are in
    the audit, as one process writes them (every shard reads the drafter, whose file came
    whole with its header; the lm_head shard reads the verifier's rows by ranges)."""
    proc = apply_from_hub(served, sharded_rule, tmp_path, "--jobs", "2")
    assert proc.returncode == 0, proc.stderr
    assert_same_output(tmp_path / "out", one_process)
    assert fetches(tmp_path / "out") == [("drafter", "model.safetensors", "cached")] * SHARDS + [
        ("verifier", lm_head_shard(served), "ranges")]


def changed_on_the_cdn(served: Served, tmp_path: Path) -> str:
    """Make the CDN serve other bytes (and ETag) of the verifier's lm_head shard from its
    second request on: the plan's header read is the first. The reason the run must fail with."""
    shard = lm_head_shard(served)
    original = served.folders[REPOS["verifier"]] / shard
    blob = bytearray(original.read_bytes())
    blob[-1] ^= 0xFF
    (tmp_path / shard).write_bytes(bytes(blob))
    other = hub_file(shard, tmp_path / shard)
    served.server.misbehave(f"/{REPOS['verifier']}/resolve/*/{shard}", "swap", host="cdn", skip=1, times=1000,
                            other=other)
    etag = hashlib.md5(hashlib.sha256(original.read_bytes()).hexdigest().encode()).hexdigest()
    return (f"source 'verifier' (Hub repo {REPOS['verifier']}@main): file {shard!r}: changed on the server during "
            f"the run (ETag '\"{etag}\"' at the first read, '\"{hashlib.md5(other.sha256.encode()).hexdigest()}\"' "
            "now); rerun to read one version")


def written_shard(out: Path, key: str) -> str:
    """The output shard holding ``key``."""
    return str(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"][key])


def assert_one_task_failed(proc: subprocess.CompletedProcess[str], run_dir: Path, shard: str, reason: str) -> int:
    """Exit 1 with one error line naming ``shard`` and ``reason``, no traceback, no output
    (nor its temporary sibling). A failed run keeps its job directory with the shards that
    finished, for the rerun to resume (the issue's Build 3, README's Resume), and no record
    of ``shard``; none is left when no shard finished. How many shards it kept."""
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert error_lines(proc.stderr) == [f"error: shard {shard!r}: {reason}"]
    out = run_dir / "out"
    assert not out.exists() and not list(run_dir.glob(".out.ckptxform-tmp-*"))
    kept = [p.name.removesuffix(".record.json") for job in job_dirs(out) for p in job.glob("*.record.json")]
    assert shard not in kept
    assert len(job_dirs(out)) == (1 if kept else 0)
    return len(kept)


def test_a_file_changed_on_the_cdn_after_the_plan_fails_only_the_task_reading_it(
        served: Served, sharded_rule: Path, one_process: Path, tmp_path: Path) -> None:
    """A real failure of one task that no plan-time check can ever catch: the plan read
    the verifier shard's header from one object, then the CDN serves another (same size,
    other bytes and ETag). Workers plan again from headers (the plan's reads, in the range
    cache), so their plans are the run's; only the task writing the lm_head shard reads
    that file's bytes, and it refuses the other object because the run gave its workers
    the ETags it read first (without them each worker took its first answer as the file's
    and mixed two objects silently). The other tasks finish; the rerun keeps them."""
    shard = written_shard(one_process, "lm_head.weight")
    assert shard == f"model-00004-of-{SHARDS:05d}.safetensors"
    try:
        reason = changed_on_the_cdn(served, tmp_path)
        proc = apply_from_hub(served, sharded_rule, tmp_path, "--jobs", "2")
    finally:
        served.server.clear_faults()
    kept = assert_one_task_failed(proc, tmp_path, shard, reason)
    assert kept >= 2  # two tasks at a time, in order: the 4th began once two had finished

    again = apply_from_hub(served, sharded_rule, tmp_path, "--jobs", "2", "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["shards_kept"] == kept
    assert_same_output(tmp_path / "out", one_process)  # the kept shards' fetch events came from their records


def test_ctrl_c_under_jobs_2_ends_the_run_within_a_second_and_keeps_the_finished_shards(
        served: Served, sharded_rule: Path, tmp_path: Path) -> None:
    """The task writing the lm_head shard waits on a CDN trickling the verifier's rows (a
    byte every 5 s) while the other shards finish; Ctrl-C then kills the workers at once
    instead of waiting for the running task (about 8 s on a real model before) and the
    process ends without tearing the interpreter down (0.6-1 s here)."""
    shard = lm_head_shard(served)
    out = tmp_path / "out"
    served.server.misbehave(f"/{REPOS['verifier']}/resolve/*/{shard}", "trickle", host="cdn", skip=1, times=1000,
                            delay=5.0)
    argv = [sys.executable, "-m", "ckptxform", "apply", str(sharded_rule), *sources(served, "main"),
            "--out", str(out), "--jobs", "2"]
    log = tmp_path / "stderr"
    # stderr to a file, not a pipe: what is timed is the command's exit, as a shell sees it
    with log.open("w") as err:
        proc = subprocess.Popen(argv, env=served.env(tmp_path / "home"), cwd=REPO, stdout=subprocess.DEVNULL,
                                stderr=err)
    try:
        deadline = time.monotonic() + 120
        while records(out) < SHARDS - 1 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert records(out) == SHARDS - 1 and proc.poll() is None, log.read_text()
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        took = time.monotonic() - sent
    finally:
        served.server.clear_faults()
        proc.kill()
    stderr = log.read_text()
    assert proc.returncode == 130, stderr
    assert took < 1.0, f"{took:.2f} s from Ctrl-C to exit"
    assert stderr.splitlines()[-1] == "interrupted", stderr
    assert f"{SHARDS - 1} finished shard(s) are kept" in stderr
    assert records(out) == SHARDS - 1
