"""The ``config.json`` contents of each stand-in: EAGLE-3 native and speculators
drafters, and the Kimi-K2.5 multimodal verifier (and its quantization_config), with the
real field names."""

from __future__ import annotations

from typing import Any

from ckptxform.standins.deepseek import DeepseekV3Dims, deepseek_v3_fields
from ckptxform.standins.dims import DrafterDims

__all__ = ["int4_quantization_config", "kimi_k25_config", "llama_fields", "native_config", "speculators_config"]


def native_config(dims: DrafterDims, *, draft_vocab: bool) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": dims.model_type,
        **llama_fields(dims),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(dims.aux_layers),
                         "use_aux_hidden_state": True},
        "initializer_range": 0.02,
        "torch_dtype": dims.dtype,
        "transformers_version": "4.53.2",
        "use_cache": True,
    }
    if draft_vocab:
        config["draft_vocab_size"] = dims.draft_vocab
    if dims.verifier_hidden != dims.hidden:
        config["target_hidden_size"] = dims.verifier_hidden
    return config


def speculators_config(dims: DrafterDims, verifier_name: str,
                       verifier_architectures: tuple[str, ...]) -> dict[str, Any]:
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "draft_vocab_size": dims.draft_vocab,
        "norm_before_residual": False,
        "target_hidden_size": dims.verifier_hidden,
        "eagle_aux_hidden_state_layer_ids": list(dims.aux_layers),
        "dtype": dims.dtype,
        "transformer_layer_config": {"model_type": "llama", **llama_fields(dims),
                                     "torch_dtype": dims.dtype},
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name,
                         "architectures": list(verifier_architectures)},
        },
    }


def llama_fields(dims: DrafterDims) -> dict[str, Any]:
    return {
        "hidden_size": dims.hidden,
        "intermediate_size": dims.intermediate,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads,
        "head_dim": dims.head_dim,
        "num_hidden_layers": 1,
        "vocab_size": dims.vocab,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": dims.rms_norm_eps,
        "rope_theta": dims.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": dims.max_position_embeddings,
        "bos_token_id": dims.bos_token_id,
        "eos_token_id": dims.eos_token_id,
        "tie_word_embeddings": False,
    }


def kimi_k25_config(dims: DrafterDims, text: DeepseekV3Dims, quantization: dict[str, Any]) -> dict[str, Any]:
    """Kimi-K2.5's wrapper config: the DeepSeek-V3 text model in ``text_config`` (with its
    ``quantization_config``, where compressed-tensors and vLLM look second), vision beside."""
    text_config = {**deepseek_v3_fields(text), "bos_token_id": dims.bos_token_id,
                   "eos_token_id": dims.eos_token_id, "rms_norm_eps": dims.rms_norm_eps,
                   "rope_theta": dims.rope_theta, "max_position_embeddings": dims.max_position_embeddings,
                   "quantization_config": quantization}
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text_config,
        "vision_config": {"model_type": "kimi_k25_vision", "patch_size": 14,
                          "hidden_size": max(16, dims.verifier_hidden // 4),
                          "num_hidden_layers": 1, "mm_projector_type": "patchmerger"},
        "media_placeholder_token_id": dims.vocab - 235,
        "tie_word_embeddings": False,
        "torch_dtype": dims.dtype,
    }


def int4_quantization_config(group_size: int) -> dict[str, Any]:
    """compressed-tensors ``pack-quantized`` int4, symmetric, per group of ``group_size``
    columns, for ``Linear`` modules outside ``ignore``: Kimi-K2-Thinking's list (attention,
    shared experts, dense MLPs, lm_head: only routed experts are quantized) plus the
    vision modules of the multimodal wrapper."""
    return {
        "config_groups": {"group_0": {
            "input_activations": None, "output_activations": None, "targets": ["Linear"],
            "weights": {"actorder": None, "block_structure": None, "dynamic": False,
                        "group_size": group_size, "num_bits": 4, "observer": "minmax",
                        "observer_kwargs": {}, "strategy": "group", "symmetric": True, "type": "int"},
        }},
        "format": "pack-quantized",
        "ignore": ["lm_head", "re:.*lm_head.*", "re:.*self_attn.*", "re:.*shared_experts.*",
                   "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }
