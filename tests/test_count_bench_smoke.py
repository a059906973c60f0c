"""The tensor-count benchmark still runs (2,000 and 8,000 tensors); its figures are not
asserted: timing is noise here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "count_bench.py"


def test_count_benchmark_smoke_run(tmp_path: Path) -> None:
    figures = tmp_path / "figures.json"
    run = subprocess.run([sys.executable, str(BENCH), "--smoke", "--work", str(tmp_path / "work"),
                          "--json", str(figures)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "| 8,000 | ckptxform apply --no-fsync |" in run.stdout
    data = json.loads(figures.read_text())
    assert [c["count"] for c in data["counts"]] == [2000, 8000]
    for count in data["counts"]:
        assert set(count["results"]) == {"naive rename", "ckptxform plan", "ckptxform apply --no-fsync"}
    # the source holds the count asked for (outputs are removed after each run)
    out = tmp_path / "work" / "src-8000"
    assert len(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]) == 8000
