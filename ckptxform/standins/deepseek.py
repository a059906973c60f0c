"""The DeepSeek-V3 text model (MLA attention, MoE) that Kimi-K2, K2-Thinking and K2.5
share: its dimensions, its tensors module by module, and its config fields.

``KIMI_K2_TEXT`` is moonshotai/Kimi-K2-Instruct's text model; ``scaled(divisor)`` divides
every width by ``divisor``, so an FP8 block of ``128 // divisor`` keeps the real block
grid (``kv_a_proj_with_mqa`` [576, 7168] with scale [5, 56] becomes [36, 448] with
scale [5, 56] at divisor 16).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from ckptxform.errors import UsageError

__all__ = ["KIMI_K2_TEXT", "DeepseekV3Dims", "Module", "deepseek_v3_fields", "nextn_modules", "text_modules"]

#: how a module's weight is stored: a linear layer (may be quantized), a norm, the router
Kind = Literal["linear", "norm", "router", "embedding"]


@dataclass(frozen=True, kw_only=True)
class DeepseekV3Dims:
    """Widths and counts of a DeepSeek-V3-style text model (config.json names in comments)."""

    hidden: int                 # hidden_size
    layers: int                 # num_hidden_layers
    heads: int                  # num_attention_heads (= num_key_value_heads)
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate: int           # intermediate_size (dense layers)
    moe_intermediate: int       # moe_intermediate_size (one expert)
    routed_experts: int         # n_routed_experts
    shared_experts: int         # n_shared_experts
    experts_per_token: int      # num_experts_per_tok
    first_k_dense: int          # first_k_dense_replace
    vocab: int                  # vocab_size
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, int) and value < (0 if field.name == "first_k_dense" else 1):
                raise UsageError(f"DeepseekV3Dims.{field.name}: {value!r} is too small")
        if self.qk_rope_head_dim % 2:
            raise UsageError(f"DeepseekV3Dims.qk_rope_head_dim: {self.qk_rope_head_dim} is odd; "
                             "rotary embeddings rotate pairs, pick an even size")
        if self.experts_per_token > self.routed_experts:
            raise UsageError(f"DeepseekV3Dims.experts_per_token: {self.experts_per_token} exceeds "
                             f"routed_experts={self.routed_experts}")

    def scaled(self, divisor: int, **overrides: Any) -> DeepseekV3Dims:
        """Every width (and the head count) divided by ``divisor``; counts (layers,
        experts, vocab) as given in ``overrides``."""
        widths = ("hidden", "heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                  "qk_rope_head_dim", "v_head_dim", "intermediate", "moe_intermediate")
        uneven = [w for w in widths if getattr(self, w) % divisor]
        if uneven:
            raise UsageError(f"DeepseekV3Dims.scaled: {divisor} does not divide "
                             + ", ".join(f"{w}={getattr(self, w)}" for w in uneven))
        derived = {w: getattr(self, w) // divisor for w in widths}
        return dataclasses.replace(self, **{**derived, **overrides})


# moonshotai/Kimi-K2-Instruct config.json
KIMI_K2_TEXT = DeepseekV3Dims(
    hidden=7168, layers=61, heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, intermediate=18432, moe_intermediate=2048,
    routed_experts=384, shared_experts=1, experts_per_token=8, first_k_dense=1, vocab=163840,
)


@dataclass(frozen=True)
class Module:
    """One module's weight: ``{name}.weight`` of ``shape`` (a bias rides along for routers)."""

    name: str
    shape: tuple[int, ...]
    kind: Kind


