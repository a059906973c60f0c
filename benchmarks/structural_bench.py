"""The structural-op scenario of the benchmark: byte programs and block programs at size.

- stack + concat: a MoE layer set (E experts x w1, w2, w3) into transformers 5.x's fused
  ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] (a byte program: runs of the
  source files copied by the kernel);
- transpose: one tensor of half the size (a block program: tiles gathered a block at a
  time).

Each against ``cp`` of the same source and a naive load_file -> torch ops -> save_file
script; wall time and peak RSS per process, as bench.py measures them. ckptxform runs with
and without ``--no-fsync``: the naive script (like ``cp``) does not fsync, so the fair
ratio against it is the ``--no-fsync`` one.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from synthetic import Tensor, write_safetensors

MOE_RULE = """version: 1
name: moe-fuse
sources: {model: {path: unused}}
tensors:
  - key: 'layers.{L}.experts.{E}.{P:w1,w3}.weight'
    to: 'layers.{L}.mlp.experts.gate_up_proj'
    ops: [{stack: {over: E}}, {concat: {over: P, dim: 1}}]
  - key: 'layers.{L}.experts.{E}.w2.weight'
    to: 'layers.{L}.mlp.experts.down_proj'
    ops: [{stack: {over: E}}]
"""

TRANSPOSE_RULE = """version: 1
name: transpose
sources: {model: {path: unused}}
tensors:
  - key: big.weight
    ops: [{transpose: [0, 1]}]
"""

NAIVE_MOE = r"""
import os, sys, torch
from safetensors.torch import load_file, save_file
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst)
t = load_file(os.path.join(src, "model.safetensors"))
experts = sorted({int(k.split(".")[3]) for k in t})
w = lambda e, n: t[f"layers.0.experts.{e}.{n}.weight"]
out = {"layers.0.mlp.experts.gate_up_proj": torch.cat([torch.stack([w(e, "w1") for e in experts]),
                                                      torch.stack([w(e, "w3") for e in experts])], dim=1),
       "layers.0.mlp.experts.down_proj": torch.stack([w(e, "w2") for e in experts])}
save_file(out, os.path.join(dst, "model.safetensors"))
"""

NAIVE_TRANSPOSE = r"""
import os, sys
from safetensors.torch import load_file, save_file
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst)
t = load_file(os.path.join(src, "model.safetensors"))
save_file({"big.weight": t["big.weight"].t().contiguous()}, os.path.join(dst, "model.safetensors"))
"""


def moe_dims(total: int) -> tuple[int, int, int]:
    """(experts, hidden, intermediate) of a layer set of about ``total`` bytes (bf16)."""
    experts = 8
    hidden = 4096 if total >= 1 << 30 else 64
    inter = max(8, total // (experts * 3 * hidden * 2) // 8 * 8)
    return experts, hidden, inter


def build(work: Path, total: int) -> dict[str, Path]:
    experts, hidden, inter = moe_dims(total)
    moe = work / "moe"
    moe.mkdir(parents=True, exist_ok=True)
    tensors = []
    for e in range(experts):
        tensors += [Tensor(f"layers.0.experts.{e}.w1.weight", "BF16", (inter, hidden)),
                    Tensor(f"layers.0.experts.{e}.w2.weight", "BF16", (hidden, inter)),
                    Tensor(f"layers.0.experts.{e}.w3.weight", "BF16", (inter, hidden))]
    write_safetensors(moe / "model.safetensors", tensors)
    big = work / "big"
    big.mkdir(parents=True, exist_ok=True)
    cols = 16384 if total >= 1 << 30 else 256
    rows = max(8, -(-(total // 2) // (cols * 2)))  # at least half of total: 1 GB of 2 GB
    write_safetensors(big / "model.safetensors", [Tensor("big.weight", "BF16", (rows, cols))])
    (work / "moe.yaml").write_text(MOE_RULE)
    (work / "transpose.yaml").write_text(TRANSPOSE_RULE)
    (work / "naive_moe.py").write_text(NAIVE_MOE)
    (work / "naive_transpose.py").write_text(NAIVE_TRANSPOSE)
    return {"moe": moe, "big": big}


def contenders(work: Path, src: dict[str, Path], py: str) -> dict[str, Callable[[Path], list[str]]]:
    cli = [py, "-m", "ckptxform", "-q"]

    def apply(rule: str, source: Path, *flags: str) -> Callable[[Path], list[str]]:
        return lambda out: [*cli, "apply", str(work / rule), f"--source=model={source}", "--out", str(out), *flags]

    return {
        "cp moe": lambda out: ["cp", "-r", str(src["moe"]), str(out)],
        "naive stack+concat": lambda out: [py, str(work / "naive_moe.py"), str(src["moe"]), str(out)],
        "ckptxform stack+concat": apply("moe.yaml", src["moe"]),
        "ckptxform stack+concat --no-fsync": apply("moe.yaml", src["moe"], "--no-fsync"),
        "cp big": lambda out: ["cp", "-r", str(src["big"]), str(out)],
        "naive transpose": lambda out: [py, str(work / "naive_transpose.py"), str(src["big"]), str(out)],
        "ckptxform transpose": apply("transpose.yaml", src["big"]),
        "ckptxform transpose --no-fsync": apply("transpose.yaml", src["big"], "--no-fsync"),
    }
