"""Dequantization benchmark: FP8 block-scaled, int4 pack-quantized and NVFP4 checkpoints to bf16.

    python benchmarks/dequant_bench.py                        # >= 2 GB of FP8 and of int4 weights, 3 reps
    python benchmarks/dequant_bench.py --size 200MB --reps 1  # a quick run
    python benchmarks/dequant_bench.py --formats mxfp4 --size 500MB  # gpt-oss MXFP4 (mxfp4_source.py)
    python benchmarks/dequant_bench.py --formats fp8 --size 1GB --reps 7 --skip-rss \
        --contenders 'ckptxform apply --no-fsync'   # issue 36's FP8 figure: apply against cp -r alone
    python benchmarks/dequant_bench.py ... --settle 6  # on a vm that hands freed memory back to its host

Sources are the Kimi-K2 stand-ins at the real widths (hidden 7168, FP8 block 128, int4
group 32; ``kv_a_proj_with_mqa`` [576, 7168] with its partial edge block), with enough
routed experts that the quantized weights alone reach ``--size``; 4 shards, so that a
shard is as large as a few of the largest tensors (the real ones are ~16 GB). NVFP4
(``--formats nvfp4``): compressed-tensors ``nvfp4-pack-quantized`` modules of random codes
and e4m3 scales at the real widths ([18432, 7168] and its transpose, Kimi-K2's dense MLP),
4 shards, through ``rules/nvfp4_to_bf16.yaml``.

Contenders, each in its own process, alternating, from a warm page cache:
- ``cp -r`` of the bf16 output (the copy floor: reading and writing as many bytes as the
  conversion writes);
- a naive script: ``load_file`` each shard, dequantize whole tensors with torch,
  ``save_file`` (what DeepSeek's ``fp8_cast_bf16.py`` does, on CPU);
- ``ckptxform apply`` of ``rules/fp8_block_to_bf16.yaml`` / ``rules/compressed_int4_to_bf16.yaml``,
  with and without ``--no-fsync``;
- FP8 only, ``floor probe``: fp8_floor_probe.py, the same reads, kernel, hashes and writes
  with no plan, audit or checks (what the rest of ckptxform costs).
Throughput is GB/s of output (bf16 bytes written) per wall second; peak RSS from GNU time.
Last, ``ckptxform apply`` runs on two FP8 sources whose largest tensor differs 4x
(264 MB and 1 GB of bf16), and on two NVFP4 ones alike: its peak RSS must not follow.

``--kernels`` times the block kernels alone instead (one thread, a [512, 7168] block of
the real widths, best of 8, alternating): what the torch install and the light install (numpy) run (torch's
FP8 bands, numpy's table gathers: quant/tables.py) against numpy's arithmetic passes, the
bytes checked equal.
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
from harness import compile_ckptxform, measure, paired_ratio, parse_size, run_contenders, warm  # noqa: E402
import mxfp4_source  # noqa: E402

REPO = HERE.parent
PY = sys.executable
RULES = {"fp8": REPO / "rules" / "fp8_block_to_bf16.yaml", "int4": REPO / "rules" / "compressed_int4_to_bf16.yaml",
         "mxfp4": REPO / "rules" / "mxfp4_to_bf16.yaml", "nvfp4": REPO / "rules" / "nvfp4_to_bf16.yaml"}
NAIVE = {"mxfp4": mxfp4_source.NAIVE_MXFP4}

# Shared by both naive scripts: walk the shards, fetch a scale from another shard when
# the index puts it there, write each shard's dequantized tensors as one file.
NAIVE_HEAD = r"""
import json, os, sys, torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst)
index = json.load(open(os.path.join(src, "model.safetensors.index.json")))
config = json.load(open(os.path.join(src, "config.json")))
def tensor(key, loaded):
    if key in loaded:
        return loaded[key]
    with safe_open(os.path.join(src, index["weight_map"][key]), "pt") as f:
        return f.get_tensor(key)
"""

NAIVE_LOOP = r"""
weight_map = {}
for shard in sorted(set(index["weight_map"].values())):
    loaded = load_file(os.path.join(src, shard))
    out = {}
    for key, value in loaded.items():
        name = dequantize(key, value, loaded)
        if name is not None:
            out[name[0]] = name[1]
    save_file(out, os.path.join(dst, shard), metadata={"format": "pt"})
    weight_map.update({k: shard for k in out})
