"""--jobs by default chooses itself: one process for a job whose bytes are copied, the
cores for one that decodes values (casts, block ops); the audit says which and why."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import read_audit
from safetensors.torch import save_file

from ckptxform import api

RULE = """version: 1
name: choice
sources: {src: {path: unused}}
convert: src
output: {max_shard_size: 300000}
tensors:
%s
  - match: '.*'
"""
RENAME = "  - match: 'w(.)'\n    rename: 'layer.\\1'"
CAST = "  - match: 'w(.)'\n    rename: 'layer.\\1'\n    cast: float32"


def _run(tmp_path: Path, body: str, name: str) -> dict[str, object]:
    src = tmp_path / "src"
    if not src.exists():
        src.mkdir()
        save_file({f"w{i}": torch.randn(256, 256).to(torch.bfloat16) for i in range(4)},
                  src / "model.safetensors", metadata={"format": "pt"})
        (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    rule = tmp_path / f"{name}.yaml"
    rule.write_text(RULE % body)
    api.apply(rule, out=tmp_path / name, sources={"src": str(src)}, progress=False, fsync=False)
    summary = read_audit(tmp_path / name)[-1]
    jobs: dict[str, object] = summary["jobs"]
    return jobs


def test_a_copying_job_runs_in_one_process(tmp_path: Path) -> None:
    jobs = _run(tmp_path, RENAME, "rename")
    assert jobs["workers"] == 1 and jobs["executor"] == "local"
    assert str(jobs["reason"]).startswith("I/O-bound: 0% of the output's bytes are decoded")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to choose two processes")
def test_a_decoding_job_runs_on_the_cores(tmp_path: Path) -> None:
    jobs = _run(tmp_path, CAST, "cast")
    shards = len(list((tmp_path / "cast").glob("*.safetensors")))
    assert shards >= 2
    assert jobs["workers"] == min(len(os.sched_getaffinity(0)), shards)
    assert str(jobs["reason"]).startswith("CPU-bound: 100% of the output's bytes are decoded")
