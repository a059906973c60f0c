"""A PEFT LoRA adapter for a stand-in Llama (``hf_models.build_llama``), as peft 0.18's
``save_pretrained`` writes one: ``adapter_config.json`` and ``adapter_model.safetensors``
with ``base_model.model.``-prefixed float32 ``lora_A``/``lora_B`` and the
``modules_to_save`` modules under their own keys. Numpy only, like the other builders.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ckptxform.standins.hf_models import LmDims
from ckptxform.standins.tensors import TensorSpec, save_safetensors, seeded_values, write_json

_SHAPES = {"q_proj": ("hidden", "q"), "k_proj": ("hidden", "kv"), "v_proj": ("hidden", "kv"),
           "o_proj": ("q", "hidden"), "gate_proj": ("hidden", "inter"), "up_proj": ("hidden", "inter"),
           "down_proj": ("inter", "hidden")}


def build_lora_adapter(out_dir: str | Path, dims: LmDims, *, r: int = 4, alpha: float = 8, seed: int = 1,
                       targets: tuple[str, ...] = ("q_proj", "v_proj", "o_proj", "down_proj"),
                       rank_pattern: dict[str, int] | None = None, alpha_pattern: dict[str, float] | None = None,
                       use_rslora: bool = False, modules_to_save: tuple[str, ...] = ()) -> Path:
    """The adapter folder; ``lora_B`` is drawn nonzero (a trained adapter's, not peft's zero init)."""
    d = dims
    widths = {"hidden": d.hidden, "q": d.heads * d.head_dim, "kv": d.kv_heads * d.head_dim, "inter": d.intermediate}
    tensors: dict[str, Any] = {}
    for n in range(d.layers):
        for target in targets:
            part = "mlp" if target.endswith(("gate_proj", "up_proj", "down_proj")) else "self_attn"
            module = f"model.layers.{n}.{part}.{target}"
            rank = next((v for k, v in (rank_pattern or {}).items() if re.match(rf"(.*\.)?({k})$", module)), r)
            cols, rows = (widths[w] for w in _SHAPES[target])
            for name, shape in (("lora_A", (rank, cols)), ("lora_B", (rows, rank))):
                spec = TensorSpec(f"base_model.model.{module}.{name}.weight", shape, "float32", "linear")
                tensors[spec.key] = seeded_values(spec, seed) * 10
    for module in modules_to_save:
        rows = d.vocab if module in ("lm_head", "embed_tokens") else d.hidden
        key = "model.embed_tokens" if module == "embed_tokens" else module
        spec = TensorSpec(f"base_model.model.{key}.weight", (rows, d.hidden), d.dtype, "linear")
        tensors[spec.key] = seeded_values(spec, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, out / "adapter_model.safetensors")
    write_json(out / "adapter_config.json", {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "meta-llama/Llama-3.1-8B-Instruct",
        "r": r, "lora_alpha": alpha, "use_rslora": use_rslora, "target_modules": list(targets),
        "rank_pattern": rank_pattern or {}, "alpha_pattern": alpha_pattern or {},
        "modules_to_save": list(modules_to_save) or None, "fan_in_fan_out": False, "bias": "none",
        "use_dora": False, "lora_dropout": 0.0, "inference_mode": True, "peft_version": "0.18.0"})
    return out
