"""A DeepSpec DSpark drafter for a Qwen3 verifier (``deepseek-ai/DeepSpec``'s
``Qwen3DSparkModel`` as its trainer saves it), at test size.

DSpark is DFlash's backbone (``layers.N.*`` with q_norm/k_norm, ``fc``, ``hidden_norm``,
``norm``) plus a Markov logit-bias head (``markov_head.markov_w1`` [vocab, rank] embedding
of the previous token, ``markov_w2`` [vocab, rank]; the gated variant adds
``markov_head.gate_proj``) and a confidence head (``confidence_head.proj``, one logit from
the hidden state, and the Markov embedding when ``confidence_head_with_markov``).
DeepSpec's model also holds ``embed_tokens`` and ``lm_head``: frozen copies of the
verifier's, so the stand-in copies them from the stand-in verifier.

Its config.json is the verifier's config with DeepSpec's fields flat at the top level
(``build_draft_config``): ``architectures: [Qwen3DSparkModel]``, ``num_target_layers``,
``num_hidden_layers``, ``block_size``, ``layer_types``, ``mask_token_id``,
``target_layer_ids`` (id i reads hidden_states[i + 1]; -1 the embedding output),
``num_anchors``, ``enable_confidence_head`` (+ ``confidence_head_with_markov``) and
``markov_rank`` (+ ``markov_head_type``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptxform.standins.dflash import DFlashDims, build_dflash_drafter, build_qwen3_verifier, qwen3_fields
from ckptxform.standins.tensors import (
    BuiltCheckpoint,
    TensorSpec,
    built_checkpoint,
    save_safetensors,
    seeded_values,
    write_json,
)

__all__ = ["QWEN3_DSPARK_TINY", "DSparkDims", "build_dspark_drafter", "build_dspark_verifier"]


@dataclass(frozen=True, kw_only=True)
class DSparkDims(DFlashDims):
    """A DSpark drafter: DFlash's widths plus its two heads."""

    markov_rank: int = 12
    markov_head_type: str = "vanilla"
    confidence_head: bool = True
    confidence_head_with_markov: bool = True
    num_anchors: int = 512


#: DeepSpec's dspark_qwen3_4b recipe at test size: odd widths, GQA 5:1, block 7, an id of -1
QWEN3_DSPARK_TINY = DSparkDims(hidden=40, heads=5, kv_heads=1, head_dim=8, intermediate=72, vocab=301, layers=2,
                               verifier_layers=9, target_layer_ids=(-1, 3, 7), block_size=7)


def build_dspark_verifier(out_dir: str | Path, dims: DSparkDims = QWEN3_DSPARK_TINY, *, seed: int = 0) -> BuiltCheckpoint:
    return build_qwen3_verifier(out_dir, dims, seed=seed)


def build_dspark_drafter(out_dir: str | Path, verifier: str | Path, dims: DSparkDims = QWEN3_DSPARK_TINY, *,
                         seed: int = 0) -> BuiltCheckpoint:
    """The DeepSpec drafter in ``model.safetensors`` + config.json; ``verifier`` (a
    ``build_dspark_verifier`` output) gives the frozen embed_tokens and lm_head."""
    from safetensors.numpy import load_file

    out = Path(out_dir)
    backbone = build_dflash_drafter(out, dims, seed=seed)  # the DFlash body, rewritten below
    tensors: dict[str, Any] = load_file(str(backbone.path / "model.safetensors"))
    head = load_file(str(Path(verifier) / "model.safetensors"))
    tensors["embed_tokens.weight"] = head["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = head["lm_head.weight"]
    d, h, r = dims.dtype, dims.hidden, dims.markov_rank
    specs: list[TensorSpec] = []
    if r > 0:
        specs += [TensorSpec("markov_head.markov_w1.weight", (dims.vocab, r), d, "linear"),
                  TensorSpec("markov_head.markov_w2.weight", (dims.vocab, r), d, "linear")]
        if dims.markov_head_type == "gated":
            specs += [TensorSpec("markov_head.gate_proj.weight", (r, h + r), d, "linear"),
                      TensorSpec("markov_head.gate_proj.bias", (r,), d, "norm")]
    if dims.confidence_head:
        width = h + (r if dims.confidence_head_with_markov else 0)
        specs += [TensorSpec("confidence_head.proj.weight", (1, width), d, "linear"),
                  TensorSpec("confidence_head.proj.bias", (1,), d, "norm")]
    tensors.update({s.key: seeded_values(s, seed) for s in specs})
    save_safetensors(tensors, out / "model.safetensors")
    write_json(out / "config.json", _config(dims))
    return built_checkpoint(out, dims, None, tensors, ["config.json", "model.safetensors"])  # type: ignore[arg-type]


def _config(dims: DSparkDims) -> dict[str, Any]:
    config: dict[str, Any] = {
        **qwen3_fields(dims),
        "architectures": ["Qwen3DSparkModel"],
        "num_target_layers": dims.verifier_layers,
        "num_hidden_layers": dims.layers,
        "block_size": dims.block_size,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * dims.layers,
        "mask_token_id": dims.vocab - 1,
        "target_layer_ids": list(dims.target_layer_ids),
        "num_anchors": dims.num_anchors,
        "enable_confidence_head": dims.confidence_head,
        "markov_rank": dims.markov_rank,
        "transformers_version": "4.57.1",
    }
    if dims.confidence_head:
        config["confidence_head_with_markov"] = dims.confidence_head_with_markov
    if dims.markov_rank > 0:
        config["markov_head_type"] = dims.markov_head_type
    return config
