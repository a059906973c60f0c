"""Tensor-count benchmark (issue 36): the cost per tensor, with tensors so small that only
the bookkeeping shows.

    python benchmarks/count_bench.py                          # 20,000 and 200,000 tensors in 64 shards
    python benchmarks/count_bench.py --counts 20000 --reps 3  # one count, three repetitions
    python benchmarks/count_bench.py --smoke                  # 2,000 and 8,000 tensors, seconds
    python benchmarks/count_bench.py --kimi                   # compressed_int4_to_bf16, Kimi-K2.5-shaped

A source of N BF16 [2, 4] tensors named like a MoE's experts
(``model.layers.S.experts.I.wK.weight``) in 64 shards with an index, and one rename rule.
Contenders, each in its own process, alternating, from a warm page cache:
- a naive script: ``safetensors.torch.load_file`` every shard, rename in a dict,
  ``save_file`` it (no fsync, no hash, no audit);
- ``ckptxform plan`` (headers only);
- ``ckptxform apply --no-fsync`` (the naive script does not fsync either; every output
  tensor is still hashed and audited).
Reported per count: median wall, peak RSS (GNU time), ratios to the naive script as the
median of per-repetition ratios; then how much N costs against the smallest count.

``--kimi``: a Kimi-K2.5-shaped checkpoint at its real tensor count (61 layers, 60 of them
MoE with 384 routed experts whose gate/up/down projections are compressed-tensors int4:
weight_packed, weight_scale, weight_shape; ~208,000 tensors) at 1/32 of the widths (the experts 16 wide), in 64
shards, through ``rules/compressed_int4_to_bf16.yaml``, against the naive rename script
run on the same checkpoint (what only moving the tensors costs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import compile_ckptxform, paired_ratio, run_contenders, warm  # noqa: E402
from synthetic import Tensor, write_sharded  # noqa: E402

PY = sys.executable

RULE = """version: 1
name: count-rename
sources:
  model: {path: unused}
convert: model
tensors:
  - match: 'model\\.layers\\.(\\d+)\\.experts\\.(\\d+)\\.(w\\d)\\.weight'
    rename: 'layers.\\1.e.\\2.\\3'
"""

NAIVE_RENAME = r"""
import json, os, re, sys
from safetensors.torch import load_file, save_file
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst)
pattern = re.compile(r"model\.layers\.(\d+)\.experts\.(\d+)\.(w\d)\.weight")
index = json.load(open(os.path.join(src, "model.safetensors.index.json")))
weight_map = {}
for shard in sorted(set(index["weight_map"].values())):
    tensors = load_file(os.path.join(src, shard))
    out = {pattern.fullmatch(k).expand(r"layers.\1.e.\2.\3"): v for k, v in tensors.items()}
    save_file(out, os.path.join(dst, shard), metadata={"format": "pt"})
    weight_map.update({k: shard for k in out})
