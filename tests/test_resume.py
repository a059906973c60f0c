"""Shard tasks in worker processes (``--jobs``) and resuming an interrupted apply.

The real command runs in a subprocess on headline stand-ins laid out in 13 shards; runs
are interrupted by SIGKILL (no cleanup code runs), either once a given number of shards
have been committed to the job directory (deterministic) or at random points of the
whole run. Outputs are compared byte for byte with an uninterrupted ``--jobs 1`` run,
and audits record for record except the start time.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import error_lines, source_args

from ckptxform.standins import KIMI_K2, HeadlineStandins, build_headline_standins

DIMS = KIMI_K2.scaled(hidden=256, head_dim=16, vocab=16384, draft_vocab=2048)
SHARDS = 13  # what max_shard_size 64KB makes of these stand-ins
RANDOM_KILLS = 6
POLL = 0.0005


@pytest.fixture(scope="module")
def standins(tmp_path_factory: pytest.TempPathFactory) -> HeadlineStandins:
    return build_headline_standins(tmp_path_factory.mktemp("resume-sources"), dims=DIMS, seed=7)


@pytest.fixture(scope="module")
def rules(tmp_path_factory: pytest.TempPathFactory, headline_rule: Path) -> Path:
    text = headline_rule.read_text()
    assert text.count("  max_shard_size: 5GB") == 1
    path = tmp_path_factory.mktemp("resume-rules") / "sharded.yaml"
    path.write_text(text.replace("  max_shard_size: 5GB", "  max_shard_size: 64KB"))
    return path


def command(rules: Path, standins: HeadlineStandins, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ckptxform", "apply", str(rules), *source_args(standins.sources),
            "--out", str(out), *extra]


def env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k != "CKPTXFORM_DEBUG"}, "NO_COLOR": "1"}


def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, env=env(), timeout=300, check=False)


def files(out: Path) -> dict[str, str]:
    """name -> sha256 of every file of an output, the audit without its start time and
    without how many processes ran it (the summary's ``jobs``: a rerun that resumes, a
    finalize of ranks and --jobs N each say their own)."""
    digests = {}
    for path in sorted(out.iterdir()):
        data = path.read_bytes()
        if path.name == "ckptxform_audit.jsonl":
            data = re.sub(rb'"started": "[^"]*"', b'"started": ""', data)
            data = re.sub(rb'"jobs": (\{[^{}]*\}|null)', b'"jobs": null', data)
        digests[path.name] = hashlib.sha256(data).hexdigest()
    return digests


def job_dirs(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.ckptxform-job-*"))


def records(out: Path) -> int:
    return sum(len(list(job.glob("*.record.json"))) for job in job_dirs(out))


def kill_after(argv: list[str], out: Path, shards: int) -> None:
    """Start ``argv`` and SIGKILL it once ``shards`` shards are committed to its job directory."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    try:
        while proc.poll() is None and records(out) < shards:
            time.sleep(POLL)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be interrupted"
    assert not out.exists() and records(out) >= shards


def interrupted(argv: list[str], out: Path, shards: int) -> tuple[Path, int]:
    """The job directory a run of ``argv`` SIGKILLed after ``shards`` shards left, and
    how many shards it holds."""
    kill_after(argv, out, shards)
    [job] = job_dirs(out)
    return job, records(out)


@pytest.fixture(scope="module")
def reference(rules: Path, standins: HeadlineStandins, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("resume-reference") / "out"
    proc = run(command(rules, standins, out, "--jobs", "1"))
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]) > SHARDS
    assert len(list(out.glob("*.safetensors"))) == SHARDS
    assert job_dirs(out) == []
    return files(out)


