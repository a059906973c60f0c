"""Affine and view ops benchmark: `multiply` (Gemma's embedding scale) and `deinterleave`
along the last dim (gpt-oss's gate/up) on one bf16 tensor.

    python benchmarks/affine_bench.py                        # a 1 GB tensor, 3 reps
    python benchmarks/affine_bench.py --size 200MB --reps 1  # a quick run

Contenders, each in its own process, alternating, from a warm page cache:
- ``cp -r`` of the source (the copy floor: as many bytes read and written);
- a naive script: ``load_file``, the op in torch on the whole tensor
  (``(w.float() * c).to(bf16)``, ``w[..., ::2]`` and ``w[..., 1::2]``), ``save_file``;
- ``ckptxform apply`` of the one-op rule (a block of rows at a time, numpy), and of a
  plain copy (what the rest of a run costs: start, write, digest, fsync).
Throughput is GB/s of output per wall second; peak RSS from GNU time. Last, ``ckptxform
apply`` of the multiply on a tensor 4x smaller: its peak RSS must not follow the size.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import compile_ckptxform, measure, paired_ratio, parse_size, run_contenders, warm  # noqa: E402

PY = sys.executable
COLS = 4096
RULES = {
    "copy": "tensors:\n  - key: w\n",
    "multiply": "tensors:\n  - key: w\n    ops: [{multiply: {value: '${sqrt(config.hidden_size)}', "
                "round_value_to: tensor}}]\n",
    "deinterleave": "tensors:\n  - key: w\n    to: '{P:gate,up}'\n    ops: [{deinterleave: {into: P, dim: -1}}]\n",
}
NAIVE = {
    "copy": "out = {'w': w}",
    "multiply": "out = {'w': (w.float() * torch.tensor(4096 ** 0.5, dtype=torch.bfloat16).float()).to(w.dtype)}",
    "deinterleave": "out = {'gate': w[..., ::2].contiguous(), 'up': w[..., 1::2].contiguous()}",
}
NAIVE_SCRIPT = """
import os, sys, torch
from safetensors.torch import load_file, save_file
w = load_file(os.path.join(sys.argv[1], "model.safetensors"))["w"]
{op}
os.makedirs(sys.argv[2])
save_file(out, os.path.join(sys.argv[2], "model.safetensors"))
"""


def build(root: Path, size: int) -> Path:
    """A source of one bf16 tensor [rows, 4096] of about ``size`` bytes, and its config."""
    import json

    import torch
    from safetensors.torch import save_file

    rows = max(1, size // (COLS * 2))
    root.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    w = torch.empty(rows, COLS, dtype=torch.bfloat16)
    for start in range(0, rows, 4096):
        stop = min(rows, start + 4096)
        w[start:stop] = torch.randn(stop - start, COLS, generator=gen).to(torch.bfloat16)
    save_file({"w": w}, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps({"hidden_size": COLS}))
    return root


def rule(work: Path, op: str) -> Path:
    path = work / f"{op}.yaml"
    path.write_text("version: 1\nsources: {model: {path: ./src}}\nconvert: model\n" + RULES[op])
    return path


def contenders(work: Path, src: Path, op: str) -> dict[str, Callable[[Path], list[str]]]:
    script = work / f"naive_{op}.py"
    script.write_text(NAIVE_SCRIPT.format(op=NAIVE[op]))
    apply = [PY, "-m", "ckptxform", "-q", "apply", str(rule(work, op)), f"--source=model={src}"]
    return {"cp -r": lambda out: ["cp", "-r", str(src), str(out)],
            f"naive torch {op}": lambda out: [PY, str(script), str(src), str(out)],
            f"ckptxform {op}": lambda out: [*apply, "--out", str(out)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GB", help="tensor size (default 1GB)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    size = parse_size(args.size)
    work = Path(tempfile.mkdtemp(prefix="ckptxform-affine-bench-"))
    try:
        compile_ckptxform()
        src = build(work / "src", size)
        warm(src)
        written = (src / "model.safetensors").stat().st_size
        lines = [f"one bf16 tensor of {written / 1e9:.2f} GB, [{written // (2 * COLS)}, {COLS}]", "",
                 "| contender | median (s) | GB/s of output | / cp | / naive | peak RSS (MB) |",
                 "|---|---|---|---|---|---|"]
        for op in RULES:
            results = run_contenders(contenders(work, src, op), work, args.reps)
            cp, naive = results["cp -r"], results[f"naive torch {op}"]
            for name, r in results.items():
                if name == "cp -r" and op != "copy":
                    continue
                rel = f"{paired_ratio(r, naive):.2f}" if name.startswith("ckptxform") else ""
                lines.append(f"| {name} | {r.wall:.2f} | {written / r.wall / 1e9:.2f} | {paired_ratio(r, cp):.2f} | "
                             f"{rel} | {r.peak_mb:.0f} |")
        small = build(work / "small", size // 4)
        warm(small)
        rss = []
        for source in (small, src):
            out = work / "rss_out"
            shutil.rmtree(out, ignore_errors=True)
            _, kib = measure([PY, "-m", "ckptxform", "-q", "apply", str(rule(work, "multiply")),
                              f"--source=model={source}", "--out", str(out)])
            rss.append(kib / 1024)
        lines += ["", f"ckptxform multiply peak RSS: {rss[0]:.0f} MB on a {size / 4e9:.2f} GB tensor, "
                      f"{rss[1]:.0f} MB on {size / 1e9:.2f} GB"]
        print("\n".join(lines))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
