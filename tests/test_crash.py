"""Crash consistency: ``ckptxform apply`` SIGKILLed at any point loses nothing.

The real command runs in a subprocess on the headline stand-ins (made larger, so that the
write phase is long enough to be hit) and is killed with SIGKILL, which no handler can
catch: whatever the output protection is worth, it must be worth it with no cleanup code
running. The product has no test hook; kill points are random delays drawn from the
measured timeline of an uninterrupted run:

- half spread over the whole run (from the process start: imports, plan, write, rename),
- half spread over the write phase, timed from the moment the temporary sibling appears
  (the run is polled every 0.5 ms) until a quarter past the moment OUT appeared in the
  measured run (so a few land after the rename too).

After each kill the invariant: OUT is absent (only a temporary sibling, the job directory
of finished shards and the lock file may remain) or complete (``ckptxform verify OUT`` passes and its bytes are the
uninterrupted run's); and a rerun without --force succeeds, says it removed the stale
sibling it found, leaves no sibling at all, and writes exactly the uninterrupted run's
bytes.

CI runs ``CRASH_POINTS_CI`` kill points; ``CKPTXFORM_CRASH_POINTS=200`` runs more locally
and ``CKPTXFORM_CRASH_SEED`` replays a schedule. ``pytest -s`` prints where the kills landed.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import read_audit, source_args

from ckptxform.standins import KIMI_K2, HeadlineStandins, build_headline_standins
from ckptxform.engine.output.verify import verify

#: large enough that writing the output (3.5 MB, fsynced) is a phase a kill can land in
CRASH_DIMS = KIMI_K2.scaled(hidden=256, head_dim=16, vocab=16384, draft_vocab=2048)
CRASH_POINTS_CI = 20
POLL_SECONDS = 0.0005


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "CKPTXFORM_DEBUG"}
    env["NO_COLOR"] = "1"
    return env


@dataclass(frozen=True)
class Timeline:
    """When an uninterrupted run created its temporary sibling, renamed it to OUT and
    exited, in seconds from its start."""

    tmp_seen: float
    out_seen: float
    end: float


class Runner:
    def __init__(self, rule: Path, standins: HeadlineStandins) -> None:
        self.args = [sys.executable, "-m", "ckptxform", "apply", str(rule), *source_args(standins.sources)]

    def start(self, out: Path) -> subprocess.Popen[str]:
        return subprocess.Popen([*self.args, "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=_env())

    def run(self, out: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.args, "--out", str(out)], capture_output=True, text=True, env=_env(),
                              timeout=120, check=False)


def leftovers(out: Path) -> list[str]:
    """Entries beside OUT that a ckptxform run made (temporary siblings, lock file)."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.ckptxform-"))