config.pop("quantization_config", None)
json.dump(config, open(os.path.join(dst, "config.json"), "w"))
json.dump({"metadata": {}, "weight_map": weight_map}, open(os.path.join(dst, "model.safetensors.index.json"), "w"))
"""

NAIVE_FP8 = r"""
bh, bw = config["quantization_config"]["weight_block_size"]
def dequantize(key, value, loaded):
    if key.endswith("_scale_inv"):
        return None
    if value.dtype != torch.float8_e4m3fn:
        return key, value
    s = tensor(key + "_scale_inv", loaded)
    rows, cols = value.shape
    s = s.repeat_interleave(bh, 0)[:rows].repeat_interleave(bw, 1)[:, :cols]
    return key, (value.to(torch.float32) * s).to(torch.bfloat16)
"""

NAIVE_INT4 = r"""
group = config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"]
shifts = torch.arange(0, 32, 4, dtype=torch.int32)
def dequantize(key, value, loaded):
    if key.endswith(("weight_scale", "weight_shape")):
        return None
    if not key.endswith("weight_packed"):
        return key, value
    module = key.removesuffix(".weight_packed")
    rows, cols = tensor(module + ".weight_shape", loaded).tolist()
    q = ((value.unsqueeze(-1) >> shifts) & 0xF).reshape(rows, -1)[:, :cols] - 8
    scale = tensor(module + ".weight_scale", loaded)
    return module + ".weight", q.to(torch.bfloat16) * scale.repeat_interleave(group, 1)
