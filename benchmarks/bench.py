"""ckptxform benchmark: wall time and peak RSS against `cp -r` and a naive load-everything script.

    python benchmarks/bench.py                  # 2 GB drafter, 5 repetitions
    python benchmarks/bench.py --size 200MB --reps 1 --skip-tb   # a quick smoke run

Every command runs in its own process; peak RSS is that process's ru_maxrss (os.wait4).
Runs alternate between the contenders, the source files are read once first so every
contender starts from a warm page cache. Reported: the median and the best wall time, and
ratios as the median of per-repetition ratios (a contender against cp in the same
repetition), since the speed of a shared vm drifts between repetitions.
ckptxform's bytecode is compiled first, as ``pip install`` does (an editable install under
PYTHONDONTWRITEBYTECODE=1 would otherwise recompile it on every run, ~0.1 s), and the rule
files are validated once first, as on a user's second run (their schema pass is then
remembered: no jsonschema import, ~0.15 s less).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from synthetic import build_benchmark_sources, build_sparse_verifier, write_safetensors, Tensor  # noqa: E402
from harness import PY, compile_ckptxform, paired_ratio, parse_size, run_contenders, warm  # noqa: E402
import structural_bench  # noqa: E402
import dcp_bench  # noqa: E402
import quantize_bench  # noqa: E402

REPO = HERE.parent
HEADLINE = REPO / "rules" / "aqmedai_k2_to_k25.yaml"

RENAME_RULE = """version: 1
name: rename-only
sources: {drafter: {path: unused}}
convert: drafter
tensors:
  - match: 'midlayer\\.(.+)'
    rename: 'layers.0.\\1'
  - match: '.*'
"""

NAIVE_RENAME = r"""
import json, os, sys
from safetensors.torch import load_file, save_file
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst)
index = json.load(open(os.path.join(src, "model.safetensors.index.json")))
weight_map = {}
for shard in sorted(set(index["weight_map"].values())):
    tensors = load_file(os.path.join(src, shard))
    out = {k.replace("midlayer.", "layers.0.", 1): v for k, v in tensors.items()}
    save_file(out, os.path.join(dst, shard), metadata={"format": "pt"})
    weight_map.update({k: shard for k in out})
json.dump({"metadata": {}, "weight_map": weight_map}, open(os.path.join(dst, "model.safetensors.index.json"), "w"))
"""

# What hashing alone costs: the audit log records the digest of every output tensor
# (BLAKE3 by default, sha256 by option), so every byte ckptxform writes is also hashed
# (on the other core, alongside the copy).
HASH_ONLY = r"""
import hashlib, pathlib, sys
from blake3 import blake3
for f in sorted(pathlib.Path(sys.argv[2]).glob("*.safetensors")):
    h = blake3() if sys.argv[1] == "blake3" else hashlib.sha256()
    with open(f, "rb", buffering=0) as fh:
        while block := fh.read(1 << 23):
            h.update(block)
"""

NAIVE_HEADLINE = r"""
import json, os, sys, torch
from safetensors.torch import load_file, save_file
drafter, target, verifier, dst = sys.argv[1:5]
os.makedirs(dst)
index = json.load(open(os.path.join(drafter, "model.safetensors.index.json")))
tensors = {}
for shard in sorted(set(index["weight_map"].values())):
    tensors.update(load_file(os.path.join(drafter, shard)))
