"""Quantization benchmark: a bf16 Llama checkpoint to FP8 block-scaled (rules/bf16_to_fp8_block.yaml).

    python benchmarks/quantize_bench.py                        # >= 2 GB of bf16 in, 3 reps
    python benchmarks/quantize_bench.py --size 200MB --reps 1  # a quick run
    python benchmarks/quantize_bench.py --rule bf16_to_w4a16   # another quantize rule (no naive contender)
    python benchmarks/quantize_bench.py --kernels              # each quantize kernel alone, one thread

The source is a bf16 Llama stand-in at Llama-3.1-8B's widths (hidden 4096, 32 heads, 8 kv
heads, intermediate 14336), with as many layers as reach ``--size``. Contenders, each in
its own process, alternating, from a warm page cache:

- ``cp -r`` of the source (the copy floor: reading the input and writing as many bytes);
- a naive script: ``load_file`` the checkpoint, quantize every targeted weight whole with
  torch (pad, block absmax, divide, clamp, cast), ``save_file``;
- ``ckptxform apply`` of the rule, with and without ``--no-fsync``.

Throughput is GB/s of bf16 input per wall second; peak RSS from GNU time. Last, ``ckptxform
apply`` runs on two sources whose largest tensor differs 4x: its peak RSS must not follow.
bench.py runs the same scenario (``--skip-quantize`` leaves it out).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import compile_ckptxform, measure, paired_ratio, parse_size, run_contenders, warm  # noqa: E402

REPO = HERE.parent
PY = sys.executable
RULE = REPO / "rules" / "bf16_to_fp8_block.yaml"

NAIVE = r"""
import json, os, re, shutil, sys, torch
from safetensors.torch import load_file, save_file
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst)
IGNORE = re.compile(r".*(embed_tokens|lm_head|mlp\.gate|mtp.*)$")
def quantize(w):
    r, c = w.shape
    p = torch.nn.functional.pad(w, (0, -c % 128, 0, -r % 128))
    b = p.unflatten(0, (-1, 128)).unflatten(2, (-1, 128))
    s = b.abs().amax(dim=(1, 3)) / torch.tensor(448.0, dtype=w.dtype)
    s[s == 0] = torch.finfo(w.dtype).eps
    q = (b / s[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.flatten(2, 3).flatten(0, 1)[:r, :c].contiguous(), s
out = {}
for key, value in load_file(os.path.join(src, "model.safetensors")).items():
    module = key.rpartition(".")[0]
    if key.endswith(".weight") and value.dim() == 2 and not module.endswith("norm") and not IGNORE.match(module):
        out[key], out[module + ".weight_scale"] = quantize(value)
    else:
        out[key] = value
save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
shutil.copy(os.path.join(src, "config.json"), dst)
"""


def build_source(root: Path, size: int, *, widen: int = 1) -> Path:
    """A bf16 Llama at Llama-3.1-8B's widths (intermediate ``widen`` times) of about ``size`` bytes."""
    from ckptxform.standins.hf_models import LmDims, build_llama

    hidden, inter = 4096, 14336 * widen
    per_layer = 2 * (hidden * hidden * 2 + hidden * 1024 * 2 + 3 * hidden * inter)
    dims = LmDims(hidden=hidden, heads=32, kv_heads=8, intermediate=inter, vocab=4096,
                  layers=max(1, round(size / per_layer)))
    return build_llama(root / f"llama-bf16-x{widen}", dims)


def _bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.glob("*.safetensors"))


def run(size: int, reps: int, work: Path, rule: Path = RULE) -> tuple[list[str], dict[str, object]]:
    """Time the contenders on a bf16 source of ``size``; (report lines, raw figures). The naive
    script quantizes to FP8 block: it runs for that rule only."""
    cli = [PY, "-m", "ckptxform", "-q"]
    src = build_source(work / "quantize-src", size)
    warm(src)
    naive = work / "naive_quantize.py"
    naive.write_text(NAIVE)
    subprocess.run([*cli, "validate", str(rule)], check=True, stdout=subprocess.DEVNULL)
    apply = [*cli, "apply", str(rule), f"--source=model={src}", "--out"]
    contenders: dict[str, Callable[[Path], list[str]]] = {
        "cp -r": lambda out: ["cp", "-r", str(src), str(out)],
        "naive load/quantize/save": lambda out: [PY, str(naive), str(src), str(out)],
        "ckptxform apply --no-fsync": lambda out: [*apply, str(out), "--no-fsync"],
        "ckptxform apply": lambda out: [*apply, str(out)],
    }
    if rule != RULE:
        del contenders["naive load/quantize/save"]
    results = run_contenders(contenders, work, reps)
    source = _bytes(src)
    shutil.rmtree(src)
    report = [f"## quantize: bf16 Llama (Llama-3.1-8B widths) {source / 1e9:.2f} GB -> {rule.stem} "
              f"(rules/{rule.name})", "",
              "| contender | median (s) | best (s) | GB/s of input | / cp -r | / naive | peak RSS (MB) |",
              "|---|---|---|---|---|---|---|"]
    naive_result = results.get("naive load/quantize/save")
    for name, r in results.items():
        rel = f"{paired_ratio(r, naive_result):.2f}" if name.startswith("ckptxform") and naive_result else ""
        report.append(f"| {name} | {r.wall:.2f} | {r.best:.2f} | {source / r.wall / 1e9:.2f} | "
                      f"{paired_ratio(r, results['cp -r']):.2f} | {rel} | {r.peak_mb:.0f} |")
    return [*report, "", *rss_probe(work, rule)], {
        "source_bytes": source, "results": {n: {"walls": r.walls, "rss_kib": r.rss} for n, r in results.items()}}


def rss_probe(work: Path, rule: Path = RULE) -> list[str]:
    """Peak RSS of ``ckptxform apply --no-fsync`` on one layer whose MLP is 1x and 4x as wide."""
    lines = ["peak RSS against tensor size (one layer, --no-fsync):", "",
             "| largest tensor (bf16 in) | wall (s) | peak RSS (MB) |", "|---|---|---|"]
    for widen in (1, 4):
        src = build_source(work / "rss", 1, widen=widen)
        warm(src)
        out = work / "rss-out"
        wall, rss = measure([PY, "-m", "ckptxform", "-q", "apply", str(rule), f"--source=model={src}",
                             "--out", str(out), "--no-fsync"])
        largest = 14336 * widen * 4096 * 2
        lines.append(f"| [{14336 * widen}, 4096] = {largest / 1e6:,.0f} MB | {wall:.2f} | {rss / 1024:.0f} |")
        shutil.rmtree(out)
        shutil.rmtree(src)
    return [*lines, ""]


def kernel_figures(reps: int = 5) -> list[str]:
    """GB/s of bf16 input of each quantize kernel on one [512, 7168] block, one thread, best of
    ``reps``: what the torch install runs (FP8 on torch, the rest on numpy), and FP8 on numpy."""
    import os
    import time

    import torch

    from ckptxform.quant import int4_quantize as int4
    from ckptxform.quant import quantize_kernels as qk
    from ckptxform.quant.layouts import Fp8Block

    def on_numpy(run: Callable[[], object]) -> Callable[[], object]:
        def wrapped() -> object:
            before = os.environ.get("CKPTXFORM_NUMERIC")
            os.environ["CKPTXFORM_NUMERIC"] = "numpy"  # the light install's kernels
            try:
                return run()
            finally:
                if before is None:
                    del os.environ["CKPTXFORM_NUMERIC"]
                else:
                    os.environ["CKPTXFORM_NUMERIC"] = before
        return wrapped

    rows, cols = 512, 7168
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    raw = weight.view(torch.uint8).numpy().tobytes()
    block = Fp8Block(cols, 128, 128)
    cases = {
        "FP8 block 128 codes (torch)": lambda: qk.fp8_rows(raw, "BF16", block),
        "FP8 block 128 codes (numpy)": on_numpy(lambda: qk.fp8_rows(raw, "BF16", block)),
        "NVFP4 codes (numpy)": lambda: qk.nvfp4_rows(raw, "BF16", cols, 1000.0),
        "W4A16 group 128 codes": lambda: int4.int4_rows(raw, "BF16", cols, 128, True),
        "W4A16 group 128 scales": lambda: int4.int4_scale_rows(raw, "BF16", cols, 128, True),
        "W4A16_ASYM group 128 codes": lambda: int4.int4_rows(raw, "BF16", cols, 128, False),
        "W4A16_ASYM zero points": lambda: int4.int4_zero_point_rows(raw, "BF16", cols, 128),
    }
    torch.set_num_threads(1)
    lines = [f"## quantize kernels alone (one thread, [{rows}, {cols}] bf16, GB/s of input, best of {reps})", "",
             "| kernel | GB/s |", "|---|---|"]
    for name, case in cases.items():
        case()  # tables and imports made once, before timing
        best = 1e9
        for _ in range(reps):
            t0 = time.perf_counter()
            case()
            best = min(best, time.perf_counter() - t0)
        lines.append(f"| {name} | {len(raw) / best / 1e9:.2f} |")
    return [*lines, ""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2GB", help="bf16 input size (default 2GB)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rule", default=RULE.stem, help="a quantizing rule of rules/ (default bf16_to_fp8_block)")
    ap.add_argument("--kernels", action="store_true", help="time each quantize kernel alone, one thread")
    args = ap.parse_args()
    if args.kernels:
        print("\n".join(kernel_figures()))
        return
    rule = REPO / "rules" / f"{args.rule}.yaml"
    if not rule.is_file():
        raise SystemExit(f"--rule {args.rule!r}: no rules/{args.rule}.yaml")
    work = Path(tempfile.mkdtemp(prefix="ckptxform-quantize-bench-"))
    try:
        compile_ckptxform()
        lines, _ = run(parse_size(args.size), args.reps, work, rule)
        print("\n".join(lines))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
