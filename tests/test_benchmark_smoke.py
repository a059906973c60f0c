"""The benchmark still runs (tiny sizes); its figures are not asserted: timing is noise here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py"


def test_benchmark_smoke_run(tmp_path: Path) -> None:
    figures = tmp_path / "figures.json"
    run = subprocess.run([sys.executable, str(BENCH), "--size", "8MB", "--reps", "1", "--small-tb",
                          "--work", str(tmp_path / "work"), "--json", str(figures)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "| ckptxform headline |" in run.stdout and "1 TB scenario" in run.stdout
    data = json.loads(figures.read_text())
    assert set(data["structural"]["results"]) == {"cp moe", "naive stack+concat", "ckptxform stack+concat",
                                                  "ckptxform stack+concat --no-fsync", "cp big", "naive transpose",
                                                  "ckptxform transpose", "ckptxform transpose --no-fsync"}
    assert set(data["results"]) == {"cp -r", "cp -r + sync", "sha256 alone (1 core)", "blake3 alone (1 core)",
                                    "naive rename", "ckptxform rename",
                                    "ckptxform rename --no-fsync", "naive headline", "ckptxform headline",
                                    "ckptxform headline --no-fsync", "ckptxform rename --no-fsync --digest sha256",
                                    "ckptxform headline --no-fsync --digest sha256"}
    assert set(data["model_parallel"]["results"]) == {"cp mp4", "ckptxform meta MP=1", "ckptxform meta MP=4"}
    tb = data["tb"]
    # plan reads headers and the two vocab maps, never the (sparse, 10 GB) verifier's weights
    assert tb["plan_read_bytes"] < 10 * 2**20
    # apply reads the drafter's kept bytes and only the verifier rows it needs, not the
    # verifier (plus headers and vocab maps); a tensor copied whole is read twice (the
    # kernel copy, then its hash), both counted in rchar
    assert tb["needed_bytes"] <= tb["apply_read_bytes"] < 2 * tb["needed_bytes"] + 10 * 2**20
