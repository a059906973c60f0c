"""Stand-ins of the whole-model checkpoints the structural rules convert, built without
transformers: Llama (tied, untied, or with an lm_head copied from the embedding),
Mixtral and Qwen3-MoE in the per-expert layout the Hub publishes, Phi-3 with its fused
projections, GPT-2 as openai-community/gpt2 stores it (Conv1D [in, out], no
``transformer.`` prefix, causal-mask buffers) and Meta/Mistral ``consolidated`` files
with ``params.json``.

Key names, shapes, dtypes and config fields are those of the real repos (the layouts of
structural-ops.md; tests/reference_models.py builds the same families with transformers),
with the widths of ``LmDims``. Values are seeded by (seed, key name), as every stand-in's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ckptxform.errors import UsageError
from ckptxform.standins.tensors import TensorSpec, save_safetensors, seeded_values, write_json

__all__ = ["GEMMA_TINY", "LM_TINY", "LmDims", "build_gemma", "build_gpt2", "build_llama", "build_meta_consolidated",
           "build_moe", "build_phi3", "build_qwen2"]


@dataclass(frozen=True, kw_only=True)
class LmDims:
    """The widths of a decoder-only language model (config.json names in comments)."""

    hidden: int = 64            # hidden_size
    heads: int = 4              # num_attention_heads
    kv_heads: int = 2           # num_key_value_heads (GQA: fewer than heads)
    intermediate: int = 96      # intermediate_size (one expert's, in MoE models)
    layers: int = 2             # num_hidden_layers
    vocab: int = 256            # vocab_size
    experts: int = 4            # num_local_experts / num_experts (MoE only)
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.hidden % self.heads or self.heads % self.kv_heads or (self.hidden // self.heads) % 2:
            raise UsageError(f"LmDims: hidden={self.hidden}, heads={self.heads}, kv_heads={self.kv_heads}: "
                             "heads must divide hidden into even head sizes and kv_heads divide heads")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


LM_TINY = LmDims()

#: the generation_config.json every HF-layout stand-in carries (a file the rules' ``files`` copy)
_GENERATION = {"bos_token_id": 1, "eos_token_id": 2, "transformers_version": "5.0.0"}


def _linear(key: str, rows: int, cols: int, dtype: str) -> TensorSpec:
    return TensorSpec(key, (rows, cols), dtype, "linear")


def _norm(key: str, size: int, dtype: str) -> TensorSpec:
    return TensorSpec(key, (size,), dtype, "norm")


def _write(out: Path, specs: Iterable[TensorSpec], seed: int, config: dict[str, Any], *,
           weights: str = "model.safetensors", config_name: str = "config.json") -> Path:
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors({s.key: seeded_values(s, seed) for s in specs}, out / weights)
    write_json(out / config_name, config)
    if config_name == "config.json":
        write_json(out / "generation_config.json", _GENERATION)
    return out


def _attention(p: str, d: LmDims) -> list[TensorSpec]:
    return [_linear(f"{p}self_attn.q_proj.weight", d.heads * d.head_dim, d.hidden, d.dtype),
            _linear(f"{p}self_attn.k_proj.weight", d.kv_heads * d.head_dim, d.hidden, d.dtype),
            _linear(f"{p}self_attn.v_proj.weight", d.kv_heads * d.head_dim, d.hidden, d.dtype),
            _linear(f"{p}self_attn.o_proj.weight", d.hidden, d.heads * d.head_dim, d.dtype)]


def _layer_norms(p: str, d: LmDims) -> list[TensorSpec]:
    return [_norm(f"{p}input_layernorm.weight", d.hidden, d.dtype),
            _norm(f"{p}post_attention_layernorm.weight", d.hidden, d.dtype)]


def _gated_mlp(p: str, d: LmDims) -> list[TensorSpec]:
    return [_linear(f"{p}gate_proj.weight", d.intermediate, d.hidden, d.dtype),
            _linear(f"{p}up_proj.weight", d.intermediate, d.hidden, d.dtype),
            _linear(f"{p}down_proj.weight", d.hidden, d.intermediate, d.dtype)]


def _ends(d: LmDims, *, lm_head: bool) -> list[TensorSpec]:
    ends = [_linear("model.embed_tokens.weight", d.vocab, d.hidden, d.dtype),
            _norm("model.norm.weight", d.hidden, d.dtype)]
    return ends + ([_linear("lm_head.weight", d.vocab, d.hidden, d.dtype)] if lm_head else [])


def _decoder_config(architecture: str, model_type: str, d: LmDims, *, tied: bool,
                    rope_theta: float, max_positions: int, **fields: Any) -> dict[str, Any]:
    """A transformers 5.x config.json of a decoder-only model (``rope_parameters``, ``dtype``)."""
    return {"architectures": [architecture], "model_type": model_type, "hidden_size": d.hidden,
            "intermediate_size": d.intermediate, "num_attention_heads": d.heads,
            "num_key_value_heads": d.kv_heads, "num_hidden_layers": d.layers, "vocab_size": d.vocab,
            "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": max_positions,
            "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
            "attention_dropout": 0.0, "initializer_range": 0.02, "bos_token_id": 1, "eos_token_id": 2,
            "tie_word_embeddings": tied, "use_cache": True, "dtype": d.dtype,
            "transformers_version": "5.0.0", **fields}


def build_llama(out_dir: str | Path, dims: LmDims = LM_TINY, *, seed: int = 0,
                head: Literal["tied", "untied", "copy"] = "untied") -> Path:
    """A LlamaForCausalLM checkpoint (meta-llama/Llama-3.1-8B-Instruct; with ``head="tied"``
    Llama-3.2-1B: no ``lm_head.weight``, ``tie_word_embeddings: true``; with ``"copy"`` an
    ``lm_head.weight`` byte-identical to the embedding, as untie_embeddings writes)."""
    d = dims
    specs = _ends(d, lm_head=head == "untied")
    for n in range(d.layers):
        p = f"model.layers.{n}."
        specs += _attention(p, d) + _gated_mlp(f"{p}mlp.", d) + _layer_norms(p, d)
    config = _decoder_config("LlamaForCausalLM", "llama", d, tied=head == "tied", rope_theta=500000.0,
                             max_positions=131072, head_dim=d.head_dim, attention_bias=False, mlp_bias=False)
    out = _write(Path(out_dir), specs, seed, config)
    if head == "copy":  # the same seeded values again, plus the copy
        tensors = {s.key: seeded_values(s, seed) for s in specs}
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
        save_safetensors(tensors, out / "model.safetensors")
    return out


def build_moe(out_dir: str | Path, family: Literal["mixtral", "qwen3_moe"], dims: LmDims = LM_TINY, *,
              seed: int = 0) -> Path:
    """A mixture-of-experts model in the legacy per-expert layout the Hub publishes:
    ``"mixtral"`` as mistralai/Mixtral-8x7B-Instruct-v0.1 (``block_sparse_moe.experts.E.w1/w2/w3``,
    router ``block_sparse_moe.gate``), ``"qwen3_moe"`` as Qwen/Qwen3-30B-A3B
    (``mlp.experts.E.{gate,up,down}_proj``, router ``mlp.gate``, q/k norms)."""
    d = dims
    specs = _ends(d, lm_head=True)
    for n in range(d.layers):
        p = f"model.layers.{n}."
        specs += _attention(p, d) + _layer_norms(p, d)
        if family == "mixtral":
            specs.append(_linear(f"{p}block_sparse_moe.gate.weight", d.experts, d.hidden, d.dtype))
            for e in range(d.experts):
                x = f"{p}block_sparse_moe.experts.{e}."
                specs += [_linear(f"{x}w1.weight", d.intermediate, d.hidden, d.dtype),
                          _linear(f"{x}w2.weight", d.hidden, d.intermediate, d.dtype),
                          _linear(f"{x}w3.weight", d.intermediate, d.hidden, d.dtype)]
        else:
            specs += [_norm(f"{p}self_attn.q_norm.weight", d.head_dim, d.dtype),
                      _norm(f"{p}self_attn.k_norm.weight", d.head_dim, d.dtype),
                      _linear(f"{p}mlp.gate.weight", d.experts, d.hidden, d.dtype)]
            for e in range(d.experts):
                specs += _gated_mlp(f"{p}mlp.experts.{e}.", d)
    if family == "mixtral":
        config = _decoder_config("MixtralForCausalLM", "mixtral", d, tied=False, rope_theta=1e6,
                                 max_positions=32768, head_dim=d.head_dim, num_local_experts=d.experts,
                                 num_experts_per_tok=2, router_aux_loss_coef=0.02, output_router_logits=False,
                                 sliding_window=None)
    else:
        config = _decoder_config("Qwen3MoeForCausalLM", "qwen3_moe", d, tied=False, rope_theta=1e6,
                                 max_positions=40960, head_dim=d.head_dim, num_experts=d.experts,
                                 num_experts_per_tok=2, moe_intermediate_size=d.intermediate,
                                 decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                                 attention_bias=False, router_aux_loss_coef=0.001, output_router_logits=False)
    return _write(Path(out_dir), specs, seed, config)


def build_qwen2(out_dir: str | Path, dims: LmDims = LM_TINY, *, seed: int = 0, tied: bool = False) -> Path:
    """Qwen2ForCausalLM as Qwen/Qwen2.5-7B-Instruct stores it: q/k/v_proj with biases, o_proj
    without; ``tied``: as Qwen2.5-0.5B (no ``lm_head.weight``, ``tie_word_embeddings``)."""
    d = dims
    specs = _ends(d, lm_head=not tied)
    for n in range(d.layers):
        p = f"model.layers.{n}."
        specs += _attention(p, d) + [TensorSpec(f"{p}self_attn.{name}.bias", (size * d.head_dim,), d.dtype, "linear")
                                     for name, size in (("q_proj", d.heads), ("k_proj", d.kv_heads),
                                                        ("v_proj", d.kv_heads))]
        specs += _gated_mlp(f"{p}mlp.", d) + _layer_norms(p, d)
    config = _decoder_config("Qwen2ForCausalLM", "qwen2", d, tied=tied, rope_theta=1000000.0, max_positions=32768,
                             rms_norm_eps=1e-6, use_sliding_window=False, sliding_window=131072,
                             max_window_layers=d.layers, layer_types=["full_attention"] * d.layers)
    return _write(Path(out_dir), specs, seed, config)


def build_phi3(out_dir: str | Path, dims: LmDims = LM_TINY, *, seed: int = 0) -> Path:
    """Phi3ForCausalLM as microsoft/Phi-3-medium-4k-instruct stores it: fused
    ``self_attn.qkv_proj`` [(heads + 2 kv_heads) head_dim, hidden] (unequal under GQA) and
    ``mlp.gate_up_proj`` [2 intermediate, hidden]."""
    d = dims
    specs = _ends(d, lm_head=True)
    for n in range(d.layers):
        p = f"model.layers.{n}."
        specs += [_linear(f"{p}self_attn.qkv_proj.weight", (d.heads + 2 * d.kv_heads) * d.head_dim, d.hidden, d.dtype),
                  _linear(f"{p}self_attn.o_proj.weight", d.hidden, d.heads * d.head_dim, d.dtype),
                  _linear(f"{p}mlp.gate_up_proj.weight", 2 * d.intermediate, d.hidden, d.dtype),
                  _linear(f"{p}mlp.down_proj.weight", d.hidden, d.intermediate, d.dtype), *_layer_norms(p, d)]
    config = _decoder_config("Phi3ForCausalLM", "phi3", d, tied=False, rope_theta=10000.0, max_positions=4096,
                             embd_pdrop=0.0, resid_pdrop=0.0, sliding_window=2047,
                             original_max_position_embeddings=4096, pad_token_id=None)
    return _write(Path(out_dir), specs, seed, config)


#: Gemma's widths, shrunk: hidden not a power of two, a head_dim that is not hidden // heads, GQA
GEMMA_TINY = LmDims(hidden=36, heads=6, kv_heads=2, intermediate=52, vocab=96)


def build_gemma(out_dir: str | Path, dims: LmDims = GEMMA_TINY, *, seed: int = 0, head_dim: int = 10) -> Path:
    """GemmaForCausalLM as google/gemma-7b stores it: tied embeddings (no ``lm_head.weight``),
    RMSNorm weights ``w`` of ``x * (1 + w)`` (near 0, not near 1), an explicit ``head_dim``
    and the legacy ``hidden_act: gelu`` that transformers reads as the tanh approximation."""
    d = dims

    def norm(key: str) -> TensorSpec:  # w of x * (1 + w): drawn near 0, as a linear weight is
        return TensorSpec(key, (d.hidden,), d.dtype, "linear")

    specs = [_linear("model.embed_tokens.weight", d.vocab, d.hidden, d.dtype), norm("model.norm.weight")]
    for n in range(d.layers):
        p = f"model.layers.{n}."
        specs += [_linear(f"{p}self_attn.q_proj.weight", d.heads * head_dim, d.hidden, d.dtype),
                  _linear(f"{p}self_attn.k_proj.weight", d.kv_heads * head_dim, d.hidden, d.dtype),
                  _linear(f"{p}self_attn.v_proj.weight", d.kv_heads * head_dim, d.hidden, d.dtype),
                  _linear(f"{p}self_attn.o_proj.weight", d.hidden, d.heads * head_dim, d.dtype),
                  *_gated_mlp(f"{p}mlp.", d),
                  norm(f"{p}input_layernorm.weight"), norm(f"{p}post_attention_layernorm.weight")]
    config = _decoder_config("GemmaForCausalLM", "gemma", d, tied=True, rope_theta=10000.0, max_positions=8192,
                             head_dim=head_dim, hidden_act="gelu", hidden_activation=None, attention_bias=False,
                             rms_norm_eps=1e-6, pad_token_id=0)
    return _write(Path(out_dir), specs, seed, config)


def build_gpt2(out_dir: str | Path, dims: LmDims = LM_TINY, *, seed: int = 0, positions: int = 32) -> Path:
    """GPT2LMHeadModel as openai-community/gpt2 stores it: Conv1D weights [in, out], keys
    without the ``transformer.`` prefix, no ``lm_head.weight`` (tied to ``wte``), and each
    layer's causal-mask buffer ``h.N.attn.bias``; float32."""
    import numpy as np

    h, dt = dims.hidden, "float32"
    specs = [_linear("wte.weight", dims.vocab, h, dt), _linear("wpe.weight", positions, h, dt),
             _norm("ln_f.weight", h, dt), TensorSpec("ln_f.bias", (h,), dt, "linear")]
    for n in range(dims.layers):
        p = f"h.{n}."
        specs += [_norm(f"{p}ln_1.weight", h, dt), TensorSpec(f"{p}ln_1.bias", (h,), dt, "linear"),
                  _linear(f"{p}attn.c_attn.weight", h, 3 * h, dt), TensorSpec(f"{p}attn.c_attn.bias", (3 * h,), dt, "linear"),
                  _linear(f"{p}attn.c_proj.weight", h, h, dt), TensorSpec(f"{p}attn.c_proj.bias", (h,), dt, "linear"),
                  _norm(f"{p}ln_2.weight", h, dt), TensorSpec(f"{p}ln_2.bias", (h,), dt, "linear"),
                  _linear(f"{p}mlp.c_fc.weight", h, 4 * h, dt), TensorSpec(f"{p}mlp.c_fc.bias", (4 * h,), dt, "linear"),
                  _linear(f"{p}mlp.c_proj.weight", 4 * h, h, dt), TensorSpec(f"{p}mlp.c_proj.bias", (h,), dt, "linear")]
    tensors = {s.key: seeded_values(s, seed) for s in specs}
    mask = np.tril(np.ones((positions, positions), dtype=np.bool_)).reshape(1, 1, positions, positions)
    tensors |= {f"h.{n}.attn.bias": mask.copy() for n in range(dims.layers)}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, out / "model.safetensors")
    write_json(out / "config.json", {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": dims.vocab, "n_embd": h,
        "n_head": dims.heads, "n_layer": dims.layers, "n_positions": positions, "n_ctx": positions,
        "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1, "initializer_range": 0.02,
        "bos_token_id": 0, "eos_token_id": 0, "tie_word_embeddings": True, "use_cache": True})
    write_json(out / "generation_config.json", {"bos_token_id": 0, "eos_token_id": 0})
    return out


