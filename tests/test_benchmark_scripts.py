"""Every benchmark script with a command line starts: a refactor that moves a helper out of
``benchmarks/bench.py`` must not leave a script that fails at its first import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if "argparse" in p.read_text())


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_benchmark_script_starts(script: Path) -> None:
    proc = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout


def test_the_lora_benchmark_runs_at_a_tiny_size() -> None:
    # the merge rule asks its base for a transformers config: the benchmark's base must fit it
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "lora_bench.py"), "--size", "2MB", "--reps", "1"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| ckptxform peft_lora_merge |" in proc.stdout
