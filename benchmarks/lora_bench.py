"""LoRA merge benchmark: peak RSS of ``rules/peft_lora_merge.yaml`` against the same merge
done in memory, as peft's merge_and_unload does it (whole tensors in torch).

    python benchmarks/lora_bench.py                         # a 1 GB bf16 weight, 3 reps
    python benchmarks/lora_bench.py --size 256MB --reps 1   # a quick run

The base is one bf16 weight ``[rows, 4096]`` (a down_proj of about ``size`` bytes); the
adapter a rank-16 float32 LoRA of it, saved as peft saves one. Contenders, each in its own
process, alternating, from a warm page cache:
- a naive script: ``load_file`` both, ``(W.float() + (B @ A) * scale).to(bf16)``, ``save_file``
  (peft's arithmetic on whole tensors: the float32 delta and sum are each 2x the weight);
- ``ckptxform apply`` of the shipped rule (a band of rows at a time).
Then the rule on a weight 4x smaller: its peak RSS must not follow the weight's size.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import compile_ckptxform, measure, paired_ratio, parse_size, run_contenders, warm  # noqa: E402

PY = sys.executable
COLS, RANK, ALPHA = 4096, 16, 32
KEY = "model.layers.0.mlp.down_proj"
RULE = HERE.parent / "rules" / "peft_lora_merge.yaml"
NAIVE_SCRIPT = f"""
import os, sys, torch
from safetensors.torch import load_file, save_file
w = load_file(os.path.join(sys.argv[1], "model.safetensors"))
a = load_file(os.path.join(sys.argv[2], "adapter_model.safetensors"))
k = "{KEY}"
A, B = a["base_model.model." + k + ".lora_A.weight"], a["base_model.model." + k + ".lora_B.weight"]
w[k + ".weight"] = (w[k + ".weight"].float() + (B @ A) * {ALPHA / RANK}).to(torch.bfloat16)
os.makedirs(sys.argv[3])
save_file(w, os.path.join(sys.argv[3], "model.safetensors"))
"""


def build(root: Path, size: int) -> tuple[Path, Path]:
    """base/ (one bf16 weight of about ``size`` bytes) and adapter/ (its rank-16 LoRA)."""
    import torch
    from safetensors.torch import save_file

    rows = max(1, size // (COLS * 2))
    gen = torch.Generator().manual_seed(0)
    w = torch.empty(rows, COLS, dtype=torch.bfloat16)
    for start in range(0, rows, 4096):
        stop = min(rows, start + 4096)
        w[start:stop] = (torch.randn(stop - start, COLS, generator=gen) * 0.02).to(torch.bfloat16)
    base, adapter = root / "base", root / "adapter"
    base.mkdir(parents=True)
    adapter.mkdir()
    save_file({f"{KEY}.weight": w}, str(base / "model.safetensors"))
    # a transformers config (the rule asks for one) that fits a down_proj [hidden, intermediate]
    (base / "config.json").write_text(json.dumps({"hidden_size": rows, "intermediate_size": COLS}))
    save_file({f"base_model.model.{KEY}.lora_A.weight": torch.randn(RANK, COLS, generator=gen) * 0.01,
               f"base_model.model.{KEY}.lora_B.weight": torch.randn(rows, RANK, generator=gen) * 0.01},
              str(adapter / "adapter_model.safetensors"))
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": ["down_proj"]}))
    return base, adapter


def contenders(work: Path, base: Path, adapter: Path) -> dict[str, Callable[[Path], list[str]]]:
    script = work / "naive_merge.py"
    script.write_text(NAIVE_SCRIPT)
    apply = [PY, "-m", "ckptxform", "-q", "apply", str(RULE), f"--source=base={base}", f"--source=adapter={adapter}"]
    return {"naive torch merge": lambda out: [PY, str(script), str(base), str(adapter), str(out)],
            "ckptxform peft_lora_merge": lambda out: [*apply, "--out", str(out)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GB", help="weight size (default 1GB)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    size = parse_size(args.size)
    work = Path(tempfile.mkdtemp(prefix="ckptxform-lora-bench-"))
    try:
        compile_ckptxform()
        base, adapter = build(work / "big", size)
        warm(work / "big")
        written = (base / "model.safetensors").stat().st_size
        results = run_contenders(contenders(work, base, adapter), work, args.reps)
        naive = results["naive torch merge"]
        lines = [f"one bf16 weight of {written / 1e9:.2f} GB, [{written // (2 * COLS)}, {COLS}], rank-{RANK} LoRA", "",
                 "| contender | median (s) | / naive | peak RSS (MB) |", "|---|---|---|---|"]
        for name, r in results.items():
            lines.append(f"| {name} | {r.wall:.2f} | {paired_ratio(r, naive):.2f} | {r.peak_mb:.0f} |")
        small_base, small_adapter = build(work / "small", size // 4)
        warm(work / "small")
        rss = []
        for b, a in ((small_base, small_adapter), (base, adapter)):
            out = work / "rss_out"
            shutil.rmtree(out, ignore_errors=True)
            _, kib = measure([PY, "-m", "ckptxform", "-q", "apply", str(RULE), f"--source=base={b}",
                              f"--source=adapter={a}", "--out", str(out)])
            rss.append(kib / 1024)
        lines += ["", f"ckptxform peft_lora_merge peak RSS: {rss[0]:.0f} MB on a {size / 4e9:.2f} GB weight, "
                      f"{rss[1]:.0f} MB on {size / 1e9:.2f} GB"]
        print("\n".join(lines))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
