"""Stand-ins of AutoAWQ (GEMM) and GPTQ int4 checkpoints: a small Llama whose linear layers
are stored as those tools store them, with seeded codes, zero points and float16 scales.

The widths are multiples of the group (32) but of nothing larger, 3 heads over 1 KV head
(GQA), so nothing here is tuned to 128-wide groups or square layers. ``lm_head`` and the
embeddings stay bfloat16, as both tools leave them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ckptxform.standins.hf_models import LmDims, build_llama
from ckptxform.standins.tensors import derive_seed, save_safetensors

__all__ = ["AWQ_GPTQ_TINY", "build_awq_llama", "build_gptq_llama", "awq_config", "gptq_config"]

AWQ_GPTQ_TINY = LmDims(hidden=96, heads=3, kv_heads=1, intermediate=160)
_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def awq_config(group: int) -> dict[str, Any]:
    """The quantization_config AutoAWQ 0.2 writes for a GEMM checkpoint."""
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": None}


def gptq_config(group: int, *, desc_act: bool, sym: bool) -> dict[str, Any]:
    """The quantization_config auto-gptq 0.7 / optimum write (v1 checkpoint format)."""
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act, "sym": sym,
            "checkpoint_format": "gptq", "damp_percent": 0.01, "static_groups": False, "true_sequential": True,
            "model_name_or_path": None, "model_file_base_name": "model"}


def _linear_modules(tensors: dict[str, Any]) -> list[str]:
    return sorted(k.removesuffix(".weight") for k in tensors
                  if k.endswith(".weight") and k.split(".")[-2] in _LINEAR)


def _words(gen: Any, shape: tuple[int, ...], top: int = 16) -> Any:
    """uint32 words of 8 random nibbles, each below ``top``."""
    import numpy as np

    from ckptxform.quant.awq_gptq import pack_nibbles

    codes = gen.integers(0, top, (*shape[:-1], shape[-1] * 8), dtype=np.uint8)
    return pack_nibbles(codes).view(np.int32)


def _scales(gen: Any, shape: tuple[int, int]) -> Any:
    import numpy as np

    return gen.uniform(0.001, 0.02, shape).astype(np.float16)


def _rewrite(out: Path, config_field: dict[str, Any], quantized: Any) -> Path:
    from safetensors.numpy import load_file

    tensors: dict[str, Any] = load_file(out / "model.safetensors")
    for module in _linear_modules(tensors):
        rows_out, rows_in = tensors.pop(f"{module}.weight").shape
        tensors.update({f"{module}.{part}": value for part, value in quantized(module, rows_in, rows_out).items()})
    save_safetensors(tensors, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = config_field
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def build_awq_llama(out_dir: str | Path, dims: LmDims = AWQ_GPTQ_TINY, *, group: int = 32, seed: int = 0) -> Path:
    """A LlamaForCausalLM as AutoAWQ GEMM saves it (TheBloke/*-AWQ, Qwen/Qwen2.5-7B-Instruct-AWQ):
    each linear ``X.qweight`` int32 ``[in, out/8]``, ``X.qzeros`` ``[in/group, out/8]`` (AWQ's
    nibble order) and ``X.scales`` float16 ``[in/group, out]``."""
    import numpy as np

    def module(name: str, rows_in: int, rows_out: int) -> dict[str, Any]:
        gen = np.random.default_rng(derive_seed(seed, name))
        return {"qweight": _words(gen, (rows_in, rows_out // 8)),
                "qzeros": _words(gen, (rows_in // group, rows_out // 8)),
                "scales": _scales(gen, (rows_in // group, rows_out))}

    return _rewrite(build_llama(out_dir, dims, seed=seed), awq_config(group), module)


def build_gptq_llama(out_dir: str | Path, dims: LmDims = AWQ_GPTQ_TINY, *, group: int = 32, desc_act: bool = False,
                     sym: bool = True, zero_max: int = 14, seed: int = 0) -> Path:
    """A LlamaForCausalLM as auto-gptq / optimum save it (TheBloke/*-GPTQ,
    Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4): each linear ``X.qweight`` int32 ``[in/8, out]``,
    ``X.qzeros`` ``[groups, out/8]`` (v1: stored less one; symmetric: every nibble 7),
    ``X.scales`` float16 ``[groups, out]`` and ``X.g_idx`` int32 ``[in]`` (with ``desc_act``, the
    groups of rows in activation order: not monotone). Asymmetric stored zero points are at most ``zero_max``: 14
    (the default) keeps every one within compressed-tensors' int4; a stored 15 is the zero point
    16, which auto-gptq's v1 packing writes for a zero point of 0."""
    import numpy as np

    def module(name: str, rows_in: int, rows_out: int) -> dict[str, Any]:
        gen = np.random.default_rng(derive_seed(seed, name))
        size = group if group > 0 else rows_in
        groups = -(-rows_in // size)
        g_idx = np.arange(rows_in, dtype=np.int32) // size
        if desc_act:
            g_idx = gen.permutation(g_idx).astype(np.int32)
        zeros = (np.full((groups, rows_out // 8), 0x77777777, dtype=np.uint32).view(np.int32) if sym
                 else _words(gen, (groups, rows_out // 8), top=zero_max + 1))
        return {"qweight": _words(gen, (rows_in // 8, rows_out)), "qzeros": zeros,
                "scales": _scales(gen, (groups, rows_out)), "g_idx": g_idx}

    return _rewrite(build_llama(out_dir, dims, seed=seed), gptq_config(group, desc_act=desc_act, sym=sym), module)