json.dump({"metadata": {}, "weight_map": weight_map}, open(os.path.join(dst, "model.safetensors.index.json"), "w"))
"""


def build_source(root: Path, count: int, shards: int) -> None:
    per, extra = divmod(count, shards)
    groups = []
    for s in range(shards):
        n = per + (s < extra)
        groups.append([Tensor(f"model.layers.{s}.experts.{i}.w{i % 3}.weight", "BF16", (2, 4)) for i in range(n)])
    write_sharded(root, groups)
    (root / "config.json").write_text(json.dumps({"architectures": ["X"], "model_type": "llama"}))


NAIVE_PREFIX_RENAME = NAIVE_RENAME.replace(
    r'pattern.fullmatch(k).expand(r"layers.\1.e.\2.\3")', 'k.replace("model.", "m.", 1)')


def kimi_scenario(work: Path, shards: int, reps: int) -> dict[str, object]:
    """compressed_int4_to_bf16 at Kimi-K2.5's tensor count, against the naive rename."""
    from ckptxform.standins.deepseek import KIMI_K2_TEXT
    from ckptxform.standins.quantized import build_kimi_k2

    src = work / "kimi-int4"
    if not src.exists():
        dims = KIMI_K2_TEXT.scaled(32, vocab=2048, moe_intermediate=16)
        build_kimi_k2(src, dims, quantization="int4", group=16, num_shards=shards)
    count = len(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"])
    warm(src)
    naive = work / "naive_prefix_rename.py"
    naive.write_text(NAIVE_PREFIX_RENAME)
    rule = HERE.parent / "rules" / "compressed_int4_to_bf16.yaml"
    contenders = {
        "naive rename": lambda out: [PY, str(naive), str(src), str(out)],
        "ckptxform apply compressed_int4_to_bf16 --no-fsync": lambda out: [
            PY, "-m", "ckptxform", "apply", "-q", "--no-fsync", str(rule), "--source", f"model={src}",
            "--out", str(out)],
    }
    results = run_contenders(contenders, work, reps)
    return {"count": count, "shards": shards, "reps": reps,
            "results": {name: {"walls": r.walls, "wall": r.wall, "peak_mb": r.peak_mb,
                               "vs_naive": paired_ratio(r, results["naive rename"])} for name, r in results.items()}}


def scenario(work: Path, count: int, shards: int, reps: int) -> dict[str, object]:
    src = work / f"src-{count}"
    if not src.exists():
        build_source(src, count, shards)
    warm(src)
    rules = work / "rename.yaml"
    rules.write_text(RULE)
    naive = work / "naive_rename.py"
    naive.write_text(NAIVE_RENAME)
    cli = [PY, "-m", "ckptxform"]
    contenders = {
        "naive rename": lambda out: [PY, str(naive), str(src), str(out)],
        "ckptxform plan": lambda out: [*cli, "plan", "-q", str(rules), "--source", f"model={src}"],
        "ckptxform apply --no-fsync": lambda out: [*cli, "apply", "-q", "--no-fsync", str(rules),
                                                   "--source", f"model={src}", "--out", str(out)],
    }
    results = run_contenders(contenders, work, reps)
    naive_result = results["naive rename"]
    return {
        "count": count, "shards": shards, "reps": reps,
        "results": {name: {"walls": r.walls, "wall": r.wall, "peak_mb": r.peak_mb,
                           "vs_naive": paired_ratio(r, naive_result)} for name, r in results.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--counts", default="20000,200000", help="tensor counts, comma-separated")
    ap.add_argument("--shards", type=int, default=64)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="2,000 and 8,000 tensors in 8 shards, one repetition")
    ap.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--kimi", action="store_true",
                    help="compressed_int4_to_bf16 on a Kimi-K2.5-shaped checkpoint (~208,000 tensors) instead")
    args = ap.parse_args()
    counts = [2000, 8000] if args.smoke else [int(c) for c in args.counts.split(",")]
    shards = 8 if args.smoke else args.shards
    compile_ckptxform()
    work = args.work or Path(tempfile.mkdtemp(prefix="ckptxform-count-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        figures = ([kimi_scenario(work, args.shards, args.reps)] if args.kimi
                   else [scenario(work, count, shards, args.reps) for count in counts])
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{platform.node()}: {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"{shards} shards, {args.reps} repetition(s), median wall, ratios = median of paired ratios\n")
    print("| tensors | contender | wall s | peak RSS MB | x naive |")
    print("|---|---|---|---|---|")
    for fig in figures:
        for name, r in fig["results"].items():  # type: ignore[union-attr]
            print(f"| {fig['count']:,} | {name} | {r['wall']:.2f} | {r['peak_mb']:.0f} | {r['vs_naive']:.2f} |")
    base = figures[0]
    for fig in figures[1:]:
        scale = fig["count"] / base["count"]  # type: ignore[operator]
        results, base_results = fig["results"], base["results"]
        growth = ", ".join(f"{name} {results[name]['wall'] / base_results[name]['wall']:.1f}x"  # type: ignore[index]
                           for name in results)  # type: ignore[union-attr]
        print(f"\n{fig['count']:,} tensors cost, against {base['count']:,} ({scale:g}x the tensors): {growth}")
    if args.json:
        args.json.write_text(json.dumps({"counts": figures}, indent=2))


if __name__ == "__main__":
    main()