vindex = json.load(open(os.path.join(verifier, "model.safetensors.index.json")))
vshard = load_file(os.path.join(verifier, vindex["weight_map"]["language_model.lm_head.weight"]))
full = vshard["language_model.lm_head.weight"]
tv = load_file(os.path.join(target, "model.safetensors"))
ids_a = tensors["d2t"] + torch.arange(len(tensors["d2t"]))
ids_b = tv["d2t"] + torch.arange(len(tv["d2t"]))
pos = {int(t): i for i, t in enumerate(ids_a)}
rows = [full[int(t)] if int(t) not in pos else tensors["lm_head.weight"][pos[int(t)]] for t in ids_b]
out = {k.replace("midlayer.", "layers.0.", 1): v for k, v in tensors.items()}
out["lm_head.weight"] = torch.stack(rows)
out["d2t"], out["t2d"] = tv["d2t"], tv["t2d"]
save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
"""


def io_probe(args: list[str]) -> dict[str, float]:
    """Run ckptxform's CLI in-process in a child and report its bytes read (rchar) and wall."""
    code = (
        "import sys, time; from ckptxform.cli import main\n"
        "def rchar():\n"
        "    return int(dict(l.split(': ') for l in open('/proc/self/io').read().splitlines())['rchar'])\n"
        "r0 = rchar(); t0 = time.perf_counter()\n"
        f"try:\n    main({args!r}, standalone_mode=False)\n"
        "finally:\n"
        "    print('PROBE', rchar() - r0, time.perf_counter() - t0, file=sys.stderr)\n"
    )
    proc = subprocess.run([PY, "-c", code], capture_output=True, text=True)
    line = next((l for l in proc.stderr.splitlines() if l.startswith("PROBE")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"ckptxform {' '.join(args)} failed: {proc.stderr}")
    _, read, wall = line.split()
    return {"read_bytes": int(read), "wall": float(wall)}


def tb_scenario(work: Path, *, small: bool = False) -> dict[str, float]:
    """A ~1 TB verifier of 61 sparse shards: plan and apply the headline rule against it
    (``small``: 10 GB and tiny dimensions, for the smoke test)."""
    from ckptxform.standins import make_draft_vocab
    from synthetic import _vocab_tensors

    hidden, vocab, draft = (256, 8192, 2048) if small else (7168, 163840, 32000)
    apparent_target = 10 * 10**9 if small else 1 << 40
    ids_a = make_draft_vocab(vocab, draft, seed=1)
    ids_b = make_draft_vocab(vocab, draft, seed=2)
    missing = sorted(set(ids_b) - set(ids_a))  # rows of the target the drafter lacks: from the verifier
    dropped = len(set(ids_a) - set(ids_b))  # drafter lm_head rows the target does not keep
    root = work / "tb"
    verifier = build_sparse_verifier(root / "verifier", hidden=hidden, vocab=vocab, rows=missing,
                                     apparent_bytes=apparent_target)
    apparent = sum(f.stat().st_size for f in verifier.iterdir())
    drafter = root / "drafter"
    drafter.mkdir(parents=True)
    from synthetic import Dims, _drafter_tensors, native_config
    d = Dims(hidden=hidden, inter=hidden * 18432 // 7168, draft_vocab=draft, vocab=vocab)
    tensors = _drafter_tensors(d, ids_a)
    write_safetensors(drafter / "model.safetensors", tensors, sparse=True,
                      real_ranges=[])
    # the vocab maps must be real bytes: rewrite them over the sparse file
    _overwrite_vocab(drafter / "model.safetensors", _vocab_tensors(ids_a, vocab))
    (drafter / "config.json").write_text(json.dumps(native_config(d)))
    target = root / "target_vocab"
    target.mkdir()
    write_safetensors(target / "model.safetensors", _vocab_tensors(ids_b, vocab))
    sources = ["--source", f"drafter={drafter}", "--source", f"target_vocab={target}",
               "--source", f"verifier={verifier}"]
    plan = io_probe(["plan", str(HEADLINE), *sources, "--json"])
    out = root / "out"
    apply = io_probe(["apply", str(HEADLINE), *sources, "--out", str(out), "--no-fsync"])
    drafter_bytes = sum(t.nbytes for t in tensors)
    shutil.rmtree(out, ignore_errors=True)
    return {"apparent_bytes": apparent, "missing_rows": len(missing), "row_bytes": hidden * 2,
            "plan_read_bytes": plan["read_bytes"], "plan_wall": plan["wall"],
            "apply_read_bytes": apply["read_bytes"], "apply_wall": apply["wall"],
            "drafter_bytes": drafter_bytes, "dropped_rows": dropped,
            "needed_bytes": drafter_bytes - dropped * hidden * 2 + len(missing) * hidden * 2}


def structural_scenario(work: Path, size: int, reps: int, figures: dict[str, object]) -> list[str]:
    """stack + concat of a MoE layer set of ``size`` bytes, transpose of one tensor of half that."""
    src = structural_bench.build(work / "structural", size)
    for path in src.values():
        warm(path)
    results = run_contenders(structural_bench.contenders(work / "structural", src, PY), work, reps)
    experts, hidden, inter = structural_bench.moe_dims(size)
    moe_bytes = (src["moe"] / "model.safetensors").stat().st_size
    big_bytes = (src["big"] / "model.safetensors").stat().st_size
    figures["structural"] = {"moe_bytes": moe_bytes, "transpose_bytes": big_bytes,
                             "results": {n: {"walls": r.walls, "rss_kib": r.rss} for n, r in results.items()}}
    lines = ["", f"structural ops: MoE layer set {moe_bytes / 1e9:.2f} GB ({experts} experts, H={hidden}, "
             f"I={inter}, bf16) -> gate_up_proj + down_proj; transpose of one {big_bytes / 1e9:.2f} GB tensor",
             "", "| contender | median (s) | best (s) | / cp | / naive | peak RSS (MB) |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        family = "moe" if ("stack" in name or "moe" in name) else "big"
        cp = results[f"cp {family}"]
        naive = results["naive stack+concat" if family == "moe" else "naive transpose"]
        rel_naive = f"{paired_ratio(r, naive):.2f}" if name.startswith("ckptxform") else ""
        lines.append(f"| {name} | {r.wall:.2f} | {r.best:.2f} | {paired_ratio(r, cp):.2f} | {rel_naive} | "
                     f"{r.peak_mb:.0f} |")
    return lines


def model_parallel_scenario(work: Path, size: int, reps: int, figures: dict[str, object]) -> list[str]:
    """meta_llama_to_hf on one Meta Llama of about ``size`` bytes, whole (MP=1) and split over
    4 consolidated.NN.pth shards (MP=4): what reading a key across files costs."""
    sys.path.insert(0, str(REPO))
    from ckptxform.standins.meta_shards import MetaDims, build_meta_model_parallel

    # bf16: 2 layers of ~13.5 dim^2 values + embedding and output of 4 dim^2 each: ~67 dim^2 bytes
    dim = max(64, int((size / 67) ** 0.5) // 64 * 64)
    dims = MetaDims(dim=dim, heads=4 if dim < 1024 else 8 if dim < 2048 else 16, kv_heads=None, layers=2, vocab=4 * dim,
                    multiple_of=64, ffn_dim_multiplier=None)
    src = {n: build_meta_model_parallel(work / "meta" / f"mp{n}", dims, shards=n, seed=0) for n in (1, 4)}
    for path in src.values():
        warm(path)
    cli = [PY, "-m", "ckptxform", "-q"]
    contenders: dict[str, Callable[[Path], list[str]]] = {
        "cp mp4": lambda out: ["cp", "-r", str(src[4]), str(out)],
        **{f"ckptxform meta MP={n}": (lambda out, n=n: [*cli, "apply", "meta_llama_to_hf", f"--source=model={src[n]}",
                                                        "--out", str(out)]) for n in (1, 4)},
    }
    results = run_contenders(contenders, work, reps)
    total = sum(f.stat().st_size for f in src[4].glob("*.pth"))
    figures["model_parallel"] = {"bytes": total, "dim": dim,
                                 "results": {n: {"walls": r.walls, "rss_kib": r.rss} for n, r in results.items()}}
    lines = ["", f"model-parallel: meta_llama_to_hf on a {total / 1e9:.2f} GB Llama (dim {dim}), one file vs 4 "
             "consolidated.NN.pth shards", "", "| contender | median (s) | best (s) | / cp | peak RSS (MB) |",
             "|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r.wall:.2f} | {r.best:.2f} | {paired_ratio(r, results['cp mp4']):.2f} | "
                     f"{r.peak_mb:.0f} |")
    return lines


def dcp_scenario(work: Path, size: int, reps: int, figures: dict[str, object]) -> list[str]:
    """A 2-rank DCP checkpoint of ``size`` bytes to HF: ckptxform against cp -r and the naive path."""
    src = dcp_bench.build(work / "dcp", size)
    warm(src["ckpt"])
    rule = REPO / "rules" / "torchtitan_llama_to_hf.yaml"
    results = run_contenders(dcp_bench.contenders(work, src, PY, rule), work, reps)
    total = sum(f.stat().st_size for f in src["ckpt"].iterdir())
    figures["dcp"] = {"bytes": total, "results": {n: {"walls": r.walls, "rss_kib": r.rss} for n, r in results.items()}}
    lines = ["", f"DCP: a torchtitan Llama checkpoint of {total / 1e9:.2f} GB in 2 rank files (every tensor split by "
             "dim 0) -> HF safetensors (torchtitan_llama_to_hf)", "",
             "| contender | median (s) | best (s) | / cp -r | / naive | peak RSS (MB) |", "|---|---|---|---|---|---|"]
    cp, naive = results["cp -r dcp"], results["naive dcp_to_torch_save + convert"]
    for name, r in results.items():
        rel = f"{paired_ratio(r, naive):.2f}" if name.startswith("ckptxform") else ""
        lines.append(f"| {name} | {r.wall:.2f} | {r.best:.2f} | {paired_ratio(r, cp):.2f} | {rel} | {r.peak_mb:.0f} |")
    return lines


def _overwrite_vocab(path: Path, vocab_tensors: list[Tensor]) -> None:
    import struct
    with open(path, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        for t in vocab_tensors:
            f.seek(8 + n + header[t.key]["data_offsets"][0])
            assert t.data is not None
            f.write(t.data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2GB", help="drafter size (default 2GB)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--work", default=None, help="scratch directory (default: a new temporary one)")
    ap.add_argument("--skip-tb", action="store_true", help="skip the 1 TB sparse-verifier scenario")
    ap.add_argument("--skip-structural", action="store_true", help="skip the structural-op scenario")
    ap.add_argument("--skip-quantize", action="store_true", help="skip the bf16 -> FP8 block quantize scenario")
    ap.add_argument("--skip-mp", action="store_true", help="skip the model-parallel (Meta shards) scenario")
    ap.add_argument("--skip-dcp", action="store_true", help="skip the DCP (torchtitan) scenario")
    ap.add_argument("--dcp-only", action="store_true", help="run only the DCP scenario")
    ap.add_argument("--small-tb", action="store_true", help="a 10 GB sparse verifier with tiny dims (smoke test)")
    ap.add_argument("--json", dest="json_out", default=None, help="also write the figures here")
    ap.add_argument("--only", default=None, metavar="NAME,...",
                    help="run only these contenders (comma-separated; cp -r always runs, ratios need it)")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="ckptxform-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        if args.dcp_only:
            compile_ckptxform()
            figures: dict[str, object] = {}
            print("\n".join(dcp_scenario(work, parse_size(args.size), args.reps, figures)))
            if args.json_out:
                Path(args.json_out).write_text(json.dumps(figures, indent=2))
            return
        src = build_benchmark_sources(work / "src", parse_size(args.size))
        for path in src.values():
            warm(path)
        compile_ckptxform()
        size = sum(f.stat().st_size for f in src["drafter"].iterdir())
        rename_rule = work / "rename.yaml"
        rename_rule.write_text(RENAME_RULE)
        naive_rename, naive_headline = work / "naive_rename.py", work / "naive_headline.py"
        naive_rename.write_text(NAIVE_RENAME)
        hash_only = work / "hash_only.py"
        hash_only.write_text(HASH_ONLY)
        naive_headline.write_text(NAIVE_HEADLINE)
        # as on a user's second run: the rule files are known valid (no jsonschema import)
        subprocess.run([PY, "-m", "ckptxform", "-q", "validate", str(rename_rule), str(HEADLINE)], check=True,
                       stdout=subprocess.DEVNULL)
        headline_sources = [f"--source=drafter={src['drafter']}", f"--source=target_vocab={src['target_vocab']}",
                            f"--source=verifier={src['verifier']}"]
        cli = [PY, "-m", "ckptxform", "-q"]
        contenders: dict[str, Callable[[Path], list[str]]] = {
            "cp -r": lambda out: ["cp", "-r", str(src["drafter"]), str(out)],
            "cp -r + sync": lambda out: ["sh", "-c", f"cp -r '{src['drafter']}' '{out}' && sync '{out}'/*"],
            "sha256 alone (1 core)": lambda out: [PY, str(hash_only), "sha256", str(src["drafter"])],
            "blake3 alone (1 core)": lambda out: [PY, str(hash_only), "blake3", str(src["drafter"])],
            "naive rename": lambda out: [PY, str(naive_rename), str(src["drafter"]), str(out)],
            "ckptxform rename": lambda out: [*cli, "apply", str(rename_rule), f"--source=drafter={src['drafter']}",
                                             "--out", str(out)],
            "ckptxform rename --no-fsync": lambda out: [*cli, "apply", str(rename_rule),
                                                        f"--source=drafter={src['drafter']}", "--out", str(out),
                                                        "--no-fsync"],
            "ckptxform rename --no-fsync --digest sha256": lambda out: [
                *cli, "apply", str(rename_rule), f"--source=drafter={src['drafter']}", "--out", str(out), "--no-fsync",
                "--digest", "sha256"],
            "naive headline": lambda out: [PY, str(naive_headline), str(src["drafter"]), str(src["target_vocab"]),
                                           str(src["verifier"]), str(out)],
            "ckptxform headline": lambda out: [*cli, "apply", str(HEADLINE), *headline_sources, "--out", str(out)],
            "ckptxform headline --no-fsync": lambda out: [*cli, "apply", str(HEADLINE), *headline_sources,
                                                          "--out", str(out), "--no-fsync"],
            "ckptxform headline --no-fsync --digest sha256": lambda out: [
                *cli, "apply", str(HEADLINE), *headline_sources, "--out", str(out), "--no-fsync", "--digest", "sha256"],
        }
        if args.only:
            wanted = {"cp -r", *(name.strip() for name in args.only.split(","))}
            unknown = wanted - set(contenders)
            if unknown:
                raise SystemExit(f"--only: unknown contender(s) {sorted(unknown)}; known: {list(contenders)}")
            contenders = {name: argv for name, argv in contenders.items() if name in wanted}
        results = run_contenders(contenders, work, args.reps)
        report = [f"# ckptxform benchmark, {time.strftime('%Y-%m-%d')}, {platform.node()} "
                  f"({os.cpu_count()} cores, Python {platform.python_version()})",
                  f"drafter: {size / 1e9:.2f} GB in {len(list(src['drafter'].glob('*.safetensors')))} shards; "
                  f"{args.reps} repetitions; ratios: median of per-repetition ratios", "",
                  "| contender | median (s) | best (s) | / cp -r | / naive | peak RSS (MB) |",
                  "|---|---|---|---|---|---|"]
        for name, r in results.items():
            naive = results.get("naive headline" if "headline" in name else "naive rename")
            rel_naive = f"{paired_ratio(r, naive):.2f}" if name.startswith("ckptxform") and naive else ""
            report.append(f"| {name} | {r.wall:.2f} | {r.best:.2f} | {paired_ratio(r, results['cp -r']):.2f} | "
                          f"{rel_naive} | {r.peak_mb:.0f} |")
        figures = {"size_bytes": size, "reps": args.reps,
                   "results": {n: {"walls": r.walls, "rss_kib": r.rss} for n, r in results.items()}}
        if not args.skip_structural:
            report += structural_scenario(work, parse_size(args.size), args.reps, figures)
        if not args.skip_quantize:
            lines, figures["quantize"] = quantize_bench.run(parse_size(args.size), args.reps, work)
            report += ["", *lines]
        if not args.skip_mp:
            report += model_parallel_scenario(work, parse_size(args.size), args.reps, figures)
        if not args.skip_dcp:
            report += dcp_scenario(work, parse_size(args.size), args.reps, figures)
        if not args.skip_tb:
            tb = tb_scenario(work, small=args.small_tb)
            figures["tb"] = tb
            report += ["", f"1 TB scenario: verifier of {tb['apparent_bytes'] / 1e12:.2f} TB apparent (61 sparse shards)",
                       f"- plan: {tb['plan_wall']:.2f} s, {tb['plan_read_bytes'] / 1e6:.2f} MB read",
                       f"- apply: {tb['apply_wall']:.2f} s, {tb['apply_read_bytes'] / 1e9:.3f} GB read "
                       f"(needed: the drafter, {tb['drafter_bytes'] / 1e9:.3f} GB, less the {tb['dropped_rows']:,} "
                       f"lm_head rows the target drops, plus {tb['missing_rows']:,} verifier rows = "
                       f"{tb['needed_bytes'] / 1e9:.3f} GB; tensors copied whole are read twice from the page "
                       "cache: by the kernel copy and by their hash)"]
        print("\n".join(report))
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(figures, indent=2))
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
