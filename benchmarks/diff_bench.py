"""``ckptxform diff A B`` on two checkpoints of about ``--size`` each: wall time and peak RSS.

    python benchmarks/diff_bench.py                         # two 1 GB checkpoints, 3 reps
    python benchmarks/diff_bench.py --size 64MB --reps 1    # a quick run

A: bf16 tensors of 8 MiB (distinct random bytes each) and one ``lm_head.weight`` in 3
shards; B: the same tensors in 5 shards, two of them with one byte changed and
``lm_head.weight`` renamed ``head.weight`` (so diff exits 1 naming the two and pairing the
rename by digest). Contenders, each in its own process, alternating, from a warm page cache:
- ``cat`` of both checkpoints' weight files into /dev/null (the read floor);
- a naive script: ``safetensors.torch.load_file`` every shard of both, ``torch.equal`` per key;
- ``ckptxform diff A B`` (BLAKE3 of every tensor, default threads) and with ``--jobs 1``;
- ``ckptxform diff A B'``, B' an ``apply`` output of B whose audit holds B's digests;
- ``ckptxform diff A B --structure-only`` (headers only).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import compile_ckptxform, paired_ratio, parse_size, run_contenders, warm  # noqa: E402
from synthetic import Tensor, write_sharded  # noqa: E402

PY = sys.executable
ROWS, COLS = 2048, 2048  # one 8 MiB bf16 tensor
NAIVE_SCRIPT = """
import glob, os, sys, torch
from safetensors.torch import load_file
def load(root):
    out = {}
    for f in sorted(glob.glob(os.path.join(root, "*.safetensors"))):
        out.update(load_file(f))
    return out
a, b = load(sys.argv[1]), load(sys.argv[2])
differ = sorted(k for k in a.keys() & b.keys() if a[k].shape != b[k].shape or not torch.equal(a[k], b[k]))
print(len(differ), sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys()))
"""


def _split(tensors: list[Tensor], parts: int) -> list[list[Tensor]]:
    size = -(-len(tensors) // parts)
    return [tensors[i:i + size] for i in range(0, len(tensors), size)]


def build(root: Path, size: int) -> tuple[Path, Path]:
    """A (3 shards) and B (5 shards: two tensors changed, lm_head renamed) of ``size`` bytes each."""
    count = max(3, size // (ROWS * COLS * 2))
    a = [Tensor(f"model.layers.{i}.mlp.down_proj.weight", "BF16", (ROWS, COLS), os.urandom(ROWS * COLS * 2))
         for i in range(count - 1)]
    a.append(Tensor("lm_head.weight", "BF16", (ROWS, COLS), os.urandom(ROWS * COLS * 2)))
    b = list(a)
    for i in (1, count // 2):
        data = bytearray(a[i].data or b"")
        data[-1] ^= 0xFF
        b[i] = Tensor(a[i].key, a[i].dtype, a[i].shape, bytes(data))
    b[-1] = Tensor("head.weight", "BF16", (ROWS, COLS), a[-1].data)
    write_sharded(root / "a", _split(a, 3))
    write_sharded(root / "b", _split(b, 5))
    for side in ("a", "b"):
        (root / side / "config.json").write_text(json.dumps({"hidden_size": COLS}))
    return root / "a", root / "b"


def audited_copy(work: Path, b: Path) -> Path:
    """B kept as it is by ``apply``: an output whose audit records every tensor's digest."""
    from ckptxform import api

    rules = work / "keep.yaml"
    rules.write_text(f"version: 1\nsources:\n  b: {{path: {json.dumps(str(b))}}}\nconvert: b\n"
                     "tensors:\n  - match: '.+'\nconfig: {from: b}\n")
    api.apply(rules, out=work / "b_audited", progress=False)
    return work / "b_audited"


def contenders(work: Path, a: Path, b: Path, audited: Path) -> dict[str, Callable[[Path], list[str]]]:
    script = work / "naive_diff.py"
    script.write_text(NAIVE_SCRIPT)
    files = [str(p) for side in (a, b) for p in sorted(side.glob("*.safetensors"))]
    diff = [PY, "-m", "ckptxform", "diff", str(a)]
    return {"cat (read floor)": lambda _out: ["sh", "-c", 'cat "$@" > /dev/null', "cat", *files],
            "naive load_file + torch.equal": lambda _out: [PY, str(script), str(a), str(b)],
            "ckptxform diff": lambda _out: [*diff, str(b)],
            "ckptxform diff --jobs 1": lambda _out: [*diff, str(b), "--jobs", "1"],
            "ckptxform diff, B's digests from its audit": lambda _out: [*diff, str(audited)],
            "ckptxform diff --structure-only": lambda _out: [*diff, str(b), "--structure-only"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GB", help="bytes of each checkpoint (default 1GB)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ckptxform-diff-bench-"))
    try:
        compile_ckptxform()
        a, b = build(work, parse_size(args.size))
        audited = audited_copy(work, b)
        for side in (a, b, audited):
            warm(side)
        total = sum(p.stat().st_size for p in a.glob("*.safetensors"))
        results = run_contenders(contenders(work, a, b, audited), work, args.reps, ok=(0, 1))
        floor = results["cat (read floor)"]
        lines = [f"two checkpoints of {total / 1e9:.2f} GB ({total // (ROWS * COLS * 2)} bf16 tensors of "
                 f"[{ROWS}, {COLS}]), {args.reps} reps", "",
                 "| contender | median (s) | / cat | peak RSS (MB) |", "|---|---|---|---|"]
        for name, r in results.items():
            lines.append(f"| {name} | {r.wall:.2f} | {paired_ratio(r, floor):.2f} | {r.peak_mb:.0f} |")
        print("\n".join(lines))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
