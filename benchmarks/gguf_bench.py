"""GGUF benchmark (issue 38): dequantization throughput, and HF -> GGUF Q8_0 against llama.cpp.

    python benchmarks/gguf_bench.py kernels                      # Q8_0/Q4_K decoders alone
    python benchmarks/gguf_bench.py dequant --size 1GB --reps 2  # gguf_to_hf on Q8_0 and Q4_K GGUFs
    python benchmarks/gguf_bench.py to-gguf --converter PATH/convert_hf_to_gguf.py --size 2GB --reps 1

``kernels``: one thread, 64 MiB of float32 output, best CPU time of ``--reps``, alternating: gguf-py's
``quants.dequantize`` against ckptxform's numpy kernels (quant/gguf_fast.py), bytes checked equal.
``dequant``: ``ckptxform apply rules/gguf_to_hf.yaml`` (float32 output) on a Llama GGUF of
``--size`` output bytes whose matrices are Q8_0 (gguf-py's quantizer) or Q4_K (valid random
blocks), each in its own process; GB/s of output per wall second, peak RSS (GNU time).
``to-gguf``: a TinyLlama-shaped bf16 checkpoint with a SentencePiece tokenizer
(standins/spm_llama.py; hidden 2048, 32 heads, 4 kv heads, intermediate 5632, vocab 32000,
as many layers as ``--size`` allows: 22 make TinyLlama's 2.2 GB) to one Q8_0 file, by
``ckptxform apply rules/hf_to_gguf_q8_0.yaml`` and by llama.cpp's ``convert_hf_to_gguf.py
--outtype q8_0`` (not in the gguf wheel: give its path; tests/llama_cpp_reference.py
extracts it from llama-cpp-python's sdist), alternating; wall and peak RSS; the two files'
tensors are checked equal.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import PY, compile_ckptxform, paired_ratio, parse_size, run_contenders, warm  # noqa: E402

REPO = HERE.parent


def kernels(reps: int) -> None:
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    from ckptxform.quant.gguf_fast import FAST
    from ckptxform.standins.gguf_models import random_blocks

    print("| format | gguf-py dequantize (GB of float32 per CPU s) | ckptxform kernel | ratio |")
    print("|---|---|---|---|")
    for kind in ("Q8_0", "Q4_K"):
        values, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
        rows, cols = 4096, 4096  # 64 MiB of float32
        blocks = random_blocks(kind, rows, cols, seed=1).reshape(-1, size)
        best = {"gguf-py": float("inf"), "ckptxform": float("inf")}
        for rep in range(reps):
            order = ["gguf-py", "ckptxform"] if rep % 2 == 0 else ["ckptxform", "gguf-py"]
            for name in order:
                start = time.process_time()  # CPU seconds: the machine may be shared
                out = (dequantize(blocks, GGMLQuantizationType[kind]) if name == "gguf-py"
                       else FAST[kind](blocks))
                best[name] = min(best[name], time.process_time() - start)
                if name == "gguf-py":
                    want = out
                else:
                    got = out
        assert np.array_equal(np.asarray(got).reshape(-1).view(np.uint32), np.asarray(want).reshape(-1).view(np.uint32))
        gb = rows * cols * 4 / 1e9
        print(f"| {kind} | {gb / best['gguf-py']:.2f} | {gb / best['ckptxform']:.2f} | "
              f"{best['gguf-py'] / best['ckptxform']:.1f}x |")


def dequant(size: int, reps: int, work: Path) -> None:
    from ckptxform.standins.gguf_models import GgufDims, build_llama_gguf

    per_layer = 4 * (2 * 2048 * 2048 + 2 * 256 * 2048 + 3 * 2048 * 5632)  # float32 bytes
    layers = max(1, (size - 4 * 2 * 32000 * 2048) // per_layer)
    dims = GgufDims(hidden=2048, heads=32, kv_heads=4, head_dim=64, intermediate=5632, layers=layers, vocab=32000)
    rule = REPO / "rules" / "gguf_to_hf.yaml"
    print(f"gguf_to_hf on a Llama GGUF of {layers} layers (hidden 2048, intermediate 5632, vocab 32000)")
    print("| format | GGUF size (GB) | float32 output (GB) | wall (s) | CPU (s) | GB/s of output per wall s "
          "| per CPU s | peak RSS (MB) |")
    print("|---|---|---|---|---|---|---|---|")
    for kind in ("Q8_0", "Q4_K"):
        src = build_llama_gguf(work / kind / "model.gguf", dims=dims, qtype=kind, seed=3)
        warm(src.parent)
        walls, cpus, rss = [], [], []
        for _ in range(reps):
            wall, cpu, peak = measure_cpu([PY, "-m", "ckptxform", "apply", str(rule), "--source", f"model={src}",
                                           "--out", str(work / "out"), "-q", "--no-fsync", "--force"])
            walls.append(wall), cpus.append(cpu), rss.append(peak)
        out_bytes = 4 * (2 * 32000 * 2048 + layers * (per_layer // 4))
        wall, cpu = min(walls), min(cpus)
        print(f"| {kind} | {src.stat().st_size / 1e9:.2f} | {out_bytes / 1e9:.2f} | {wall:.1f} | {cpu:.1f} | "
              f"{out_bytes / 1e9 / wall:.2f} | {out_bytes / 1e9 / cpu:.2f} | {max(rss) / 1024:.0f} |")
        for f in src.parent.iterdir():
            f.unlink()


def measure_cpu(argv: list[str]) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds (user + system) and peak RSS (KiB) of one command: on a
    shared machine the CPU time is the steadier figure."""
    import subprocess

    with tempfile.NamedTemporaryFile("r") as report:
        start = time.perf_counter()
        subprocess.run(["/usr/bin/time", "-f", "%U %S %M", "-o", report.name, *argv], check=True,
                       stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - start
        user, system, peak = report.read().split()[-3:]
    return wall, float(user) + float(system), int(peak)


def to_gguf(converter: Path, size: int, reps: int, work: Path) -> None:
    from ckptxform.standins.spm_llama import SpmLlamaDims, build_spm_llama

    per_layer = 2 * (2 * 2048 * 2048 + 2 * 256 * 2048 + 3 * 2048 * 5632)  # bf16 bytes
    layers = max(1, (size - 2 * 2 * 32000 * 2048) // per_layer)
    dims = SpmLlamaDims(hidden=2048, heads=32, kv_heads=4, head_dim=64, intermediate=5632, layers=layers,
                        vocab=32000, dtype="bfloat16")
    src = build_spm_llama(work / "TinyLlama-1.1B-Chat-v1.0", dims, seed=7)
    weights = (src / "model.safetensors").stat().st_size
    print(f"HF -> GGUF Q8_0: a TinyLlama-shaped bf16 model of {layers} layers, {weights / 1e9:.2f} GB")
    warm(src)
    rule = REPO / "rules" / "hf_to_gguf_q8_0.yaml"
    contenders = {
        "ckptxform apply hf_to_gguf_q8_0": lambda out: [PY, "-m", "ckptxform", "apply", str(rule), "--source",
                                                        f"model={src}", "--out", str(out), "-q"],
        "convert_hf_to_gguf.py --outtype q8_0": lambda out: [
            "sh", "-c", f'mkdir -p "{out}" && exec "{PY}" "{converter}" "{src}" --outtype q8_0 '
                        f'--outfile "{out}/model-Q8_0.gguf"'],
    }
    results = run_contenders(contenders, work, reps)
    print("| contender | wall (s) | peak RSS (MB) |")
    print("|---|---|---|")
    for result in results.values():
        print(f"| {result.name} | {result.wall:.1f} | {result.peak_mb:.0f} |")
    ours, theirs = results.values()
    print(f"ckptxform / convert_hf_to_gguf.py wall ratio (paired median): {paired_ratio(ours, theirs):.2f}")
    check_same(rule, converter, src, work)


def check_same(rule: Path, converter: Path, src: Path, work: Path) -> None:
    """Both files once more, their tensors compared (the timed runs' outputs are removed)."""
    import subprocess

    import gguf

    subprocess.run([PY, "-m", "ckptxform", "apply", str(rule), "--source", f"model={src}", "--out",
                    str(work / "check-ours"), "-q", "--no-fsync"], check=True)
    subprocess.run([PY, str(converter), str(src), "--outtype", "q8_0", "--outfile", str(work / "check.gguf")],
                   check=True, capture_output=True)
    ours = {t.name: t.data.tobytes() for t in gguf.GGUFReader(next((work / "check-ours").glob("*.gguf"))).tensors}
    theirs = {t.name: t.data.tobytes() for t in gguf.GGUFReader(work / "check.gguf").tensors}
    assert ours == theirs, "the two files' tensors differ"
    print("the two files' tensors are equal")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["kernels", "dequant", "to-gguf"])
    parser.add_argument("--size", default="2GB", help="model size (dequant: float32 output; to-gguf: bf16 weights)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--converter", type=Path, help="llama.cpp's convert_hf_to_gguf.py (to-gguf)")
    parser.add_argument("--work", type=Path, help="where to build the models (default: a temporary directory)")
    args = parser.parse_args()
    if args.what == "kernels":
        kernels(max(args.reps, 1))
        return
    if args.what == "to-gguf" and (args.converter is None or not args.converter.is_file()):
        parser.error("to-gguf needs --converter PATH/convert_hf_to_gguf.py")
    compile_ckptxform()
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        work = Path(tmp)
        if args.what == "dequant":
            dequant(parse_size(args.size), args.reps, work)
        else:
            to_gguf(args.converter, parse_size(args.size), args.reps, work)


if __name__ == "__main__":
    main()