def build_meta_consolidated(out_dir: str | Path, dims: LmDims = LM_TINY, *, seed: int = 0) -> Path:
    """A Meta/Mistral consolidated checkpoint as mistralai/Mistral-7B-Instruct-v0.3 ships it
    beside its HF files: ``consolidated.safetensors`` with Meta's key names and its
    ``params.json``. Returns the weights file (what ``--source model=`` takes)."""
    d = dims
    specs = [_linear("tok_embeddings.weight", d.vocab, d.hidden, d.dtype), _norm("norm.weight", d.hidden, d.dtype),
             _linear("output.weight", d.vocab, d.hidden, d.dtype)]
    for n in range(d.layers):
        a, f = f"layers.{n}.attention.", f"layers.{n}.feed_forward."
        specs += [_linear(f"{a}wq.weight", d.heads * d.head_dim, d.hidden, d.dtype),
                  _linear(f"{a}wk.weight", d.kv_heads * d.head_dim, d.hidden, d.dtype),
                  _linear(f"{a}wv.weight", d.kv_heads * d.head_dim, d.hidden, d.dtype),
                  _linear(f"{a}wo.weight", d.hidden, d.heads * d.head_dim, d.dtype),
                  _linear(f"{f}w1.weight", d.intermediate, d.hidden, d.dtype),
                  _linear(f"{f}w2.weight", d.hidden, d.intermediate, d.dtype),
                  _linear(f"{f}w3.weight", d.intermediate, d.hidden, d.dtype),
                  _norm(f"layers.{n}.attention_norm.weight", d.hidden, d.dtype),
                  _norm(f"layers.{n}.ffn_norm.weight", d.hidden, d.dtype)]
    params = {"dim": d.hidden, "n_layers": d.layers, "head_dim": d.head_dim, "hidden_dim": d.intermediate,
              "n_heads": d.heads, "n_kv_heads": d.kv_heads, "norm_eps": 1e-5, "vocab_size": d.vocab,
              "rope_theta": 1000000.0}
    out = _write(Path(out_dir), specs, seed, params, weights="consolidated.safetensors", config_name="params.json")
    return out / "consolidated.safetensors"