def text_modules(dims: DeepseekV3Dims, prefix: str = "model.") -> tuple[list[Module], list[list[Module]], list[Module]]:
    """(embedding, one list per decoder layer, final norm and lm_head) in the order
    ``save_pretrained`` writes them; ``prefix`` is ``model.`` (Kimi-K2) or
    ``language_model.model.`` (Kimi-K2.5, whose lm_head is ``language_model.lm_head``)."""
    h = dims.hidden
    qk = dims.qk_nope_head_dim + dims.qk_rope_head_dim

    def mlp(p: str, inter: int) -> list[Module]:
        return [Module(f"{p}.gate_proj", (inter, h), "linear"), Module(f"{p}.up_proj", (inter, h), "linear"),
                Module(f"{p}.down_proj", (h, inter), "linear")]

    def layer(i: int) -> list[Module]:
        p = f"{prefix}layers.{i}"
        out = [
            Module(f"{p}.input_layernorm", (h,), "norm"),
            Module(f"{p}.self_attn.q_a_proj", (dims.q_lora_rank, h), "linear"),
            Module(f"{p}.self_attn.q_a_layernorm", (dims.q_lora_rank,), "norm"),
            Module(f"{p}.self_attn.q_b_proj", (dims.heads * qk, dims.q_lora_rank), "linear"),
            Module(f"{p}.self_attn.kv_a_proj_with_mqa", (dims.kv_lora_rank + dims.qk_rope_head_dim, h), "linear"),
            Module(f"{p}.self_attn.kv_a_layernorm", (dims.kv_lora_rank,), "norm"),
            Module(f"{p}.self_attn.kv_b_proj",
                   (dims.heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank), "linear"),
            Module(f"{p}.self_attn.o_proj", (h, dims.heads * dims.v_head_dim), "linear"),
            Module(f"{p}.post_attention_layernorm", (h,), "norm"),
        ]
        if i < dims.first_k_dense:
            return out + mlp(f"{p}.mlp", dims.intermediate)
        out.append(Module(f"{p}.mlp.gate", (dims.routed_experts, h), "router"))
        for e in range(dims.routed_experts):
            out += mlp(f"{p}.mlp.experts.{e}", dims.moe_intermediate)
        return out + mlp(f"{p}.mlp.shared_experts", dims.moe_intermediate * dims.shared_experts)

    lm_head = "language_model.lm_head" if prefix.startswith("language_model.") else "lm_head"
    return ([Module(f"{prefix}embed_tokens", (dims.vocab, h), "embedding")],
            [layer(i) for i in range(dims.layers)],
            [Module(f"{prefix}norm", (h,), "norm"), Module(lm_head, (dims.vocab, h), "embedding")])


def nextn_modules(dims: DeepseekV3Dims, prefix: str = "model.") -> list[Module]:
    """DeepSeek-V3's multi-token-prediction block, kept as one more decoder layer
    ``model.layers.{num_hidden_layers}``: a MoE layer plus ``enorm``/``hnorm`` (the token
    embedding's and the hidden state's norms), ``eh_proj`` [hidden, 2*hidden] and its own
    ``embed_tokens`` and ``shared_head.{norm,head}`` (copies of the main model's). eh_proj
    is kept unquantized here (UNVERIFIED for the FP8 releases)."""
    n, h = dims.layers, dims.hidden
    layer = text_modules(dataclasses.replace(dims, layers=n + 1), prefix)[1][-1]
    p = f"{prefix}layers.{n}"
    return [Module(f"{p}.embed_tokens", (dims.vocab, h), "embedding"), Module(f"{p}.enorm", (h,), "norm"),
            Module(f"{p}.hnorm", (h,), "norm"), Module(f"{p}.eh_proj", (h, 2 * h), "embedding"), *layer,
            Module(f"{p}.shared_head.norm", (h,), "norm"), Module(f"{p}.shared_head.head", (dims.vocab, h), "embedding")]


def deepseek_v3_fields(dims: DeepseekV3Dims) -> dict[str, Any]:
    """The text model's config.json fields (Kimi-K2-Instruct's, at these dimensions)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "kimi_k2",
        "hidden_size": dims.hidden,
        "num_hidden_layers": dims.layers,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.heads,
        "q_lora_rank": dims.q_lora_rank,
        "kv_lora_rank": dims.kv_lora_rank,
        "qk_nope_head_dim": dims.qk_nope_head_dim,
        "qk_rope_head_dim": dims.qk_rope_head_dim,
        "v_head_dim": dims.v_head_dim,
        "intermediate_size": dims.intermediate,
        "moe_intermediate_size": dims.moe_intermediate,
        "n_routed_experts": dims.routed_experts,
        "n_shared_experts": dims.shared_experts,
        "num_experts_per_tok": dims.experts_per_token,
        "first_k_dense_replace": dims.first_k_dense,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.827,
        "vocab_size": dims.vocab,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 50000.0,
        "max_position_embeddings": 131072,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": 163584 if dims.vocab > 163585 else 0,
        "eos_token_id": 163585 if dims.vocab > 163585 else 1,
        "tie_word_embeddings": False,
        "torch_dtype": dims.dtype,
        "use_cache": True,
    }
