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


def test_the_fp8_floor_probe_does_the_applys_work(tmp_path: Path) -> None:
    """benchmarks/fp8_floor_probe.py is the FP8 dequant's floor only if it makes the same
    bytes: each dequantized tensor's BLAKE3 equals the apply's audit (odd widths, partial
    edge blocks, a scale in another shard than its weight)."""
    from ckptxform import api
    from ckptxform.standins import build_kimi_k2

    src = build_kimi_k2(tmp_path / "src", num_shards=3).path
    api.apply(BENCH.parent.parent / "rules" / "fp8_block_to_bf16.yaml", out=tmp_path / "out",
              sources={"model": str(src)}, progress=False)
    run = subprocess.run([sys.executable, str(BENCH.parent / "fp8_floor_probe.py"), str(src), str(tmp_path / "probe")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    probe = json.loads((tmp_path / "probe" / "digests.json").read_text())
    audit = [json.loads(line) for line in (tmp_path / "out" / "ckptxform_audit.jsonl").read_text().splitlines()]
    written = {e["key"]: e["blake3"] for e in audit if e["event"] == "written"}
    dequantized = {e["key"] for e in audit if e["event"] == "written" and "dequant_fp8_block over T to bfloat16"
                   in e["from"].get("ops", [])}
    assert dequantized and set(probe) == dequantized
    assert probe == {key: written[key] for key in dequantized}
