"""Verifiers that carry their own multi-token-prediction (MTP) layer, at test size.

- Qwen3-Next (Qwen/Qwen3-Next-80B-A3B-Instruct): a hybrid stack (three linear-attention
  layers, then a full-attention one) of MoE layers, and beside it ``mtp.*``: ``fc``
  [hidden, 2*hidden], ``pre_fc_norm_hidden``, ``pre_fc_norm_embedding``, ``norm`` and one
  full-attention MoE decoder layer ``mtp.layers.0.*`` with per-expert weights
  (``mlp.experts.E.{gate,up,down}_proj``), a shared expert and its gate. The MTP tensors
  sit in the last shard (with ``lm_head``, or alone), so a reader that goes through the
  index opens only that one.

Values are seeded by (seed, key), like every stand-in's: a changed seed changes every
tensor, and ``mtp_seed`` changes only the MTP layer (a fine-tuned head).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptxform.errors import UsageError
from ckptxform.standins.shards import write_sharded
from ckptxform.standins.tensors import BuiltCheckpoint, TensorSpec, numpy_dtype_named, seeded_values, write_json

__all__ = ["QWEN3_NEXT_TINY", "Qwen3NextDims", "build_qwen3_next_verifier", "qwen3_next_mtp_specs"]


@dataclass(frozen=True, kw_only=True)
class Qwen3NextDims:
    """Qwen3-Next's widths and counts (config.json names in comments)."""

    hidden: int                 # hidden_size
    heads: int                  # num_attention_heads
    kv_heads: int               # num_key_value_heads
    head_dim: int               # head_dim
    experts: int                # num_experts
    experts_per_token: int      # num_experts_per_tok
    moe_intermediate: int       # moe_intermediate_size (= shared_expert_intermediate_size)
    vocab: int                  # vocab_size
    layers: int = 4             # num_hidden_layers: every 4th is full attention
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads or self.experts_per_token > self.experts or self.layers % 4:
            raise UsageError(f"Qwen3NextDims: {self} (heads must be a multiple of kv_heads, "
                             "experts_per_token at most experts, layers a multiple of 4)")


#: Qwen3-Next-80B-A3B at test size, odd widths (hidden 40 = 5 heads x 8, GQA 5:1, 3 experts)
QWEN3_NEXT_TINY = Qwen3NextDims(hidden=40, heads=5, kv_heads=1, head_dim=8, experts=3, experts_per_token=2,
                                moe_intermediate=24, vocab=301)


def qwen3_next_mtp_specs(dims: Qwen3NextDims) -> list[TensorSpec]:
    """The ``mtp.*`` tensors of a Qwen3-Next checkpoint, in key order."""
    d, h = dims.dtype, dims.hidden
    p = "mtp.layers.0."
    specs = [TensorSpec("mtp.fc.weight", (h, 2 * h), d, "linear"), TensorSpec("mtp.norm.weight", (h,), d, "norm"),
             TensorSpec("mtp.pre_fc_norm_embedding.weight", (h,), d, "norm"),
             TensorSpec("mtp.pre_fc_norm_hidden.weight", (h,), d, "norm")]
    specs += _attention(p, dims) + _moe(p, dims)
    specs += [TensorSpec(p + "input_layernorm.weight", (h,), d, "norm"),
              TensorSpec(p + "post_attention_layernorm.weight", (h,), d, "norm")]
    return sorted(specs, key=lambda s: s.key)


