"""A Llava-layout vision-language checkpoint as transformers 5.x saves
``LlavaForConditionalGeneration`` (llava-hf/llava-1.5-7b-hf): the language model under
``language_model.model.*`` and ``language_model.lm_head.weight``, a CLIP vision tower under
``vision_tower.*``, the projector under ``multi_modal_projector.*``, and a config whose
``text_config`` is the language model's own. Built without transformers; values seeded by
(seed, key name) as every stand-in's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckptxform.standins.hf_models import LM_TINY, LmDims
from ckptxform.standins.tensors import TensorSpec, save_safetensors, seeded_values, write_json

__all__ = ["build_llava"]

_VISION_HIDDEN = 32


def _vision_specs(d: LmDims) -> list[TensorSpec]:
    v, dtype = _VISION_HIDDEN, d.dtype
    specs = [TensorSpec("vision_tower.vision_model.embeddings.class_embedding", (v,), dtype, "norm"),
             TensorSpec("vision_tower.vision_model.embeddings.patch_embedding.weight", (v, 3, 14, 14), dtype, "linear"),
             TensorSpec("vision_tower.vision_model.embeddings.position_embedding.weight", (5, v), dtype, "linear"),
             TensorSpec("vision_tower.vision_model.pre_layrnorm.weight", (v,), dtype, "norm"),
             TensorSpec("vision_tower.vision_model.pre_layrnorm.bias", (v,), dtype, "norm")]
    specs += [TensorSpec("multi_modal_projector.linear_1.weight", (d.hidden, v), dtype, "linear"),
              TensorSpec("multi_modal_projector.linear_1.bias", (d.hidden,), dtype, "norm"),
              TensorSpec("multi_modal_projector.linear_2.weight", (d.hidden, d.hidden), dtype, "linear"),
              TensorSpec("multi_modal_projector.linear_2.bias", (d.hidden,), dtype, "norm")]
    return specs


def _text_specs(d: LmDims, head_dim: int) -> list[TensorSpec]:
    p, dt = "language_model.model.", d.dtype
    specs = [TensorSpec(f"{p}embed_tokens.weight", (d.vocab, d.hidden), dt, "linear"),
             TensorSpec(f"{p}norm.weight", (d.hidden,), dt, "norm"),
             TensorSpec("language_model.lm_head.weight", (d.vocab, d.hidden), dt, "linear")]
    for n in range(d.layers):
        q = f"{p}layers.{n}."
        specs += [TensorSpec(f"{q}self_attn.q_proj.weight", (d.heads * head_dim, d.hidden), dt, "linear"),
                  TensorSpec(f"{q}self_attn.k_proj.weight", (d.kv_heads * head_dim, d.hidden), dt, "linear"),
                  TensorSpec(f"{q}self_attn.v_proj.weight", (d.kv_heads * head_dim, d.hidden), dt, "linear"),
                  TensorSpec(f"{q}self_attn.o_proj.weight", (d.hidden, d.heads * head_dim), dt, "linear"),
                  TensorSpec(f"{q}mlp.gate_proj.weight", (d.intermediate, d.hidden), dt, "linear"),
                  TensorSpec(f"{q}mlp.up_proj.weight", (d.intermediate, d.hidden), dt, "linear"),
                  TensorSpec(f"{q}mlp.down_proj.weight", (d.hidden, d.intermediate), dt, "linear"),
                  TensorSpec(f"{q}input_layernorm.weight", (d.hidden,), dt, "norm"),
                  TensorSpec(f"{q}post_attention_layernorm.weight", (d.hidden,), dt, "norm")]
    return specs


def llava_config(d: LmDims, head_dim: int) -> dict[str, Any]:
    """The config.json transformers 5.x writes for LlavaForConditionalGeneration (no
    ``architectures`` in ``text_config``, as there)."""
    text = {"model_type": "llama", "hidden_size": d.hidden, "intermediate_size": d.intermediate,
            "num_attention_heads": d.heads, "num_key_value_heads": d.kv_heads, "head_dim": head_dim,
            "num_hidden_layers": d.layers, "vocab_size": d.vocab, "hidden_act": "silu", "rms_norm_eps": 1e-5,
            "max_position_embeddings": 4096, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
            "eos_token_id": 2, "pad_token_id": None, "tie_word_embeddings": False, "dtype": d.dtype}
    vision = {"model_type": "clip_vision_model", "hidden_size": _VISION_HIDDEN, "intermediate_size": 40,
              "num_attention_heads": 2, "num_hidden_layers": 0, "image_size": 28, "patch_size": 14,
              "projection_dim": 16, "hidden_act": "quick_gelu"}
    return {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "dtype": d.dtype,
            "image_token_index": d.vocab - 1, "image_seq_length": 4, "projector_hidden_act": "gelu",
            "multimodal_projector_bias": True, "vision_feature_layer": -2,
            "vision_feature_select_strategy": "default", "tie_word_embeddings": False,
            "text_config": text, "vision_config": vision, "transformers_version": "5.23.0"}


def build_llava(out_dir: str | Path, dims: LmDims = LM_TINY, *, seed: int = 0, head_dim: int | None = None) -> Path:
    """A LlavaForConditionalGeneration checkpoint (llava-hf/llava-1.5-7b-hf's keys and config)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hd = head_dim or dims.head_dim
    specs = _text_specs(dims, hd) + _vision_specs(dims)
    save_safetensors({s.key: seeded_values(s, seed) for s in specs}, out / "model.safetensors")
    write_json(out / "config.json", llava_config(dims, hd))
    write_json(out / "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 32001,
                                                "transformers_version": "5.23.0"})
    return out
