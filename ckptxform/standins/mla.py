"""A stand-in of an MLA EAGLE-3 drafter (DeepSeek-V3-style attention), as newer Kimi-K2.5
drafters are (e.g. ``lightseekorg/kimi-k2.5-eagle3-mla``, architecture
``Eagle3DeepseekV2ForCausalLM``).

Key names and shapes come from the public loaders: SpecForge's
``specforge/modeling/draft/deepseek_eagle3.py`` (``DeepseekV3ForCausalLMEagle3``: a
``midlayer`` whose attention takes ``cat(embedding, hidden)``, i.e. ``2*hidden`` inputs,
through ``q_a_proj``/``q_a_layernorm``/``q_b_proj`` (or ``q_proj`` without a q LoRA rank),
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj`` and ``o_proj``; the Llama MLP and
norms; ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``) and vLLM's
``vllm/model_executor/models/deepseek_eagle3.py`` (which renames ``midlayer.`` to
``layers.0.`` and reads ``d2t``). The dimensions of the real drafter are UNVERIFIED: the
MLA ranks below are DeepSeek-V3's (and Kimi-K2's verifier's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptxform.standins.configs import native_config
from ckptxform.standins.dims import KIMI_K2_TINY, DrafterDims
from ckptxform.standins.tensors import (
    BuiltCheckpoint,
    TensorSpec,
    built_checkpoint,
    save_safetensors,
    seeded_values,
    write_json,
)

__all__ = ["KIMI_K25_MLA_TINY", "MlaDims", "build_mla_drafter"]


@dataclass(frozen=True)
class MlaDims:
    """An MLA drafter: the drafter's other dimensions plus its attention ranks."""

    base: DrafterDims
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def specs(self, *, lm_rows: int) -> list[TensorSpec]:
        d, h, heads = self.base.dtype, self.base.hidden, self.base.heads
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        attn = "midlayer.self_attn."
        if self.q_lora_rank is None:
            query = [TensorSpec(attn + "q_proj.weight", (heads * qk, 2 * h), d, "linear")]
        else:
            query = [TensorSpec(attn + "q_a_proj.weight", (self.q_lora_rank, 2 * h), d, "linear"),
                     TensorSpec(attn + "q_a_layernorm.weight", (self.q_lora_rank,), d, "norm"),
                     TensorSpec(attn + "q_b_proj.weight", (heads * qk, self.q_lora_rank), d, "linear")]
        return [
            *query,
            TensorSpec(attn + "kv_a_proj_with_mqa.weight", (self.kv_lora_rank + self.qk_rope_head_dim, 2 * h),
                       d, "linear"),
            TensorSpec(attn + "kv_a_layernorm.weight", (self.kv_lora_rank,), d, "norm"),
            TensorSpec(attn + "kv_b_proj.weight", (heads * (self.qk_nope_head_dim + self.v_head_dim),
                                                   self.kv_lora_rank), d, "linear"),
            TensorSpec(attn + "o_proj.weight", (h, heads * self.v_head_dim), d, "linear"),
            TensorSpec("midlayer.mlp.gate_proj.weight", (self.base.intermediate, h), d, "linear"),
            TensorSpec("midlayer.mlp.up_proj.weight", (self.base.intermediate, h), d, "linear"),
            TensorSpec("midlayer.mlp.down_proj.weight", (h, self.base.intermediate), d, "linear"),
            TensorSpec("midlayer.input_layernorm.weight", (h,), d, "norm"),
            TensorSpec("midlayer.hidden_norm.weight", (h,), d, "norm"),
            TensorSpec("midlayer.post_attention_layernorm.weight", (h,), d, "norm"),
            TensorSpec("fc.weight", (h, self.base.fc_in), d, "linear"),
            TensorSpec("norm.weight", (h,), d, "norm"),
            TensorSpec("lm_head.weight", (lm_rows, h), d, "linear"),
        ]

    def config(self) -> dict[str, Any]:
        """A DeepSeek-V3-style drafter config (the fields both loaders read)."""
        config = native_config(self.base, draft_vocab=False)
        config.update(architectures=["Eagle3DeepseekV2ForCausalLM"], model_type="deepseek_v3",
                      q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
                      qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                      v_head_dim=self.v_head_dim)
        config.pop("head_dim", None)  # MLA has per-part head widths instead
        return config


#: Kimi-K2.5-sized MLA ranks scaled down with the Kimi stand-in (DeepSeek-V3: 1536/512/128/64/128)
KIMI_K25_MLA_TINY = MlaDims(base=KIMI_K2_TINY, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
                            qk_rope_head_dim=8, v_head_dim=16)


def build_mla_drafter(out_dir: str | Path, dims: MlaDims = KIMI_K25_MLA_TINY, *, seed: int = 0,
                      target_ids: Sequence[int] | None = None) -> BuiltCheckpoint:
    """An MLA EAGLE-3 drafter in the native layout (``midlayer.*``): over the whole
    verifier vocabulary (no d2t/t2d, as the lightseekorg drafters) when ``target_ids`` is
    None, else over those draft tokens with their d2t (offsets) and t2d."""
    import numpy as np

    out = Path(out_dir)
    rows = dims.base.vocab if target_ids is None else len(target_ids)
    tensors = {s.key: seeded_values(s, seed) for s in dims.specs(lm_rows=rows)}
    config = dims.config()
    ids = None if target_ids is None else tuple(int(t) for t in target_ids)
    if ids is not None:
        target = np.array(ids, dtype=np.int64)
        tensors["d2t"] = target - np.arange(len(ids), dtype=np.int64)
        tensors["t2d"] = np.zeros(dims.base.vocab, dtype=np.bool_)
        tensors["t2d"][target] = True
        config["draft_vocab_size"] = len(ids)
    tensors = dict(sorted(tensors.items()))
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, out / "model.safetensors")
    write_json(out / "config.json", config)
    return built_checkpoint(out, dims.base, ids, tensors, ["config.json", "model.safetensors"])