"""

NAIVE_NVFP4 = r"""
pairs = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
def dequantize(key, value, loaded):
    if key.endswith(("weight_scale", "weight_global_scale")):
        return None
    if not key.endswith("weight_packed"):
        return key, value
    module = key.removesuffix(".weight_packed")
    codes = torch.stack((value & 0xF, value >> 4), dim=-1).flatten(-2).long()
    values = pairs[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    scale = tensor(module + ".weight_scale", loaded).float() / tensor(module + ".weight_global_scale", loaded)
    rows, cols = values.shape
    return module + ".weight", (values.view(rows, -1, 16) * scale[:, :, None]).view(rows, cols).to(torch.bfloat16)
"""

NAIVE["nvfp4"] = NAIVE_NVFP4

#: the NVFP4 modules' shape: Kimi-K2's dense MLP width (and its transpose)
NVFP4_ROWS, NVFP4_COLS = 18432, 7168


def build_nvfp4_source(root: Path, quantized_bytes: int, *, widen: int = 1) -> Path:
    """compressed-tensors nvfp4-pack-quantized modules of random codes and e4m3 scales,
    about ``quantized_bytes`` of codes, in 4 shards (``widen``: rows of each module x that)."""
    import numpy as np

    from ckptxform.dtypes import numpy_dtype
    from ckptxform.standins.scaled import scaled_quantization_config
    from ckptxform.standins.tensors import save_safetensors, write_json

    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    shapes = [(NVFP4_ROWS * widen, NVFP4_COLS), (NVFP4_COLS * widen, NVFP4_ROWS)]
    per_module = sum(r * c // 2 for r, c in shapes) // 2
    modules = max(2, -(-quantized_bytes // per_module))
    shards: list[dict[str, np.ndarray]] = [{} for _ in range(4)]
    for m in range(modules):
        rows, cols = shapes[m % 2]
        x = f"model.layers.{m}.mlp.{'up' if m % 2 == 0 else 'down'}_proj"
        shard = shards[m * 4 // modules]
        shard[x + ".weight_packed"] = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
        shard[x + ".weight_scale"] = rng.integers(0x08, 0x78, (rows, cols // 16), dtype=np.uint8)  # finite e4m3
        shard[x + ".weight_global_scale"] = np.array([2688.0], dtype=np.float32)
    weight_map = {}
    for i, tensors in enumerate(shards):
        name = f"model-{i + 1:05d}-of-00004.safetensors"
        raw = {k: v.view(numpy_dtype("F8_E4M3")) if k.endswith(".weight_scale") else v for k, v in tensors.items()}
        save_safetensors(raw, root / name)
        weight_map.update({k: name for k in tensors})
    write_json(root / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map})
    write_json(root / "config.json", {"model_type": "llama", "quantization_config": scaled_quantization_config("nvfp4")})
    return root


def build_source(root: Path, fmt: str, quantized_bytes: int) -> Path:
    """A Kimi-K2 stand-in at the real widths with about ``quantized_bytes`` of FP8 or
    int4 weights (routed experts added until the size is reached); gpt-oss for MXFP4."""
    from ckptxform.standins import KIMI_K2_TEXT, build_kimi_k2

    if fmt == "mxfp4":
        return mxfp4_source.build_for_size(root / "gpt-oss", quantized_bytes)

    if fmt == "nvfp4":
        return build_nvfp4_source(root / "nvfp4", quantized_bytes)
    expert = 3 * KIMI_K2_TEXT.hidden * KIMI_K2_TEXT.moe_intermediate  # gate, up, down
    per_expert = expert if fmt == "fp8" else expert // 2
    dense = 0
    if fmt == "fp8":  # the dense layer and the attention are FP8 too
        dense = 3 * KIMI_K2_TEXT.hidden * KIMI_K2_TEXT.intermediate
    experts = max(2, -(-(quantized_bytes - dense) // per_expert))
    dims = KIMI_K2_TEXT.scaled(1, layers=2, routed_experts=experts, experts_per_token=2, vocab=4096)
    return build_kimi_k2(root / f"kimi-k2-{fmt}", dims, quantization=fmt, num_shards=4).path


def rss_probe(work: Path) -> list[str]:
    """Peak RSS of ``ckptxform apply`` on two FP8 sources whose largest tensors differ 4x
    (the dense MLP at the real width, then at 4x): it must not grow with the tensor."""
    from ckptxform.standins import KIMI_K2_TEXT, build_kimi_k2

    lines = ["## peak RSS against tensor size (FP8, one dense layer, --no-fsync)", "",
             "| largest tensor (bf16 out) | wall (s) | peak RSS (MB) |", "|---|---|---|"]
    for widen in (1, 4):
        dims = KIMI_K2_TEXT.scaled(1, layers=1, intermediate=KIMI_K2_TEXT.intermediate * widen,
                                   routed_experts=2, experts_per_token=2, vocab=4096)
        src = build_kimi_k2(work / f"dense-x{widen}", dims, num_shards=4).path
        warm(src)
        out = work / "rss-out"
        wall, rss = measure([PY, "-m", "ckptxform", "-q", "apply", str(RULES["fp8"]), f"--source=model={src}",
                             "--out", str(out), "--no-fsync"])
        largest = dims.intermediate * dims.hidden * 2
        lines.append(f"| [{dims.intermediate}, {dims.hidden}] = {largest / 1e6:,.0f} MB | {wall:.2f} | {rss / 1024:.0f} |")
        shutil.rmtree(out)
        shutil.rmtree(src)
    lines += ["", "## peak RSS against tensor size (NVFP4, two modules, --no-fsync)", "",
              "| largest tensor (bf16 out) | wall (s) | peak RSS (MB) |", "|---|---|---|"]
    for widen in (1, 4):
        src = build_nvfp4_source(work / f"nvfp4-x{widen}", 0, widen=widen)
        warm(src)
        out = work / "rss-out"
        wall, rss = measure([PY, "-m", "ckptxform", "-q", "apply", str(RULES["nvfp4"]), f"--source=model={src}",
                             "--out", str(out), "--no-fsync"])
        rows = NVFP4_ROWS * widen
        lines.append(f"| [{rows}, {NVFP4_COLS}] = {rows * NVFP4_COLS * 2 / 1e6:,.0f} MB | {wall:.2f} | "
                     f"{rss / 1024:.0f} |")
        shutil.rmtree(out)
        shutil.rmtree(src)
    return [*lines, ""]


def output_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.glob("*.safetensors"))


def run(fmt: str, size: int, reps: int, work: Path,
        only: list[str] | None = None, settle: float = 0.0) -> tuple[list[str], dict[str, object]]:
    """Build the ``fmt`` source, time the contenders on it (those named in ``only``, with
    ``cp -r`` always; all when None); (report lines, raw figures)."""
    cli = [PY, "-m", "ckptxform", "-q"]
    src = build_source(work / "src", fmt, size)
    warm(src)
    naive = work / f"naive_{fmt}.py"
    naive.write_text(NAIVE_HEAD + NAIVE.get(fmt, NAIVE_FP8 if fmt == "fp8" else NAIVE_INT4) + NAIVE_LOOP)
    subprocess.run([*cli, "validate", str(RULES[fmt])], check=True, stdout=subprocess.DEVNULL)
    apply = [*cli, "apply", str(RULES[fmt]), f"--source=model={src}", "--out"]
    probe = work / "probe"
    subprocess.run([*apply, str(probe), "--no-fsync"], check=True, stdout=subprocess.DEVNULL)
    written = output_bytes(probe)
    warm(probe)
    contenders: dict[str, Callable[[Path], list[str]]] = {
        "cp -r": lambda out: ["cp", "-r", str(probe), str(out)],
        "naive load/dequant/save": lambda out: [PY, str(naive), str(src), str(out)],
        "ckptxform apply --no-fsync": lambda out: [*apply, str(out), "--no-fsync"],
        "ckptxform apply": lambda out: [*apply, str(out)],
    }
    if fmt == "fp8":  # the same work with nothing else: the floor of the design (fp8_floor_probe.py)
        contenders["floor probe"] = lambda out: [PY, str(HERE / "fp8_floor_probe.py"), str(src), str(out)]
    if only is not None:
        unknown = sorted(set(only) - set(contenders))
        if unknown:
            raise SystemExit(f"--contenders: unknown {', '.join(map(repr, unknown))} (known: "
                             f"{', '.join(map(repr, contenders))})")
        contenders = {name: argv for name, argv in contenders.items() if name == "cp -r" or name in only}
    results = run_contenders(contenders, work, reps, settle=settle)
    shutil.rmtree(probe)
    source, shards = output_bytes(src), len(list(src.glob("*.safetensors")))
    shutil.rmtree(src)
    report = [f"## {fmt}: source {source / 1e9:.2f} GB in {shards} shards, output {written / 1e9:.2f} GB bf16", "",
              "| contender | median (s) | best (s) | GB/s of output | / cp -r | / naive | peak RSS (MB) |",
              "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        naive = results.get("naive load/dequant/save")
        rel = f"{paired_ratio(r, naive):.2f}" if naive is not None and name.startswith("ckptxform") else ""
        report.append(f"| {name} | {r.wall:.2f} | {r.best:.2f} | {written / r.wall / 1e9:.2f} | "
                      f"{paired_ratio(r, results['cp -r']):.2f} | {rel} | {r.peak_mb:.0f} |")
    return [*report, ""], {"source_bytes": source, "output_bytes": written,
                           "results": {n: {"walls": r.walls, "rss_kib": r.rss} for n, r in results.items()}}


def kernel_figures(reps: int = 8) -> list[str]:
    """GB/s of bf16 output of one block kernel call on one thread: what the torch install
    and the light install (numpy) run, against numpy's arithmetic passes."""
    import numpy as np
    import torch

    from ckptxform.quant import kernels, numpy_kernels, tables, torch_kernels
    from ckptxform.quant.kernels import (
        Fp4Groups,
        Fp8Block,
        Int4Groups,
        dequant_fp4_rows,
        dequant_fp8_rows,
        dequant_int4_rows,
        dequant_nvfp4_rows,
        nvfp4_scales,
    )

    rows, cols, rng = 512, 7168, np.random.default_rng(0)
    w = rng.integers(0, 256, rows * cols, dtype=np.uint8)
    w[(w & 0x7F) == 0x7F] = 0x3C  # no NaN: the common case
    weight = w.tobytes()
    fp8_scale = (rng.random((4, 56), dtype=np.float32) * 0.01).tobytes()
    packed = rng.integers(0, 2**32, rows * cols // 8, dtype=np.uint32).tobytes()
    f32_scale = {g: rng.random((rows, cols // g), dtype=np.float32) for g in (32, 128)}
    bf16_scale = {g: (s.view(np.uint32) >> 16).astype(np.uint16).tobytes() for g, s in f32_scale.items()}  # any bf16
    fp4 = w[: rows * cols // 2].tobytes()
    e4m3 = rng.integers(0x08, 0x78, rows * cols // 16, dtype=np.uint8).tobytes()
    nvfp4 = Fp4Groups(cols, 16)
    cases = {
        "FP8 block 128": lambda: dequant_fp8_rows(weight, fp8_scale, Fp8Block(cols, 128, 128)),
        "int4 group 32, BF16 scale": lambda: dequant_int4_rows(packed, bf16_scale[32], Int4Groups(cols, 32, "BF16")),
        "int4 group 32, F32 scale": lambda: dequant_int4_rows(packed, f32_scale[32].tobytes(),
                                                              Int4Groups(cols, 32, "F32")),
        "int4 group 128, BF16 scale": lambda: dequant_int4_rows(packed, bf16_scale[128],
                                                                Int4Groups(cols, 128, "BF16")),
    }
    # NVFP4: the pair table of the e4m3 scale bytes, against the group scales then the arithmetic
    fused = {"NVFP4 (e4m3 scales, global 2688)": lambda: dequant_nvfp4_rows(fp4, e4m3, 2688.0, nvfp4, divide=True)}
    arith = {"NVFP4 (e4m3 scales, global 2688)": lambda: dequant_fp4_rows(
        fp4, nvfp4_scales(e4m3, 2688.0, divide=True), nvfp4)}
    # (backend, tables where they pay): what each install runs, and numpy's arithmetic
    contenders = {"torch install": (torch_kernels, True), "light install (numpy)": (numpy_kernels, True),
                  "numpy arithmetic": (numpy_kernels, False)}
    lines = [f"## block kernels alone (one thread, [{rows}, {cols}], GB/s of bf16 output, best of {reps})", "",
             "| kernel | " + " | ".join(contenders) + " |", "|---|" + "---|" * len(contenders)]
    torch.set_num_threads(1)
    chosen = kernels.backend, tables.fp8_worth_it, tables.int4_worth_it
    try:
        for name in [*cases, *fused]:
            best = {c: 1e9 for c in contenders}
            outs = {}
            for _ in range(reps):
                for c, (module, table) in contenders.items():
                    kernels.backend = lambda m=module: m
                    tables.fp8_worth_it, tables.int4_worth_it = chosen[1:] if table else (lambda *_: False,) * 2
                    case = cases.get(name) or (fused if table else arith)[name]
                    t0 = time.perf_counter()
                    outs[c] = bytes(case())
                    best[c] = min(best[c], time.perf_counter() - t0)
            assert len(set(outs.values())) == 1, f"{name}: the kernels' bytes differ"
            lines.append(f"| {name} | " + " | ".join(f"{rows * cols * 2 / best[c] / 1e9:.2f}" for c in contenders)
                         + " |")
    finally:
        kernels.backend, tables.fp8_worth_it, tables.int4_worth_it = chosen
    return [*lines, *mxfp4_source.kernel_lines(reps), ""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2GB", help="quantized weights per format (default 2GB)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--formats", default="fp8,int4")
    ap.add_argument("--skip-rss", action="store_true", help="skip the peak-RSS-against-tensor-size probe")
    ap.add_argument("--work", default=None, help="scratch directory (default: a new temporary one)")
    ap.add_argument("--json", dest="json_out", default=None, help="also write the figures here")
    ap.add_argument("--kernels", action="store_true", help="time the block kernels alone, per backend")
    ap.add_argument("--contenders", default=None,
                    help="comma-separated contenders to run beside 'cp -r' (default: all), e.g. "
                         "'ckptxform apply --no-fsync'")
    ap.add_argument("--settle", type=float, default=0.0,
                    help="seconds to wait before each run, after the last output is removed: on a vm with free "
                         "page reporting, 6 gives every contender pages handed back to the host (benchmarks/"
                         "README.md, seventh pass); default 0")
    args = ap.parse_args()
    if args.kernels:
        print("\n".join(kernel_figures()))
        return
    report = [f"# ckptxform dequant benchmark, {time.strftime('%Y-%m-%d')}, {platform.node()} "
              f"({os.cpu_count()} cores, Python {platform.python_version()}), {args.reps} repetitions"
              + (f", {args.settle:g} s settle before each run" if args.settle else ""), ""]
    figures: dict[str, object] = {}
    compile_ckptxform()
    if args.work is not None:
        os.makedirs(args.work, exist_ok=True)  # a scratch directory named that does not exist yet
    with tempfile.TemporaryDirectory(prefix="ckptxform-dequant-bench-", dir=args.work) as scratch:
        for fmt in args.formats.split(","):
            only = args.contenders.split(",") if args.contenders else None
            lines, figures[fmt] = run(fmt, parse_size(args.size), args.reps, Path(scratch), only, args.settle)
            report += lines
        if not args.skip_rss:
            if "mxfp4" != args.formats:
                report += rss_probe(Path(scratch))
            if "mxfp4" in args.formats.split(","):
                report += mxfp4_source.rss_lines(Path(scratch), RULES["mxfp4"], PY)
    print("\n".join(report))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