def job_dirs(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.ckptxform-job-*"))


def tmp_siblings(out: Path) -> list[Path]:
    return sorted(p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.ckptxform-tmp-"))


def wait_for_tmp(proc: subprocess.Popen[str], out: Path, t0: float) -> float | None:
    """Seconds from ``t0`` until the run's temporary sibling appeared (None: it exited first)."""
    prefix = f".{out.name}.ckptxform-tmp-"
    while proc.poll() is None:
        if any(name.startswith(prefix) for name in os.listdir(out.parent)):
            return time.perf_counter() - t0
        time.sleep(POLL_SECONDS)
    return None


def sleep_until(deadline: float, proc: subprocess.Popen[str]) -> None:
    while proc.poll() is None and time.perf_counter() < deadline:
        time.sleep(min(POLL_SECONDS, max(0.0, deadline - time.perf_counter())))


def output_files(out: Path) -> dict[str, str]:
    """name -> sha256 of every file of an output except the audit (it records the start time)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())
            if p.name != "ckptxform_audit.jsonl"}


def written_events(out: Path) -> list[dict[str, object]]:
    return [e for e in read_audit(out) if e["event"] == "written"]


@pytest.fixture(scope="module")
def standins(tmp_path_factory: pytest.TempPathFactory) -> HeadlineStandins:
    return build_headline_standins(tmp_path_factory.mktemp("crash-sources"), dims=CRASH_DIMS, seed=5)


@pytest.fixture(scope="module")
def runner(headline_rule: Path, standins: HeadlineStandins) -> Runner:
    return Runner(headline_rule, standins)


@pytest.fixture(scope="module")
def reference(runner: Runner, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Timeline]:
    """An uninterrupted run's output, and its timeline (the slower of two runs)."""
    timelines = []
    for attempt in range(2):
        out = tmp_path_factory.mktemp(f"crash-reference-{attempt}") / "out"
        t0 = time.perf_counter()
        proc = runner.start(out)
        tmp_seen = wait_for_tmp(proc, out, t0)
        while proc.poll() is None and not out.exists():
            time.sleep(POLL_SECONDS)
        out_seen = time.perf_counter() - t0
        _, stderr = proc.communicate(timeout=120)
        end = time.perf_counter() - t0
        assert proc.returncode == 0, stderr
        assert tmp_seen is not None, "the run ended before its temporary sibling was seen"
        assert leftovers(out) == []
        timelines.append(Timeline(tmp_seen, out_seen, end))
    return out, max(timelines, key=lambda t: t.end)


def kill_schedule(count: int, timeline: Timeline, seed: int) -> list[tuple[str, float]]:
    """``count`` kill points: (anchor, delay). Stratified: each half is cut into equal
    slices and one delay drawn uniformly in each, so the points cover the whole span."""
    rng = random.Random(seed)
    whole, write = count - count // 2, count // 2
    window = 1.25 * (timeline.out_seen - timeline.tmp_seen)
    points = [("start", (i + rng.random()) / whole * timeline.end) for i in range(whole)]
    points += [("tmp", (i + rng.random()) / write * window) for i in range(write)]
    rng.shuffle(points)
    return points


def test_sigkill_at_any_point_leaves_no_partial_output_and_the_rerun_finishes(
        runner: Runner, reference: tuple[Path, Timeline], tmp_path: Path, run_cli: Any) -> None:
    ref_out, timeline = reference
    want_files, want_written = output_files(ref_out), written_events(ref_out)
    count = int(os.environ.get("CKPTXFORM_CRASH_POINTS", CRASH_POINTS_CI))
    seed = int(os.environ.get("CKPTXFORM_CRASH_SEED", "20240607"))
    landed: Counter[str] = Counter()

    for n, (anchor, delay) in enumerate(kill_schedule(count, timeline, seed)):
        case = f"kill point {n} ({anchor} + {delay * 1000:.1f} ms, seed {seed})"
        out = tmp_path / f"p{n:03d}" / "out"
        out.parent.mkdir()
        t0 = time.perf_counter()
        proc = runner.start(out)
        try:
            if anchor == "tmp" and wait_for_tmp(proc, out, t0) is not None:
                t0 = time.perf_counter()
            sleep_until(t0 + delay, proc)
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.communicate(timeout=60)

        # -- the invariant right after the kill
        stale = tmp_siblings(out)
        whole = out.exists()
        exited_before = proc.returncode != -signal.SIGKILL  # it finished before the signal arrived
        if exited_before:
            assert proc.returncode == 0, (case, proc.stderr)
        landed["finished before the kill" if exited_before else
               "after the rename (OUT whole)" if whole else
               "during the write (temporary sibling left)" if stale else "before any output"] += 1
        if stale and (stale[0] / "model.safetensors").exists():
            landed["of those, with the weight file begun"] += 1
        if whole:
            assert output_files(out) == want_files, f"{case}: OUT exists but differs from the uninterrupted run's"
            checked = run_cli("verify", out)
            assert checked.returncode == 0, (case, checked.stdout, checked.stderr)
            assert stale == [], f"{case}: OUT was renamed into place but a temporary sibling remains"
        else:
            assert not os.path.lexists(out), case
            assert len(stale) <= 1, (case, stale)
            assert len(job_dirs(out)) <= 1, (case, job_dirs(out))
            assert set(leftovers(out)) <= {".out.ckptxform-lock", *(p.name for p in [*stale, *job_dirs(out)])}, (
                case, leftovers(out))

        # -- the rerun, without --force, finishes the job
        again = runner.run(out)
        assert again.returncode == 0, (case, again.stdout, again.stderr)
        for path in stale:
            pid = path.name.rsplit("-", 1)[1]
            assert f"removed {path} left by a killed ckptxform run (pid {pid})" in again.stderr, (case, again.stderr)
        # a complete OUT is recognised as this conversion, not written again
        assert ("is up to date" in again.stdout) == whole, (case, again.stdout)
        assert leftovers(out) == [], f"{case}: the rerun left {leftovers(out)}"
        assert verify(out).tensors == len(want_written)
        assert output_files(out) == want_files, f"{case}: the rerun's output differs from the uninterrupted run's"
        assert written_events(out) == want_written, case

    print(f"\n[crash] {count} kill points survived (seed {seed}; uninterrupted run: temporary sibling at "
          f"{timeline.tmp_seen * 1000:.0f} ms, OUT at {timeline.out_seen * 1000:.0f} ms, exit at "
          f"{timeline.end * 1000:.0f} ms): "
          + ", ".join(f"{k}: {v}" for k, v in sorted(landed.items())))
    # The schedule must really have exercised the write phase, or the test proves little.
    assert landed["during the write (temporary sibling left)"] >= 1, landed
    assert landed["before any output"] >= 1, landed


def test_a_kill_during_a_forced_replacement_keeps_the_old_output_and_the_rerun_tidies_up(
        runner: Runner, reference: tuple[Path, Timeline], tmp_path: Path) -> None:
    """apply --force over an existing OUT, killed while it writes: the old OUT is intact
    and still up to date, so the rerun without --force writes nothing, yet it removes the
    killed run's temporary sibling (and says so) instead of leaving it forever."""
    ref_out, _ = reference
    out = tmp_path / "out"
    first = runner.run(out)
    assert first.returncode == 0, first.stderr
    before = output_files(out)
    for _attempt in range(20):
        t0 = time.perf_counter()
        proc = subprocess.Popen([*runner.args, "--out", str(out), "--force"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=_env())
        try:
            seen = wait_for_tmp(proc, out, t0)
            if seen is not None:
                os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.communicate(timeout=60)
        if seen is not None and proc.returncode == -signal.SIGKILL and tmp_siblings(out):
            break
    else:
        pytest.fail("could not kill a forced run while its temporary sibling existed")
    [stale] = tmp_siblings(out)
    assert output_files(out) == before == output_files(ref_out)

    again = runner.run(out)
    assert again.returncode == 0, again.stderr
    assert "is up to date" in again.stdout
    assert f"removed {stale} left by a killed ckptxform run (pid {stale.name.rsplit('-', 1)[1]})" in again.stderr
    assert leftovers(out) == []
    assert output_files(out) == before
