"""The MXFP4 part of the dequant benchmark (dequant_bench.py ``--formats mxfp4``): a gpt-oss
source at the real widths, its naive script, and the peak-RSS probe on two tensor sizes.

The source is gpt-oss-20b's layer at its real widths (hidden 2880, intermediate 2880, 90
groups a row, 64 heads of 64, 8 kv heads), 2 layers, as many experts as make ``--size`` of
MXFP4 weights (blocks and scales), 3 shards named as the real ones. Codes are uniform random
bytes and scales random bytes of 115..125 (the exponents of weights around 0.02): the
kernel's cost does not depend on the values, and quantizing gigabytes of floats in the
stand-in's way would take longer than the runs. The tensors other than the experts are
small and zero: their copy is not what is measured.

The naive script: ``load_file`` each shard, dequantize each ``*_blocks``/``*_scales`` pair
whole with torch as transformers' ``convert_moe_packed_tensors`` does (lookup table, ldexp,
transpose), ``save_file``.
"""

from __future__ import annotations

from pathlib import Path

NAIVE_MXFP4 = r"""
lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                   dtype=torch.bfloat16)
def dequantize(key, value, loaded):
    if key.endswith("_scales"):
        return None
    if not key.endswith("_blocks"):
        return key, value
    scales = tensor(key.removesuffix("_blocks") + "_scales", loaded).to(torch.int32) - 127
    *lead, groups, width = value.shape
    out = torch.empty(*lead, groups, width * 2, dtype=torch.bfloat16)
    out[..., 0::2], out[..., 1::2] = lut[(value & 0x0F).int()], lut[(value >> 4).int()]
    torch.ldexp(out, scales[..., None], out=out)
    return key.removesuffix("_blocks"), out.reshape(*lead, groups * width * 2).transpose(1, 2).contiguous()
"""

HIDDEN = INTERMEDIATE = 2880


def expert_bytes() -> int:
    """MXFP4 bytes of one expert of one layer (gate_up and down: blocks + scales)."""
    values = 3 * HIDDEN * INTERMEDIATE
    return values // 2 + values // 32