@pytest.mark.parametrize("jobs", ["2", "3"])
def test_worker_processes_write_the_same_bytes_and_audit_as_one_process(
        jobs: str, rules: Path, standins: HeadlineStandins, reference: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run(command(rules, standins, out, "--jobs", jobs))
    assert proc.returncode == 0, proc.stderr
    assert files(out) == reference
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no job directory, no lock left


def test_a_rerun_keeps_the_shards_a_killed_run_finished_and_writes_the_rest(
        rules: Path, standins: HeadlineStandins, reference: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    job, finished = interrupted(command(rules, standins, out, "--jobs", "1"), out, 4)
    stale = sorted(out.parent.glob(".out.ckptxform-tmp-*"))

    again = run(command(rules, standins, out, "--json"))
    assert again.returncode == 0, again.stderr
    result = json.loads(again.stdout)
    assert result["shards_kept"] == finished
    assert f"resuming from {job}: kept {finished} of {SHARDS} shard(s) an interrupted run had finished" in again.stderr
    for path in stale:  # the stale-sibling cleanup removes the temporary sibling, never the job
        assert f"removed {path} left by a killed ckptxform run" in again.stderr
    assert files(out) == reference
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_touch_of_every_source_file_keeps_the_finished_shards(
        rules: Path, standins: HeadlineStandins, reference: dict[str, str], tmp_path: Path) -> None:
    """Reruns are keyed on content (issue 35 item 6): a touch changes no byte."""
    copies = {name: shutil.copytree(folder, tmp_path / "sources" / name) for name, folder in standins.sources.items()}
    out = tmp_path / "out"

    def argv(*extra: str) -> list[str]:  # of the copies: the module's stand-ins stay as the reference read them
        return [sys.executable, "-m", "ckptxform", "apply", str(rules), *source_args(copies), "--out", str(out), *extra]

    job, finished = interrupted(argv("--jobs", "1"), out, 4)
    for folder in copies.values():
        for path in folder.iterdir():
            stat = path.stat()
            os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    again = run(argv("--json"))
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["shards_kept"] == finished
    assert f"resuming from {job}: kept {finished} of {SHARDS} shard(s)" in again.stderr
    assert "discarding" not in again.stderr
    # the tensors are the reference's (config.json names the verifier given, the audit its files)
    weights = {k: v for k, v in files(out).items() if ".safetensors" in k}
    assert len(weights) == SHARDS + 1 and weights == {k: v for k, v in reference.items() if ".safetensors" in k}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "sources"]


def test_the_text_report_says_how_many_shards_it_kept(rules: Path, standins: HeadlineStandins,
                                                     reference: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    _, finished = interrupted(command(rules, standins, out, "--jobs", "2"), out, 3)
    again = run(command(rules, standins, out, "--jobs", "2"))
    assert again.returncode == 0, again.stderr
    assert any(line.startswith(f"resumed {out}: kept {finished} of {SHARDS} shard(s) finished earlier (by an "
                               f"interrupted run or --shard-of ranks); this run wrote the other {SHARDS - finished} (")
               for line in again.stdout.splitlines()), again.stdout
    assert files(out) == reference


def test_no_resume_starts_over(rules: Path, standins: HeadlineStandins, reference: dict[str, str],
                               tmp_path: Path) -> None:
    out = tmp_path / "out"
    job, finished = interrupted(command(rules, standins, out, "--jobs", "1"), out, 4)
    again = run(command(rules, standins, out, "--no-resume", "--json"))
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["shards_kept"] == 0
    assert (f"discarding the interrupted job {job} ({finished} finished shard(s)): --no-resume starts over"
            in again.stderr)
    assert files(out) == reference
    assert job_dirs(out) == []


def test_a_changed_plan_discards_the_job_and_says_why(rules: Path, standins: HeadlineStandins,
                                                      tmp_path: Path) -> None:
    out = tmp_path / "out"
    job, finished = interrupted(command(rules, standins, out, "--jobs", "1"), out, 4)
    changed = tmp_path / "changed.yaml"
    changed.write_text(rules.read_text().replace("name: aqmedai-k2-to-k25", "name: aqmedai-k2-to-k25-renamed"))

    again = run(command(changed, standins, out, "--json"))
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["shards_kept"] == 0
    assert (f"discarding the interrupted job {job} ({finished} finished shard(s)): it was made from a different "
            f"plan than '{changed}' now decides") in again.stderr
    assert job_dirs(out) == []


def test_a_finished_shard_changed_after_the_kill_is_written_again(
        rules: Path, standins: HeadlineStandins, reference: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    job, finished = interrupted(command(rules, standins, out, "--jobs", "1"), out, 3)
    victim = next(p for p in sorted(job.glob("*.safetensors")))
    with victim.open("r+b") as f:  # same size, other bytes, new mtime
        f.seek(-1, os.SEEK_END)
        f.write(b"\xff")
    again = run(command(rules, standins, out, "--json"))
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["shards_kept"] == finished - 1
    assert files(out) == reference


def test_a_record_of_an_earlier_format_is_not_kept(rules: Path, standins: HeadlineStandins,
                                                  reference: dict[str, str], tmp_path: Path) -> None:
    """A record without ``fetches`` (written before records carried a task's fetch events)
    does not say how its shard's Hub bytes were fetched: its shard is written again."""
    out = tmp_path / "out"
    job, finished = interrupted(command(rules, standins, out, "--jobs", "1"), out, 3)
    record = sorted(job.glob("*.record.json"))[0]
    head, *tensors = record.read_text().splitlines(keepends=True)
    fields = json.loads(head)
    assert fields.pop("fetches") == []  # local sources: nothing fetched
    record.write_text(json.dumps(fields) + "\n" + "".join(tensors))
    again = run(command(rules, standins, out, "--json"))
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["shards_kept"] == finished - 1
    assert files(out) == reference


@pytest.mark.parametrize("digest", ["zz" * 32, "ab" * 31, "AB" * 32])
def test_a_record_whose_digest_is_not_lowercase_hex_of_its_width_is_not_kept(
        digest: str, rules: Path, standins: HeadlineStandins, reference: dict[str, str], tmp_path: Path) -> None:
    """Records hold digests binary: one that does not read back as the hex it was written as
    (not hex, another width, upper case) is not a record, and its shard is written again."""
    out = tmp_path / "out"
    job, finished = interrupted(command(rules, standins, out, "--jobs", "1"), out, 3)
    record = sorted(job.glob("*.record.json"))[0]
    head, first, *rest = record.read_text().splitlines(keepends=True)
    line = json.loads(first)  # [key, place, digest, cloned, copied]
    line[2] = digest
    record.write_text(head + json.dumps(line) + "\n" + "".join(rest))
    again = run(command(rules, standins, out, "--json"))
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["shards_kept"] == finished - 1
    assert files(out) == reference


def test_a_worker_killed_mid_run_is_one_clean_error_and_the_rerun_finishes(
        rules: Path, standins: HeadlineStandins, reference: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"

    def worker(parent: int) -> list[int]:
        return [pid for pid in children(parent) if b"spawn_main" in cmdline(pid)] if records(out) >= 1 else []

    proc = run_killing_one(command(rules, standins, out, "--jobs", "2"), worker)
    stderr = proc.stderr
    assert proc.returncode == 1, stderr
    [line] = error_lines(stderr)
    assert re.fullmatch(r"error: a worker process died \(killed, or out of memory\?\) while \d+ shard\(s\) were "
                        r"unwritten: '.+'; the finished shards are kept: rerun the same command to resume", line)
    assert "Traceback" not in stderr and not out.exists()

    again = run(command(rules, standins, out, "--jobs", "2", "--json"))
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["shards_kept"] >= 1
    assert files(out) == reference


def run_killing_one(argv: list[str], victims: Callable[[int], list[int]]) -> subprocess.CompletedProcess[str]:
    """Run ``argv``, SIGKILL the first process ``victims(pid of the run)`` names, once,
    and let the run end."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    killed = None
    try:
        while proc.poll() is None and killed is None:
            found = victims(proc.pid)
            if found:
                os.kill(found[0], signal.SIGKILL)
                killed = found[0]
            time.sleep(POLL)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert killed is not None, "the run finished before the process could be killed"
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_sigkill_at_random_points_then_the_same_command_finishes_with_the_same_bytes(
        rules: Path, standins: HeadlineStandins, reference: dict[str, str], tmp_path: Path) -> None:
    """Kill points drawn over a whole uninterrupted run (its duration measured first);
    ``CKPTXFORM_CRASH_SEED`` replays a schedule."""
    seed = int(os.environ.get("CKPTXFORM_CRASH_SEED", "15"))
    rng = random.Random(seed)
    t0 = time.perf_counter()
    timed = run(command(rules, standins, tmp_path / "timed", "--jobs", "2"))
    assert timed.returncode == 0, timed.stderr
    span = time.perf_counter() - t0
    resumed = 0
    for n in range(RANDOM_KILLS):
        out = tmp_path / f"p{n}" / "out"
        out.parent.mkdir()
        delay = (n + rng.random()) / RANDOM_KILLS * span
        proc = subprocess.Popen(command(rules, standins, out, "--jobs", "2"), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env())
        try:
            deadline = time.perf_counter() + delay
            while proc.poll() is None and time.perf_counter() < deadline:
                time.sleep(POLL)
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.communicate(timeout=60)
        case = f"kill point {n} ({delay * 1000:.0f} ms, seed {seed})"
        finished = records(out) if not out.exists() else 0
        again = run(command(rules, standins, out, "--jobs", "2", "--json"))
        assert again.returncode == 0, (case, again.stderr)
        result = json.loads(again.stdout)
        if result["status"] == "ok":
            assert result["shards_kept"] == finished, case
            resumed += finished > 0
        assert files(out) == reference, case
        assert job_dirs(out) == [], case
    print(f"\n[resume] {RANDOM_KILLS} kill points over {span * 1000:.0f} ms (seed {seed}); {resumed} resumed")


def test_without_ray_the_error_says_how_to_get_it(rules: Path, standins: HeadlineStandins, tmp_path: Path) -> None:
    """The missing extra is one usage error (exit 2); simulated by hiding the package."""
    out = tmp_path / "out"
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "ray.py").write_text("raise ImportError('hidden by the test')\n")
    proc = subprocess.run(command(rules, standins, out, "--executor", "ray"), capture_output=True, text=True,
                          env={**env(), "PYTHONPATH": str(hide)}, timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr
    assert error_lines(proc.stderr) == ["error: --executor ray needs Ray: pip install 'ckptxform[ray]'"]
    assert not out.exists() and job_dirs(out) == []


# ============================================================ --shard-of RANK/WORLD + finalize


def finalize(rules: Path, standins: HeadlineStandins, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, "-m", "ckptxform", "finalize", str(rules), *source_args(standins.sources),
                "--out", str(out), *extra])


def test_ranks_started_at_once_then_finalize_make_the_same_output(
        rules: Path, standins: HeadlineStandins, reference: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    ranks = [subprocess.Popen(command(rules, standins, out, "--shard-of", f"{rank}/3"), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env()) for rank in range(3)]
    results = [(proc.wait(timeout=300), *proc.communicate()) for proc in ranks]
    for rank, (code, stdout, stderr) in enumerate(results):
        assert code == 0, stderr
        mine = len(range(rank, SHARDS, 3))
        [job] = job_dirs(out)
        assert stdout.splitlines()[0].startswith(f"rank {rank}/3: wrote {mine} of its {mine} shard(s) (")
        assert stdout.splitlines()[0].endswith(f"), kept 0, in {job}")
    assert not out.exists() and records(out) == SHARDS

    done = finalize(rules, standins, out)
    assert done.returncode == 0, done.stderr
    assert (f"committed {out} from the {SHARDS} shard(s) finished earlier (by --shard-of ranks or an interrupted "
            "run); this run wrote no tensor data") in done.stdout.splitlines()
    assert files(out) == reference
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_finalize_names_the_shards_a_rank_has_not_written(rules: Path, standins: HeadlineStandins,
                                                          tmp_path: Path) -> None:
    out = tmp_path / "out"
    for rank in (0, 2):
        assert run(command(rules, standins, out, "--shard-of", f"{rank}/3")).returncode == 0
    [job] = job_dirs(out)
    missing = [f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors" for i in range(1, SHARDS, 3)]
    early = finalize(rules, standins, out)
    assert early.returncode == 1
    assert error_lines(early.stderr) == [
        f"error: {len(missing)} of {SHARDS} shard(s) are not finished in {job}: {', '.join(map(repr, missing))}; run "
        "the ranks that write them (apply --shard-of), then finalize again"]
    assert not out.exists() and job_dirs(out) == [job]  # nothing lost: rank 1 can still run

    other = finalize(rules, standins, out, "--digest", "sha256")
    assert other.returncode == 1
    [line] = error_lines(other.stderr)
    assert line.startswith("error: no shards of this plan to finalize: '")
    assert line.endswith(f"' does not exist (other jobs beside out: {job.name}: its digests are 'blake3', this run "
                         "asks for 'sha256'); run apply --shard-of for every rank first, with the same rules, "
                         "sources and --digest")


def test_finalize_over_a_damaged_shard_names_the_rank_that_writes_it_again(
        rules: Path, standins: HeadlineStandins, reference: dict[str, str], tmp_path: Path) -> None:
    """finalize writes no shard: a shard it cannot keep is its rank's to write again."""
    out = tmp_path / "out"
    for rank in range(3):
        assert run(command(rules, standins, out, "--shard-of", f"{rank}/3")).returncode == 0
    [job] = job_dirs(out)
    victim = sorted(job.glob("*.safetensors"))[1]  # rank 1's first shard
    with victim.open("r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    early = finalize(rules, standins, out)
    assert early.returncode == 1
    assert (f"job directory {job}: not keeping {victim.name}: it changed after it was recorded (size, inode or "
            "mtime); its rank writes it again (apply --shard-of)") in early.stderr
    assert "writing it again" not in early.stderr
    assert error_lines(early.stderr) == [
        f"error: 1 of {SHARDS} shard(s) are not finished in {job}: {victim.name!r}; run the ranks that write them "
        "(apply --shard-of), then finalize again"]
    assert run(command(rules, standins, out, "--shard-of", "1/3")).returncode == 0
    assert finalize(rules, standins, out).returncode == 0
    assert files(out) == reference


@pytest.mark.parametrize("value", ["3/3", "1", "-1/2", "a/b"])
def test_a_malformed_shard_of_is_a_usage_error(value: str, rules: Path, standins: HeadlineStandins,
                                               tmp_path: Path) -> None:
    proc = run(command(rules, standins, tmp_path / "out", "--shard-of", value))
    assert proc.returncode == 2
    assert error_lines(proc.stderr) == [f"error: --shard-of {value!r}: expected RANK/WORLD with 0 <= RANK < WORLD, "
                                        "e.g. --shard-of 0/4"]


def _restore_times(path: Path, stat: os.stat_result) -> None:
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def _resumed(rules: Path, standins: HeadlineStandins, out: Path) -> subprocess.CompletedProcess[str]:
    again = run(command(rules, standins, out, "--json"))
    assert again.returncode == 0, again.stderr
    return again


def test_an_edited_digest_in_a_record_is_not_trusted(rules: Path, standins: HeadlineStandins,
                                                     reference: dict[str, str], tmp_path: Path) -> None:
    """Issue 22 item 6: a kept shard is re-hashed against its record before it is trusted."""
    out = tmp_path / "out"
    job, finished = interrupted(command(rules, standins, out, "--jobs", "1"), out, 3)
    record = sorted(job.glob("*.record.json"))[0]
    head, first, *rest = record.read_text().splitlines(keepends=True)
    line = json.loads(first)  # [key, place, digest, cloned, copied]
    key, digest = line[0], line[2]
    line[2] = ("0" if digest[0] != "0" else "1") + digest[1:]
    record.write_text(head + json.dumps(line) + "\n" + "".join(rest))
    again = _resumed(rules, standins, out)
    assert json.loads(again.stdout)["shards_kept"] == finished - 1
    shard = record.name.removesuffix(".record.json")
    assert (f"job directory {job}: not keeping {shard}: tensor {key!r} does not hash to its recorded blake3 "
            "digest; writing it again") in again.stderr
    assert files(out) == reference
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_shard_changed_with_its_mtime_restored_is_written_again(
        rules: Path, standins: HeadlineStandins, reference: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    job, finished = interrupted(command(rules, standins, out, "--jobs", "1"), out, 3)
    victim = sorted(job.glob("*.safetensors"))[0]
    before = victim.stat()
    with victim.open("r+b") as f:  # same size, same inode, other bytes in its last tensor
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    _restore_times(victim, before)
    assert victim.stat().st_mtime_ns == before.st_mtime_ns
    again = _resumed(rules, standins, out)
    assert json.loads(again.stdout)["shards_kept"] == finished - 1
    assert re.search(rf"job directory {re.escape(str(job))}: not keeping {victim.name}: tensor '[^']+' does not "
                     "hash to its recorded blake3 digest; writing it again", again.stderr), again.stderr
    assert files(out) == reference
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_two_same_size_shards_swapped_in_place_are_both_written_again(
        rules: Path, standins: HeadlineStandins, reference: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    job, finished = interrupted(command(rules, standins, out, "--jobs", "1"), out, SHARDS - 2)
    by_size: dict[int, list[Path]] = {}
    for path in sorted(job.glob("*.safetensors")):
        by_size.setdefault(path.stat().st_size, []).append(path)
    first, second = next(paths for paths in by_size.values() if len(paths) >= 2)[:2]
    stats, data = (first.stat(), second.stat()), (first.read_bytes(), second.read_bytes())
    with first.open("r+b") as f:  # contents swapped, each file keeping its inode and times
        f.write(data[1])
    with second.open("r+b") as f:
        f.write(data[0])
    _restore_times(first, stats[0])
    _restore_times(second, stats[1])
    again = _resumed(rules, standins, out)
    assert json.loads(again.stdout)["shards_kept"] == finished - 2
    for path in (first, second):
        assert f"job directory {job}: not keeping {path.name}: its header is not the plan's; writing it again" \
            in again.stderr
    assert files(out) == reference
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
