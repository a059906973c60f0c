"""A z-lab DFlash drafter (``z-lab/Qwen3-8B-DFlash-b16``'s layout) and the Qwen3 verifier
it drafts for, at test size.

The drafter is a stack of Qwen3 decoder layers (``layers.N.*`` with q_norm/k_norm),
``fc`` over the verifier layers it reads, ``hidden_norm`` and ``norm``; it has no
embedding or lm_head of its own (z-lab borrows the verifier's). Its config.json is a
Qwen3 config plus z-lab's fields: ``architectures: [DFlashDraftModel]``, ``auto_map``,
``block_size`` (top level in the Qwen3/Llama releases, inside ``dflash_config`` in newer
ones), ``num_target_layers`` and ``dflash_config: {mask_token_id, target_layer_ids}``,
where layer id ``i`` is read from ``hidden_states[i + 1]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptxform.errors import UsageError
from ckptxform.standins.verifiers import build_verifier_head
from ckptxform.standins.tensors import (
    BuiltCheckpoint,
    TensorSpec,
    built_checkpoint,
    save_safetensors,
    seeded_values,
    write_json,
)

__all__ = ["QWEN3_DFLASH_TINY", "DFlashDims", "build_dflash_drafter", "build_qwen3_verifier"]


@dataclass(frozen=True, kw_only=True)
class DFlashDims:
    """A DFlash drafter's widths and the verifier layers it reads (``target_layer_ids``)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layers: int
    verifier_layers: int
    target_layer_ids: tuple[int, ...]
    block_size: int = 16
    #: newer z-lab configs keep block_size inside dflash_config
    block_size_in_dflash_config: bool = False
    dtype: str = "bfloat16"
    extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise UsageError(f"DFlashDims: heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if not self.target_layer_ids:
            raise UsageError("DFlashDims.target_layer_ids: give at least one verifier layer")


#: z-lab/Qwen3-8B-DFlash-b16 at test size, odd widths (hidden 40 = 5 heads x 8, GQA 5:1)
QWEN3_DFLASH_TINY = DFlashDims(hidden=40, heads=5, kv_heads=1, head_dim=8, intermediate=72, vocab=301,
                               layers=3, verifier_layers=9, target_layer_ids=(1, 4, 6))


def build_dflash_drafter(out_dir: str | Path, dims: DFlashDims = QWEN3_DFLASH_TINY, *, seed: int = 0,
                         omit_config: tuple[str, ...] = ()) -> BuiltCheckpoint:
    """The z-lab drafter in ``model.safetensors`` + config.json; ``omit_config`` drops
    dotted config fields (``dflash_config.target_layer_ids``) to make broken variants."""
    d, h = dims.dtype, dims.hidden
    q, kv = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
    specs = [TensorSpec("fc.weight", (h, len(dims.target_layer_ids) * h), d, "linear"),
             TensorSpec("hidden_norm.weight", (h,), d, "norm"), TensorSpec("norm.weight", (h,), d, "norm")]
    for i in range(dims.layers):
        p = f"layers.{i}."
        specs += [TensorSpec(p + "self_attn.q_proj.weight", (q, h), d, "linear"),
                  TensorSpec(p + "self_attn.k_proj.weight", (kv, h), d, "linear"),
                  TensorSpec(p + "self_attn.v_proj.weight", (kv, h), d, "linear"),
                  TensorSpec(p + "self_attn.o_proj.weight", (h, q), d, "linear"),
                  TensorSpec(p + "self_attn.q_norm.weight", (dims.head_dim,), d, "norm"),
                  TensorSpec(p + "self_attn.k_norm.weight", (dims.head_dim,), d, "norm"),
                  TensorSpec(p + "mlp.gate_proj.weight", (dims.intermediate, h), d, "linear"),
                  TensorSpec(p + "mlp.up_proj.weight", (dims.intermediate, h), d, "linear"),
                  TensorSpec(p + "mlp.down_proj.weight", (h, dims.intermediate), d, "linear"),
                  TensorSpec(p + "input_layernorm.weight", (h,), d, "norm"),
                  TensorSpec(p + "post_attention_layernorm.weight", (h,), d, "norm")]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {s.key: seeded_values(s, seed) for s in specs}
    save_safetensors(tensors, out / "model.safetensors")
    config = _drafter_config(dims)
    for path in omit_config:
        *parents, last = path.split(".")
        holder = config
        for part in parents:
            holder = holder[part]
        del holder[last]
    write_json(out / "config.json", config)
    return built_checkpoint(out, dims, None, tensors, ["config.json", "model.safetensors"])  # type: ignore[arg-type]


def build_qwen3_verifier(out_dir: str | Path, dims: DFlashDims = QWEN3_DFLASH_TINY, *,
                         seed: int = 0) -> BuiltCheckpoint:
    """What a DFlash drafter's consumer reads of its Qwen3 verifier (Qwen/Qwen3-8B): the
    embedding, final norm and lm_head in one file, and its config.json
    (``verifier_layers`` layers, whose weights no drafter conversion reads)."""
    config = {**_qwen3_fields(dims), "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": dims.verifier_layers}
    return build_verifier_head(out_dir, dims, vocab=dims.vocab, hidden=dims.hidden, config=config, seed=seed)


def qwen3_fields(dims: DFlashDims) -> dict[str, Any]:
    """The Qwen3 config fields of ``dims`` (the verifier's; DFlash and DSpark drafters copy them)."""
    return _qwen3_fields(dims)


def _qwen3_fields(dims: DFlashDims) -> dict[str, Any]:
    return {"model_type": "qwen3", "hidden_size": dims.hidden, "intermediate_size": dims.intermediate,
            "num_attention_heads": dims.heads, "num_key_value_heads": dims.kv_heads, "head_dim": dims.head_dim,
            "vocab_size": dims.vocab, "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None, "max_position_embeddings": 40960,
            "max_window_layers": dims.layers, "use_sliding_window": False, "sliding_window": None,
            "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.02, "tie_word_embeddings": False,
            "torch_dtype": dims.dtype, "use_cache": True}


def _drafter_config(dims: DFlashDims) -> dict[str, Any]:
    dflash: dict[str, Any] = {"mask_token_id": dims.vocab - 1, "target_layer_ids": list(dims.target_layer_ids)}
    config: dict[str, Any] = {
        **_qwen3_fields(dims),
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "num_hidden_layers": dims.layers,
        "layer_types": ["full_attention"] * dims.layers,
        "num_target_layers": dims.verifier_layers,
        "dflash_config": dflash,
        "transformers_version": "4.57.1",
        **dims.extra_config,
    }
    if dims.block_size_in_dflash_config:
        dflash["block_size"] = dims.block_size
    else:
        config["block_size"] = dims.block_size
    return config
