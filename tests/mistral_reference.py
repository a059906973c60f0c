"""transformers' Mistral converter, ``convert_mistral_weights_to_hf.py``
(huggingface/transformers at 15ea02a2add1672acbeee158a9448720d6093de1,
src/transformers/models/mistral/), the reference of rules/mistral_to_hf.yaml.

Restated, not imported, as tests/reference_models.py restates the Meta converter: the script
is in no transformers wheel or sdist since 4.48 (4.47.1's wheel has an older one that
takes head_dim as dim / n_heads, so it cannot convert a head_dim-explicit checkpoint such as
Mistral-Nemo), and GitHub is not reachable from every test machine. Only its model path is
restated, line for line: ``convert_config`` (params.json -> MistralConfig), the one-file
``convert_state_dict`` (its key mapping and ``permute_for_rope``), then what
``convert_and_write_model`` does with them: a MistralForCausalLM built on the meta device,
``load_state_dict(strict=True, assign=True)`` and its state dict as ``save_pretrained``
writes it. The tokenizer half (convert_and_write_tokenizer) is left out.
"""

from __future__ import annotations

import re
from typing import Any

import torch

# fmt: off
STATE_DICT_MAPPING = {
    # CausalLM keys
    r"^output.weight":                            r"lm_head.weight",

    # Model keys
    r"^norm.weight":                              r"model.norm.weight",
    r"^tok_embeddings.weight":                    r"model.embed_tokens.weight",

    # Layers keys
    r"^layers.(\d+).attention_norm.weight":       r"model.layers.\1.input_layernorm.weight",
    r"^layers.(\d+).ffn_norm.weight":             r"model.layers.\1.post_attention_layernorm.weight",

    # Attention keys
    r"^layers.(\d+).attention.w(q|k|v|o).weight": r"model.layers.\1.self_attn.\2_proj.weight",


    # MLP keys
    r"^layers.(\d+).feed_forward.w1.weight":      r"model.layers.\1.mlp.gate_proj.weight",
    r"^layers.(\d+).feed_forward.w2.weight":      r"model.layers.\1.mlp.down_proj.weight",
    r"^layers.(\d+).feed_forward.w3.weight":      r"model.layers.\1.mlp.up_proj.weight",
}
# fmt: on


def map_old_key_to_new(old_key: str) -> str:
    for pattern, replacement in STATE_DICT_MAPPING.items():
        new_key, n_replace = re.subn(pattern, replacement, old_key)
        if n_replace > 0:
            return new_key
    raise ValueError(f"Key: {old_key} could not be mapped (check the mapping).")


def permute_for_rope(tensor: torch.Tensor, n_heads: int, dim1: int, dim2: int) -> torch.Tensor:
    tensor = tensor.view(n_heads, dim1 // n_heads // 2, 2, dim2)
    tensor = tensor.transpose(1, 2)
    tensor = tensor.reshape(dim1, dim2)
    return tensor


def convert_state_dict(original_state_dict: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    new_dict = {}

    num_attention_heads = config.num_attention_heads
    hidden_size = config.hidden_size
    head_dim = config.head_dim
    num_key_value_heads = config.num_key_value_heads
    key_value_dim = head_dim * num_key_value_heads
    query_dim = head_dim * num_attention_heads

    for old_key, tensor in original_state_dict.items():
        new_key = map_old_key_to_new(old_key)

        if "q_proj" in new_key:
            tensor = tensor.view(num_attention_heads, head_dim, hidden_size).reshape(query_dim, hidden_size)
            tensor = permute_for_rope(tensor, num_attention_heads, query_dim, hidden_size)
        elif "k_proj" in new_key:
            tensor = tensor.view(num_key_value_heads, head_dim, hidden_size).reshape(key_value_dim, hidden_size)
            tensor = permute_for_rope(tensor, num_key_value_heads, key_value_dim, hidden_size)
        elif "v_proj" in new_key:
            tensor = tensor.view(num_key_value_heads, head_dim, hidden_size).reshape(key_value_dim, hidden_size)

        new_dict[new_key] = tensor
    return new_dict


def convert_config(original_config: dict[str, Any], max_position_embeddings: int = 32768) -> Any:
    from transformers import MistralConfig

    key_mapping = {
        "hidden_size": "dim",
        "num_hidden_layers": "n_layers",
        "intermediate_size": "hidden_dim",
        "num_attention_heads": "n_heads",
        "rms_norm_eps": "norm_eps",
    }
    similar_keys_to_keep = [
        "head_dim",
        "vocab_size",
    ]

    new_config_kwargs = {k: original_config[v] for k, v in key_mapping.items()}
    new_config_kwargs.update({k: v for k, v in original_config.items() if k in similar_keys_to_keep})

    new_config_kwargs["sliding_window"] = original_config.get("sliding_window", None)
    new_config_kwargs["num_key_value_heads"] = original_config.get("n_kv_heads", new_config_kwargs["num_attention_heads"])
    new_config_kwargs["rope_theta"] = original_config.get("rope_theta", 10000.0)
    new_config_kwargs["max_position_embeddings"] = original_config.get("max_seq_len", max_position_embeddings)

    if new_config_kwargs["sliding_window"] is not None:
        new_config_kwargs["sliding_window"] = int(new_config_kwargs["sliding_window"])

    return MistralConfig(**new_config_kwargs)


def convert_and_load(params: dict[str, Any], original_state_dict: dict[str, torch.Tensor]) -> tuple[Any, Any]:
    """``convert_and_write_model`` up to ``save_pretrained``: the model and its config."""
    from transformers import MistralForCausalLM

    config = convert_config(params)
    full_state_dict = convert_state_dict(original_state_dict, config)
    with torch.device("meta"):
        model = MistralForCausalLM(config)
    model.load_state_dict(full_state_dict, strict=True, assign=True)
    return model, config
