"""Scale-out benchmark: ``--jobs 2`` against ``--jobs 1`` on many-shard jobs, and the Ray
executor's overhead per job and per shard.

    python benchmarks/scaleout_bench.py                    # 1 GB drafter, 3 repetitions
    python benchmarks/scaleout_bench.py --size 50MB --reps 1 --skip-ray   # a smoke run

Jobs, each timed in its own process, alternating, as bench.py does:
- cast: every tensor of the synthetic drafter cast bf16 -> float32 (CPU work: torch
  decodes and converts every value), 12 output shards;
- rename: the drafter renamed (I/O: kernel copies and hashing), 12 output shards;
- Ray: a checkpoint of 64 tensors of 64 KiB written as 1 shard and as 64 shards, with
  ``--executor ray`` (a local Ray instance started by the command, as without a cluster)
  and with ``--jobs 1``. Per job: ray(1 shard) - local(1 shard); per shard:
  (ray(64) - ray(1)) / 63 against the same for local.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import PY, Result, measure, paired_ratio, parse_size, warm  # noqa: E402
from synthetic import Tensor, build_benchmark_sources, write_safetensors  # noqa: E402

RULE = """version: 1
name: {name}
sources: {{drafter: {{path: unused}}}}
convert: drafter
tensors:
  - match: 'midlayer\\.(.+)'
    rename: 'layers.0.\\1'
  - match: '.*'
output: {{max_shard_size: {shard}{dtype}}}
"""


def run_alternating(commands: dict[str, list[str]], work: Path, reps: int) -> dict[str, Result]:
    results = {name: Result(name, [], []) for name in commands}
    for rep in range(reps):
        for name in (list(commands) if rep % 2 == 0 else list(reversed(commands))):
            out = work / "out"
            shutil.rmtree(out, ignore_errors=True)
            wall, rss = measure([*commands[name], "--out", str(out)])
            results[name].walls.append(wall)
            results[name].rss.append(rss)
    shutil.rmtree(work / "out", ignore_errors=True)
    return results


def jobs_scenario(work: Path, size: int, reps: int) -> dict[str, Result]:
    src = build_benchmark_sources(work / "src", size)["drafter"]
    warm(src)
    shard = max(1, size // 12)
    commands = {}
    for job, dtype in (("cast", ", dtype: float32"), ("rename", "")):
        rule = work / f"{job}.yaml"
        rule.write_text(RULE.format(name=f"{job}-sharded", shard=shard, dtype=dtype))
        for jobs in ("1", "2"):
            commands[f"{job} 12 shards --jobs {jobs}"] = [PY, "-m", "ckptxform", "-q", "apply", str(rule),
                                                          f"--source=drafter={src}", "--no-fsync", "--jobs", jobs]
    return run_alternating(commands, work, reps)


def ray_scenario(work: Path, reps: int) -> dict[str, Result]:
    src = work / "small"
    src.mkdir(parents=True)
    write_safetensors(src / "model.safetensors", [Tensor(f"t{i:02d}", "BF16", (32768,)) for i in range(64)])
    commands = {}
    for shards, limit in (("1", "1GB"), ("64", "64KiB")):
        rule = work / f"small-{shards}.yaml"
        rule.write_text(RULE.format(name=f"small-{shards}", shard=limit, dtype=""))
        base = [PY, "-m", "ckptxform", "-q", "apply", str(rule), f"--source=drafter={src}", "--no-fsync"]
        commands[f"{shards} shard(s) local --jobs 1"] = [*base, "--jobs", "1"]
        commands[f"{shards} shard(s) --executor ray"] = [*base, "--executor", "ray"]
    return run_alternating(commands, work, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-ray", action="store_true")
    ap.add_argument("--skip-jobs", action="store_true", help="only the Ray scenario")
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ckptxform-scaleout-"))
    try:
        results = {} if args.skip_jobs else jobs_scenario(work / "jobs", parse_size(args.size), args.reps)
        lines = ["| job | median (s) | best (s) | / --jobs 1 | peak RSS (MB) |", "|---|---|---|---|---|"]
        for name, r in results.items():
            one = results[name.replace("--jobs 2", "--jobs 1")]
            lines.append(f"| {name} | {r.wall:.2f} | {r.best:.2f} | {paired_ratio(r, one):.2f} | {r.peak_mb:.0f} |")
        if not args.skip_ray:
            ray = ray_scenario(work / "ray", args.reps)
            results.update(ray)
            med = {name: statistics.median(r.walls) for name, r in ray.items()}
            per_job = med["1 shard(s) --executor ray"] - med["1 shard(s) local --jobs 1"]
            per_shard_ray = (med["64 shard(s) --executor ray"] - med["1 shard(s) --executor ray"]) / 63
            per_shard_local = (med["64 shard(s) local --jobs 1"] - med["1 shard(s) local --jobs 1"]) / 63
            lines += ["", *(f"- {name}: {wall:.2f} s median" for name, wall in med.items()),
                      f"- Ray per job: {per_job:.2f} s; per shard: {per_shard_ray * 1000:.0f} ms on Ray, "
                      f"{per_shard_local * 1000:.0f} ms locally"]
        print("\n".join(lines))
        if args.json_out:
            Path(args.json_out).write_text(json.dumps({n: r.walls for n, r in results.items()}, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
