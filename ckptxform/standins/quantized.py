"""Quantized stand-ins: weights quantized the way the real checkpoints were, and the
Kimi-K2 builder (FP8 Kimi-K2-Instruct, int4 Kimi-K2-Thinking).

- FP8 block-scaled (DeepSeek-V3, Kimi-K2): per ``bh x bw`` block, ``scale_inv = amax /
  448`` (float32) and ``weight = e4m3(w / scale_inv)``; edge blocks are partial.
- int4 pack-quantized (compressed-tensors, Kimi-K2-Thinking/K2.5 routed experts): per
  group of ``g`` columns, ``scale = amax / 7`` in the model dtype and ``q = clamp(round(w
  / scale), -8, 7)``, stored as ``q + 8`` nibbles, 8 per int32 word (element ``8w + k`` in
  bits ``4k..4k+3``), with ``weight_shape`` the logical shape.

Values are seeded by (seed, the weight's key), like every stand-in's.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ckptxform.errors import UsageError
from ckptxform.standins.configs import int4_quantization_config
from ckptxform.standins.deepseek import (
    KIMI_K2_TEXT,
    DeepseekV3Dims,
    Module,
    deepseek_v3_fields,
    nextn_modules,
    text_modules,
)
from ckptxform.standins.shards import balanced_runs, write_sharded
from ckptxform.standins.tensors import BuiltCheckpoint, derive_seed, numpy_dtype_named, write_json

if TYPE_CHECKING:
    import numpy as np

__all__ = ["DEEPSEEK_V3_61_TINY", "KIMI_K2_FP8_TINY", "build_kimi_k2", "fp8_block_quantized", "int4_group_quantized",
           "module_sizes", "module_tensors", "routed_expert"]

#: Kimi-K2-Instruct at 1/16 of its widths (FP8 block 8 keeps the real block grid)
KIMI_K2_FP8_TINY = KIMI_K2_TEXT.scaled(16, layers=3, routed_experts=4, experts_per_token=2, vocab=2048)
#: DeepSeek-V3 / Kimi-K2 with all 61 layers (the MTP block is layer 61), at 1/32 of the widths
DEEPSEEK_V3_61_TINY = KIMI_K2_TEXT.scaled(32, layers=61, routed_experts=2, experts_per_token=1, vocab=512)

_E4M3_MAX = 448.0


def fp8_block_quantized(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(float8_e4m3fn weight, float32 scale_inv [ceil(M/bh), ceil(N/bw)]) of float32 ``w``."""
    import numpy as np

    from ckptxform.dtypes import numpy_dtype

    bh, bw = block
    rows, cols = w.shape
    sr, sc = -(-rows // bh), -(-cols // bw)
    padded = np.zeros((sr * bh, sc * bw), dtype=np.float32)
    padded[:rows, :cols] = w
    amax = np.abs(padded.reshape(sr, bh, sc, bw)).max(axis=(1, 3))
    scale_inv = np.where(amax > 0, amax / np.float32(_E4M3_MAX), np.float32(1.0)).astype(np.float32)
    expanded = np.repeat(np.repeat(scale_inv, bh, 0), bw, 1)[:rows, :cols]
    q = np.clip(w / expanded, -_E4M3_MAX, _E4M3_MAX).astype(np.float32)
    return q.astype(numpy_dtype("F8_E4M3")), scale_inv


def int4_group_quantized(w: np.ndarray, group: int, scale_dtype: np.dtype
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(int32 weight_packed [M, ceil(N/8)], weight_scale [M, N/g], int32 weight_shape [2])."""
    import numpy as np

    rows, cols = w.shape
    if cols % group:
        raise UsageError(f"int4 group size {group} does not divide {cols} columns")
    groups = w.reshape(rows, cols // group, group)
    scale = np.maximum(np.abs(groups).max(axis=2) / np.float32(7), np.float32(1e-8)).astype(scale_dtype)
    q = np.clip(np.round(groups / scale.astype(np.float32)[..., None]), -8, 7).reshape(rows, cols)
    words = -(-cols // 8)
    nibbles = np.zeros((rows, words * 8), dtype=np.uint32)  # compressed-tensors pads with zero bits
    nibbles[:, :cols] = (q + 8).astype(np.uint32)
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    packed = (nibbles.reshape(rows, words, 8) << shifts).sum(axis=2, dtype=np.uint32)
    return packed.view(np.int32), scale, np.array([rows, cols], dtype=np.int32)


def module_sizes(module: Module, fmt: str, dtype: str, *, block: tuple[int, int] = (128, 128),
                 group: int = 32) -> list[tuple[str, int]]:
    """``(key, nbytes)`` of the tensors ``module_tensors`` makes, without making them."""
    from ckptxform.dtypes import DTYPE_SIZES, USER_DTYPES

    size = DTYPE_SIZES[USER_DTYPES[dtype]]
    n = module.name
    numel = 1
    for d in module.shape:
        numel *= d
    if module.kind == "router":
        return [(f"{n}.weight", numel * size), (f"{n}.e_score_correction_bias", module.shape[0] * 4)]
    if fmt == "fp8" and module.kind == "linear":
        rows, cols = module.shape
        return [(f"{n}.weight", numel), (f"{n}.weight_scale_inv", -(-rows // block[0]) * -(-cols // block[1]) * 4)]
    if fmt == "int4" and module.kind == "linear":
        rows, cols = module.shape
        return [(f"{n}.weight_packed", rows * -(-cols // 8) * 4), (f"{n}.weight_scale", rows * (cols // group) * size),
                (f"{n}.weight_shape", 8)]
    return [(f"{n}.weight", numel * size)]


def module_tensors(module: Module, fmt: str, dtype: str, seed: int, *, block: tuple[int, int] = (128, 128),
                   group: int = 32) -> dict[str, np.ndarray]:
    """The tensors of ``module``: ``fmt`` ``"fp8"``/``"int4"`` quantizes it when it is a
    linear layer, ``"plain"`` (or any other kind of module) stores it in ``dtype``."""
    import numpy as np

    # seeded by the weight's key, as ``seeded_values`` seeds a plain tensor: the same module
    # has the same values whether it is stored quantized or not
    gen = np.random.default_rng(derive_seed(seed, f"{module.name}.weight"))
    values = gen.standard_normal(module.shape, dtype=np.float32)
    n, dt = module.name, numpy_dtype_named(dtype)
    if module.kind == "norm":
        return {f"{n}.weight": (1.0 + 0.05 * values).astype(dt)}
    w = np.float32(0.02) * values
    if module.kind == "router":
        bias = np.float32(0.1) * gen.standard_normal(module.shape[0], dtype=np.float32)
        return {f"{n}.weight": w.astype(dt), f"{n}.e_score_correction_bias": bias}
    if fmt == "fp8" and module.kind == "linear":
        weight, scale_inv = fp8_block_quantized(w, block)
        return {f"{n}.weight": weight, f"{n}.weight_scale_inv": scale_inv}
    if fmt == "int4" and module.kind == "linear":
        packed, scale, shape = int4_group_quantized(w, group, dt)
        return {f"{n}.weight_packed": packed, f"{n}.weight_scale": scale, f"{n}.weight_shape": shape}
    return {f"{n}.weight": w.astype(dt)}


def fp8_quantization_config(block: tuple[int, int]) -> dict[str, Any]:
    """Kimi-K2-Instruct's ``quantization_config`` (DeepSeek-V3's), at block ``block``."""
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": list(block)}


def routed_expert(module: Module) -> bool:
    """What Kimi-K2-Thinking and Kimi-K2.5 store as int4: the routed experts only."""
    return ".mlp.experts." in module.name


def build_kimi_k2(out_dir: str | Path, dims: DeepseekV3Dims = KIMI_K2_FP8_TINY, *,
                  quantization: Literal["fp8", "int4"] = "fp8", block: tuple[int, int] | None = None,
                  group: int = 32, num_shards: int = 61, seed: int = 0, nextn: bool = False) -> BuiltCheckpoint:
    """A Kimi-K2 text checkpoint, quantized as one of the real repos:

    - ``"fp8"``: moonshotai/Kimi-K2-Instruct. Every linear weight FP8 e4m3 with a float32
      ``weight_scale_inv`` per ``block`` (default: the real 128 scaled like the widths,
      ``128 * dims.hidden // 7168``); ``quantization_config`` ``fp8`` with
      ``weight_block_size``.
    - ``"int4"``: moonshotai/Kimi-K2-Thinking. Routed experts compressed-tensors int4
      (group ``group``), everything else BF16; ``quantization_config``
      ``compressed-tensors``.

    Embeddings, norms, routers and lm_head are BF16, ``e_score_correction_bias`` float32.
    ``nextn`` adds DeepSeek-V3's MTP block as layer ``num_hidden_layers`` (``nextn_modules``)
    and ``num_nextn_predict_layers: 1``.
    Shards are ``model-1-of-61.safetensors`` ... (unpadded numbers, as Kimi-K2-Instruct
    names them) with an index.

    Example::

        built = build_kimi_k2(tmp_path / "Kimi-K2-Instruct")
        built.shapes["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"]  # (5, 56)
    """
    if block is None:
        side = max(1, 128 * dims.hidden // KIMI_K2_TEXT.hidden)
        block = (side, side)
    out = Path(out_dir)
    first, layers, last = text_modules(dims)
    ordered = [*first, *(m for layer in layers for m in layer), *last, *(nextn_modules(dims) if nextn else [])]

    def fmt(m: Module) -> str:
        return quantization if quantization == "fp8" or routed_expert(m) else "plain"

    modules = [(module_sizes(m, fmt(m), dims.dtype, block=block, group=group),
                (lambda m=m: module_tensors(m, fmt(m), dims.dtype, seed, block=block, group=group)))
               for m in ordered]
    names = [f"model-{i + 1}-of-{num_shards}.safetensors" for i in range(num_shards)]
    written = write_sharded(out, names, modules, lambda sizes: balanced_runs(sizes, num_shards))
    quant = fp8_quantization_config(block) if quantization == "fp8" else int4_quantization_config(group)
    write_json(out / "config.json", {**deepseek_v3_fields(dims), "quantization_config": quant,
                                     **({"num_nextn_predict_layers": 1} if nextn else {})})
    return BuiltCheckpoint(path=out, dims=dims, target_ids=None, keys=tuple(sorted(written.weight_map)),
                           shapes=written.shapes, dtypes=written.dtypes,
                           files=tuple(sorted(["config.json", "model.safetensors.index.json", *names])))