def build_gpt_oss_source(root: Path, experts: int, layers: int = 2) -> Path:
    """The source described above, under ``root``."""
    import json

    import ml_dtypes
    import numpy as np

    from ckptxform.standins.gpt_oss import GptOssDims, gpt_oss_config
    from ckptxform.standins.tensors import save_safetensors

    dims = GptOssDims(hidden=HIDDEN, intermediate=INTERMEDIATE, layers=layers, experts=experts, heads=64,
                      kv_heads=8, head_dim=64, vocab=4096)
    rng = np.random.default_rng(0)
    root.mkdir(parents=True)
    bf16 = ml_dtypes.bfloat16
    names = [f"model-{i:05d}-of-00002.safetensors" for i in range(3)]
    weight_map: dict[str, str] = {}

    def save(index: int, tensors: dict[str, np.ndarray]) -> None:
        save_safetensors(tensors, root / names[index])
        weight_map.update({k: names[index] for k in tensors})

    ends = {"model.embed_tokens.weight": np.zeros((dims.vocab, HIDDEN), bf16), "model.norm.weight": np.ones(HIDDEN, bf16),
            "lm_head.weight": np.zeros((dims.vocab, HIDDEN), bf16)}
    save(0, ends)
    for layer in range(layers):
        p = f"model.layers.{layer}."
        tensors = {f"{p}input_layernorm.weight": np.ones(HIDDEN, bf16),
                   f"{p}post_attention_layernorm.weight": np.ones(HIDDEN, bf16),
                   f"{p}self_attn.sinks": np.zeros(64, bf16),
                   f"{p}mlp.router.weight": np.zeros((experts, HIDDEN), bf16),
                   f"{p}mlp.router.bias": np.zeros(experts, bf16),
                   f"{p}mlp.experts.gate_up_proj_bias": np.zeros((experts, 2 * INTERMEDIATE), bf16),
                   f"{p}mlp.experts.down_proj_bias": np.zeros((experts, HIDDEN), bf16)}
        for proj, rows, cols in (("q", 64 * 64, HIDDEN), ("k", 8 * 64, HIDDEN), ("v", 8 * 64, HIDDEN),
                                 ("o", HIDDEN, 64 * 64)):
            tensors[f"{p}self_attn.{proj}_proj.weight"] = np.zeros((rows, cols), bf16)
            tensors[f"{p}self_attn.{proj}_proj.bias"] = np.zeros(rows, bf16)
        for proj, rows, cols in (("gate_up_proj", 2 * INTERMEDIATE, HIDDEN), ("down_proj", HIDDEN, INTERMEDIATE)):
            tensors[f"{p}mlp.experts.{proj}_blocks"] = rng.integers(0, 256, (experts, rows, cols // 32, 16),
                                                                    dtype=np.uint8)
            tensors[f"{p}mlp.experts.{proj}_scales"] = rng.integers(115, 126, (experts, rows, cols // 32),
                                                                    dtype=np.uint8)
        save(1 + layer % 2, tensors)
    (root / "config.json").write_text(json.dumps(gpt_oss_config(dims), indent=2))
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def build_for_size(root: Path, quantized_bytes: int) -> Path:
    """A source with about ``quantized_bytes`` of MXFP4 weights over 2 layers."""
    return build_gpt_oss_source(root, experts=max(2, -(-quantized_bytes // (2 * expert_bytes()))))


def rss_lines(work: Path, rule: Path, python: str) -> list[str]:
    """Peak RSS of ``ckptxform apply`` on two sources whose largest tensor differs 4x (8
    and 32 experts of one layer: gate_up_proj [E, 2880, 5760] bf16)."""
    import shutil

    from harness import measure, warm

    lines = ["## peak RSS against tensor size (MXFP4, one layer, --no-fsync)", "",
             "| largest tensor (bf16 out) | wall (s) | GB/s of output | peak RSS (MB) |", "|---|---|---|---|"]
    for experts in (8, 32):
        src = build_gpt_oss_source(work / f"mxfp4-e{experts}", experts, layers=1)
        warm(src)
        out = work / "rss-out"
        wall, rss = measure([python, "-m", "ckptxform", "-q", "apply", str(rule), f"--source=model={src}",
                             "--out", str(out), "--no-fsync"])
        written = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        largest = experts * HIDDEN * 2 * INTERMEDIATE * 2
        lines.append(f"| [{experts}, {HIDDEN}, {2 * INTERMEDIATE}] = {largest / 1e6:,.0f} MB | {wall:.2f} | "
                     f"{written / wall / 1e9:.2f} | {rss / 1024:.0f} |")
        shutil.rmtree(out)
        shutil.rmtree(src)
    return [*lines, ""]


def kernel_lines(reps: int) -> list[str]:
    """GB/s of bf16 of the MXFP4 kernel on a [512, 7168] block (one thread, best of ``reps``):
    the table gather on numpy (what runs on every install) against the same gather in torch."""
    import time

    import numpy as np
    import torch

    from ckptxform.quant.mxfp4 import dequant_mxfp4_groups, pair_table

    groups = 512 * 7168 // 32
    rng = np.random.default_rng(0)
    blocks, scales = rng.integers(0, 256, groups * 16, dtype=np.uint8), rng.integers(115, 126, groups, dtype=np.uint8)
    table = torch.from_numpy(pair_table("BF16").view(np.int32))
    tb, ts = torch.from_numpy(blocks).view(groups, 16), torch.from_numpy(scales)

    def torch_gather() -> bytes:
        return table[(ts.to(torch.int64)[:, None] << 8) | tb].numpy().tobytes()

    cases = {"numpy": lambda: bytes(dequant_mxfp4_groups(blocks.tobytes(), scales.tobytes())), "torch": torch_gather}
    best = {name: 1e9 for name in cases}
    outs = {}
    for _ in range(reps):
        for name, case in cases.items():
            t0 = time.perf_counter()
            outs[name] = case()
            best[name] = min(best[name], time.perf_counter() - t0)
    assert outs["numpy"] == outs["torch"], "the two gathers' bytes differ"
    gbs = {name: groups * 64 / t / 1e9 for name, t in best.items()}
    row = (f"| MXFP4 (one table gather; numpy on every install) | {gbs['numpy']:.2f} | {gbs['numpy']:.2f} | "
           f"{gbs['torch']:.2f} (the same gather in torch) |")
    return [row]