def build_qwen3_next_verifier(out_dir: str | Path, dims: Qwen3NextDims = QWEN3_NEXT_TINY, *, seed: int = 0,
                              mtp_seed: int | None = None, num_shards: int = 3,
                              mtp_shard_alone: bool = False) -> BuiltCheckpoint:
    """A Qwen3-Next checkpoint in ``num_shards`` shards with an index: the main stack over
    all but the last, ``lm_head`` and the ``mtp.*`` tensors in the last one (``lm_head``
    with the main stack when ``mtp_shard_alone``)."""
    if num_shards < 2:
        raise UsageError(f"num_shards: {num_shards}; give at least 2 (the MTP layer has a shard of its own)")
    main = _main_specs(dims)
    mtp = qwen3_next_mtp_specs(dims)
    mtp_values = seed if mtp_seed is None else mtp_seed
    modules = [([(s.key, _nbytes(s))], (lambda s=s: {s.key: seeded_values(s, seed)})) for s in main]
    modules += [([(s.key, _nbytes(s))], (lambda s=s: {s.key: seeded_values(s, mtp_values)})) for s in mtp]
    names = [f"model-{n + 1:05d}-of-{num_shards:05d}.safetensors" for n in range(num_shards)]
    layer_count = len(main) if mtp_shard_alone else len(main) - 1  # else lm_head goes with the MTP layer

    def placement(sizes: list[int]) -> list[int]:
        per = -(-layer_count // (num_shards - 1))
        return [min(k // per, num_shards - 2) for k in range(layer_count)] + [num_shards - 1] * (len(sizes) - layer_count)

    out = Path(out_dir)
    written = write_sharded(out, names, modules, placement)
    write_json(out / "config.json", qwen3_next_config(dims))
    return BuiltCheckpoint(path=out, dims=dims, target_ids=None, keys=tuple(sorted(written.weight_map)),  # type: ignore[arg-type]
                           shapes=written.shapes, dtypes=written.dtypes,
                           files=tuple(sorted(["config.json", "model.safetensors.index.json", *names])))


def qwen3_next_config(dims: Qwen3NextDims) -> dict[str, Any]:
    """Qwen/Qwen3-Next-80B-A3B-Instruct's config.json fields at these dimensions."""
    return {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "hidden_size": dims.hidden, "num_attention_heads": dims.heads, "num_key_value_heads": dims.kv_heads,
        "head_dim": dims.head_dim, "intermediate_size": 3 * dims.moe_intermediate,
        "moe_intermediate_size": dims.moe_intermediate, "shared_expert_intermediate_size": dims.moe_intermediate,
        "num_experts": dims.experts, "num_experts_per_tok": dims.experts_per_token, "decoder_sparse_step": 1,
        "norm_topk_prob": True, "mlp_only_layers": [], "vocab_size": dims.vocab, "num_hidden_layers": dims.layers,
        "full_attention_interval": 4, "layer_types": _layer_types(dims),
        "linear_num_value_heads": 2, "linear_num_key_heads": 1, "linear_key_head_dim": dims.head_dim,
        "linear_value_head_dim": dims.head_dim, "linear_conv_kernel_dim": 4,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000000, "partial_rotary_factor": 0.25,
        "max_position_embeddings": 262144, "attention_bias": False, "attention_dropout": 0.0,
        "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": dims.dtype,
        "bos_token_id": 151643, "eos_token_id": 151645, "initializer_range": 0.02, "use_cache": True,
        "output_router_logits": False, "router_aux_loss_coef": 0.001, "transformers_version": "4.57.0.dev0",
    }


def _layer_types(dims: Qwen3NextDims) -> list[str]:
    return ["full_attention" if (n + 1) % 4 == 0 else "linear_attention" for n in range(dims.layers)]


def _attention(p: str, dims: Qwen3NextDims) -> list[TensorSpec]:
    d, h, q, kv = dims.dtype, dims.hidden, dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
    # q_proj is twice as wide: Qwen3-Next gates attention output with the second half
    return [TensorSpec(p + "self_attn.q_proj.weight", (2 * q, h), d, "linear"),
            TensorSpec(p + "self_attn.k_proj.weight", (kv, h), d, "linear"),
            TensorSpec(p + "self_attn.v_proj.weight", (kv, h), d, "linear"),
            TensorSpec(p + "self_attn.o_proj.weight", (h, q), d, "linear"),
            TensorSpec(p + "self_attn.q_norm.weight", (dims.head_dim,), d, "norm"),
            TensorSpec(p + "self_attn.k_norm.weight", (dims.head_dim,), d, "norm")]


def _moe(p: str, dims: Qwen3NextDims) -> list[TensorSpec]:
    d, h, i = dims.dtype, dims.hidden, dims.moe_intermediate
    specs = [TensorSpec(p + "mlp.gate.weight", (dims.experts, h), d, "linear"),
             TensorSpec(p + "mlp.shared_expert_gate.weight", (1, h), d, "linear")]
    for e in [*(f"experts.{n}" for n in range(dims.experts)), "shared_expert"]:
        specs += [TensorSpec(f"{p}mlp.{e}.gate_proj.weight", (i, h), d, "linear"),
                  TensorSpec(f"{p}mlp.{e}.up_proj.weight", (i, h), d, "linear"),
                  TensorSpec(f"{p}mlp.{e}.down_proj.weight", (h, i), d, "linear")]
    return specs


def _main_specs(dims: Qwen3NextDims) -> list[TensorSpec]:
    """The main stack (embedding, layers, final norm) and lm_head last."""
    d, h = dims.dtype, dims.hidden
    specs = [TensorSpec("model.embed_tokens.weight", (dims.vocab, h), d, "linear")]
    for n, kind in enumerate(_layer_types(dims)):
        p = f"model.layers.{n}."
        if kind == "full_attention":
            specs += _attention(p, dims)
        else:  # the gated delta-net's projections, reduced to two: only their keys matter here
            specs += [TensorSpec(p + "linear_attn.in_proj_qkvz.weight", (4 * dims.head_dim * 2, h), d, "linear"),
                      TensorSpec(p + "linear_attn.out_proj.weight", (h, 2 * dims.head_dim), d, "linear")]
        specs += _moe(p, dims) + [TensorSpec(p + "input_layernorm.weight", (h,), d, "norm"),
                                  TensorSpec(p + "post_attention_layernorm.weight", (h,), d, "norm")]
    return [*specs, TensorSpec("model.norm.weight", (h,), d, "norm"),
            TensorSpec("lm_head.weight", (dims.vocab, h), d, "linear")]


def _nbytes(spec: TensorSpec) -> int:
    n = numpy_dtype_named(spec.dtype).itemsize
    for dim in spec.shape:
        n *= dim
    return n
