"""The ``llama`` architecture's hyperparameter key/values, as llama.cpp's converter
writes them for LlamaForCausalLM and kin, from the converted source's ``config.json``
(with the defaults transformers' LlamaConfig fills in, which the converter sees through
``AutoConfig``)."""

from __future__ import annotations

from typing import Any

from ....errors import PlanError


def llama_hparams(config: dict[str, Any], what: str) -> dict[str, Any]:
    """The config with LlamaConfig's defaults, refusing what this writer does not carry."""
    if "text_config" in config:
        raise PlanError(f"{what}: config.json has a text_config (a multimodal model); the llama GGUF "
                        "metadata is for a text LlamaForCausalLM: convert its text model first (llava_to_text)")
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size")
               if not isinstance(config.get(k), int)]
    if missing:
        raise PlanError(f"{what}: config.json has no integer {', '.join(missing)}; the llama GGUF metadata needs them")
    h = dict(config)
    h.setdefault("num_key_value_heads", h["num_attention_heads"])
    if h.get("head_dim") is None:
        h["head_dim"] = h["hidden_size"] // h["num_attention_heads"]
    h.setdefault("max_position_embeddings", 2048)
    h.setdefault("rms_norm_eps", 1e-6)
    h.setdefault("vocab_size", 32000)
    rope = dict(h.get("rope_parameters") or h.get("rope_scaling") or {})
    if "rope_theta" not in rope:
        rope["rope_theta"] = h.get("rope_theta", 10000.0)
    if "rope_type" not in rope and "type" in rope:
        rope["rope_type"] = rope["type"]
    if str(rope.get("rope_type", "")).lower() == "llama3":
        raise PlanError(f"{what}: rope_type llama3 needs llama.cpp's rope_freqs tensor, which this rule does not "
                        "make; convert with convert_hf_to_gguf.py")
    if rope.get("rope_type") not in (None, "default", "linear", "yarn"):
        raise PlanError(f"{what}: rope_type {rope.get('rope_type')!r} is not carried into GGUF metadata here "
                        "(default, linear and yarn are)")
    h["rope_parameters"] = rope
    return h


def add_llama_hparams(writer: Any, h: dict[str, Any], file_type: int) -> None:
    """Write the hyperparameters of ``h`` (``llama_hparams``) as the converter does, in its order."""
    import gguf

    writer.add_block_count(h["num_hidden_layers"])
    writer.add_context_length(h["max_position_embeddings"])
    writer.add_embedding_length(h["hidden_size"])
    writer.add_feed_forward_length(h["intermediate_size"])
    writer.add_head_count(h["num_attention_heads"])
    writer.add_head_count_kv(h["num_key_value_heads"])
    rope = h["rope_parameters"]
    factor = rope.get("factor")
    if rope.get("rope_type") == "linear" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(factor)
    elif rope.get("rope_type") == "yarn" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(factor)
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (("extrapolation_factor", writer.add_rope_scaling_yarn_ext_factor),
                         ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
            if rope.get(key) is not None:
                add(rope[key])
        attn = rope.get("attention_factor", rope.get("attn_factor"))
        if attn is not None:
            writer.add_rope_scaling_yarn_attn_factor(attn)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(h["rms_norm_eps"])
    writer.add_key_length(h["head_dim"])
    writer.add_value_length(h["head_dim"])
    writer.add_file_type(file_type)
    writer.add_vocab_size(h["vocab_size"])
    writer.add_rope_dimension_count(h["head_dim"])
