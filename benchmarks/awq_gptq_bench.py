"""AutoAWQ and GPTQ dequantization benchmark: ``rules/awq_to_bf16.yaml`` and
``rules/gptq_to_bf16.yaml`` (desc_act, asymmetric) at two sizes, beside
``rules/compressed_int4_to_bf16.yaml`` on the same modules.

    python benchmarks/awq_gptq_bench.py                        # 2 GB of bf16 output each, 3 reps
    python benchmarks/awq_gptq_bench.py --size 400MB --reps 1  # a quick run

Sources: modules at Llama-3.1-8B's MLP widths (``up_proj`` [in 4096, out 14336] and
``down_proj`` [in 14336, out 4096]), group 128, random codes and zero points, float16 scales,
as AutoAWQ GEMM and auto-gptq (v1) store them, one safetensors file each, added until the
bf16 output reaches ``--size``; and the AWQ source repacked by ``rules/awq_to_compressed_int4.yaml``
(compressed-tensors ``pack-quantized``, asymmetric: the same codes, zero points and scales),
the yardstick. Each run is ``ckptxform apply`` in its own process from a warm page cache
(``--no-fsync``), the three alternating; throughput is GB/s of bf16 written per wall second,
peak RSS from GNU time, and each format's time over compressed_int4_to_bf16's is the median of
the ratios within a repetition (the machine is shared: runs minutes apart compare nothing).
The same at a quarter of the size: peak RSS must not follow the size (a module is decoded a
band of output rows at a time).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import compile_ckptxform, paired_ratio, parse_size, run_contenders, warm  # noqa: E402

PY = sys.executable
RULES = {stem: HERE.parent / "rules" / f"{stem}.yaml" for stem in
         ("awq_to_bf16", "gptq_to_bf16", "compressed_int4_to_bf16", "awq_to_compressed_int4")}
HIDDEN, INTERMEDIATE, GROUP = 4096, 14336, 128


def build(root: Path, fmt: str, out_bytes: int) -> Path:
    """An AWQ or GPTQ source whose bf16 output is about ``out_bytes``."""
    import numpy as np

    from ckptxform.standins.awq_gptq import awq_config, gptq_config
    from ckptxform.standins.tensors import save_safetensors

    rng = np.random.default_rng(0)
    modules = max(2, -(-out_bytes // (HIDDEN * INTERMEDIATE * 2)))
    tensors: dict[str, np.ndarray] = {}

    def words(*shape: int) -> np.ndarray:
        return rng.integers(-(2**31), 2**31 - 1, shape, dtype=np.int32)

    for m in range(modules):
        rows_in, rows_out = (HIDDEN, INTERMEDIATE) if m % 2 == 0 else (INTERMEDIATE, HIDDEN)
        x = f"model.layers.{m // 2}.mlp.{'up' if m % 2 == 0 else 'down'}_proj"
        groups = rows_in // GROUP
        tensors[f"{x}.scales"] = rng.uniform(0.001, 0.02, (groups, rows_out)).astype(np.float16)
        tensors[f"{x}.qzeros"] = words(groups, rows_out // 8)
        if fmt == "awq":
            tensors[f"{x}.qweight"] = words(rows_in, rows_out // 8)
        else:
            tensors[f"{x}.qweight"] = words(rows_in // 8, rows_out)
            tensors[f"{x}.g_idx"] = rng.permutation(np.arange(rows_in, dtype=np.int32) // GROUP).astype(np.int32)
    src = root / fmt
    src.mkdir(parents=True)
    save_safetensors(tensors, src / "model.safetensors")
    config = awq_config(GROUP) if fmt == "awq" else gptq_config(GROUP, desc_act=True, sym=False)
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": config}))
    return src


def repacked(root: Path, awq: Path) -> Path:
    """The AWQ source as compressed-tensors stores it (rules/awq_to_compressed_int4.yaml)."""
    import subprocess

    out = root / "compressed_int4"
    subprocess.run([PY, "-m", "ckptxform", "-q", "apply", str(RULES["awq_to_compressed_int4"]),
                    f"--source=model={awq}", "--no-fsync", "--out", str(out)], check=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2GB", help="bf16 output of the larger run (default 2GB)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    size = parse_size(args.size)
    work = Path(tempfile.mkdtemp(prefix="ckptxform-awq-gptq-bench-"))
    lines = ["| rule | bf16 out (GB) | median (s) | GB/s | time / compressed_int4_to_bf16's | peak RSS (MB) |",
             "|---|---|---|---|---|---|"]
    try:
        compile_ckptxform()
        for out_bytes in (size // 4, size):
            root = work / str(out_bytes)
            sources = {fmt: build(root, fmt, out_bytes) for fmt in ("awq", "gptq")}
            sources["compressed_int4"] = repacked(root, sources["awq"])
            contenders = {}
            for fmt, src in sources.items():
                warm(src)
                apply = [PY, "-m", "ckptxform", "-q", "apply", str(RULES[f"{fmt}_to_bf16"]), f"--source=model={src}",
                         "--no-fsync"]
                contenders[f"{fmt}_to_bf16"] = lambda out, a=apply: [*a, "--out", str(out)]
            results = run_contenders(contenders, work, args.reps)
            modules = max(2, -(-out_bytes // (HIDDEN * INTERMEDIATE * 2)))
            written = modules * HIDDEN * INTERMEDIATE * 2
            yardstick = results["compressed_int4_to_bf16"]
            for name, result in results.items():
                lines.append(f"| {name} | {written / 1e9:.2f} | {result.wall:.2f} | {written / 1e9 / result.wall:.2f} "
                             f"| {paired_ratio(result, yardstick):.2f} | {result.peak_mb:.0f} |")
            shutil.rmtree(root)
        print("\n".join(lines))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
