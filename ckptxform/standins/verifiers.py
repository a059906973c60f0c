"""Builders of verifier stand-ins: the sharded Kimi-K2.5 multimodal wrapper and the parts
of a Llama-3.1 verifier that a drafter's consumer reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckptxform.errors import UsageError
from ckptxform.standins.configs import int4_quantization_config, kimi_k25_config, llama_fields
from ckptxform.standins.deepseek import DeepseekV3Dims, Module, text_modules
from ckptxform.standins.dims import LLAMA31_8B_TINY, DrafterDims
from ckptxform.standins.quantized import module_sizes, module_tensors, routed_expert
from ckptxform.standins.shards import balanced_runs, write_sharded
from ckptxform.standins.tensors import (
    BuiltCheckpoint,
    TensorSpec,
    built_checkpoint,
    save_safetensors,
    seeded_values,
    write_json,
)

__all__ = ["build_kimi_k25_verifier", "build_llama_verifier", "build_verifier_head", "int4_group_size", "kimi_k25_text_dims"]


def build_kimi_k25_verifier(out_dir: str | Path, dims: DrafterDims, *, num_shards: int = 64,
                            seed: int = 0) -> BuiltCheckpoint:
    """moonshotai/Kimi-K2.5's layout: a multimodal wrapper around a DeepSeek-V3 text model
    (``kimi_k25_text_dims(dims)``) whose routed experts are compressed-tensors int4
    (``weight_packed``/``weight_scale``/``weight_shape``), everything else in ``dims.dtype``,
    with the ``quantization_config`` in ``text_config`` as the real repo has it.

    ``model-0000N-of-000NN.safetensors`` with an index; as in the real 64 shards, the
    decoder layers fill the first ``num_shards - 3`` shards, ``language_model.lm_head``,
    ``language_model.model.embed_tokens`` and the final norm sit together in shard
    ``num_shards - 2`` (62 of 64), and ``vision_tower.*``/``mm_projector.*`` in the last
    two (fewer shards fold these groups together).
    """
    if num_shards < 1:
        raise UsageError(f"num_shards: {num_shards} must be >= 1")
    out = Path(out_dir)
    text = kimi_k25_text_dims(dims)
    group = int4_group_size(text)
    embed, layers, (norm, lm_head) = text_modules(text, prefix="language_model.model.")
    segments = [[m for layer in layers for m in layer], [lm_head, *embed, norm], _vision_modules(dims)]

    def fmt(m: Module) -> str:  # the config below quantizes routed experts only
        return "int4" if routed_expert(m) else "plain"

    sizes = [[module_sizes(m, fmt(m), dims.dtype, group=group) for m in seg] for seg in segments]
    modules = [(keys, (lambda m=m: module_tensors(m, fmt(m), dims.dtype, seed, group=group)))
               for seg, seg_sizes in zip(segments, sizes) for m, keys in zip(seg, seg_sizes)]
    counts = [sum(len(keys) for keys in seg_sizes) for seg_sizes in sizes]
    names = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    written = write_sharded(out, names, modules, lambda all_sizes: _k25_placement(all_sizes, counts, num_shards))
    write_json(out / "config.json", kimi_k25_config(dims, text, int4_quantization_config(group)))
    return BuiltCheckpoint(path=out, dims=dims, target_ids=None, keys=tuple(sorted(written.weight_map)),
                           shapes=written.shapes, dtypes=written.dtypes,
                           files=tuple(sorted(["config.json", "model.safetensors.index.json", *names])))


def kimi_k25_text_dims(dims: DrafterDims) -> DeepseekV3Dims:
    """The Kimi-K2.5 text model at a drafter's verifier width: attention ``heads x
    head_dim`` wide as the drafter's (o_proj [hidden, heads*head_dim]), the dense MLP of
    the drafter's intermediate size, MLA ranks and the expert width in Kimi's proportions."""
    vh = dims.verifier_hidden

    def multiple_of_8(x: float) -> int:
        return max(8, round(x / 8) * 8)

    return DeepseekV3Dims(
        hidden=vh, layers=dims.verifier_layers, heads=dims.heads,
        q_lora_rank=multiple_of_8(vh * 1536 / 7168), kv_lora_rank=multiple_of_8(vh * 512 / 7168),
        qk_nope_head_dim=dims.head_dim, qk_rope_head_dim=max(2, dims.head_dim // 4 * 2),
        v_head_dim=dims.head_dim, intermediate=dims.intermediate,
        moe_intermediate=multiple_of_8(dims.intermediate * 2048 / 18432), routed_experts=4,
        shared_experts=1, experts_per_token=2, first_k_dense=1, vocab=dims.vocab, dtype=dims.dtype)


def int4_group_size(text: DeepseekV3Dims) -> int:
    """The real group of 32 columns, halved while a scaled-down expert width (hidden for
    gate/up, moe_intermediate for down) is not a multiple of it."""
    group = 32
    while text.hidden % group or text.moe_intermediate % group:
        group //= 2
    return group


def _vision_modules(dims: DrafterDims) -> list[Module]:
    vision, vh = max(16, dims.verifier_hidden // 4), dims.verifier_hidden
    return [Module("vision_tower.patch_embed.proj", (vision, 3, 2, 2), "embedding"),
            Module("vision_tower.encoder.blocks.0.wqkv", (3 * vision, vision), "linear"),
            Module("mm_projector.proj.0", (vh, 4 * vision), "linear")]


def _k25_placement(sizes: list[int], counts: list[int], num_shards: int) -> list[int]:
    """Layers over the first shards, the text head alone in the third-to-last, vision in
    the last two (as Kimi-K2.5's 64 shards); fewer shards share."""
    n_layers, n_head, n_vision = counts
    if num_shards >= 4:
        vision = [num_shards - 2 + s for s in balanced_runs(sizes[n_layers + n_head:], 2)]
        return [*balanced_runs(sizes[:n_layers], num_shards - 3), *[num_shards - 3] * n_head, *vision]
    head = max(0, num_shards - 2)
    return [*[0] * n_layers, *[head] * n_head, *[num_shards - 1] * n_vision]


def build_llama_verifier(out_dir: str | Path, dims: DrafterDims = LLAMA31_8B_TINY, *,
                         seed: int = 0) -> BuiltCheckpoint:
    """What a drafter's consumer reads from a Llama-3.1 verifier
    (meta-llama/Llama-3.1-8B-Instruct): ``model.embed_tokens.weight``,
    ``model.norm.weight`` and ``lm_head.weight`` in one ``model.safetensors``, with the
    verifier's ``LlamaForCausalLM`` config.json (``verifier_layers`` layers, whose
    weights are left out: no drafter conversion or consumer reads them)."""
    vh = dims.verifier_hidden
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **llama_fields(dims),
              "hidden_size": vh, "num_hidden_layers": dims.verifier_layers,
              "torch_dtype": dims.dtype}
    return build_verifier_head(out_dir, dims, vocab=dims.vocab, hidden=vh, config=config, seed=seed)


def build_verifier_head(out_dir: str | Path, dims: Any, *, vocab: int, hidden: int, config: dict[str, Any],
                        seed: int) -> BuiltCheckpoint:
    """The parts of a verifier a drafter's consumer reads: ``model.embed_tokens.weight``,
    ``model.norm.weight`` and ``lm_head.weight`` in one ``model.safetensors`` (in
    ``dims.dtype``), beside its ``config``."""
    d = dims.dtype
    specs = [TensorSpec("model.embed_tokens.weight", (vocab, hidden), d, "linear"),
             TensorSpec("model.norm.weight", (hidden,), d, "norm"),
             TensorSpec("lm_head.weight", (vocab, hidden), d, "linear")]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {s.key: seeded_values(s, seed) for s in specs}
    save_safetensors(tensors, out / "model.safetensors")
    write_json(out / "config.json", config)
    return built_checkpoint(out, dims, None, tensors, ["config.json", "model.safetensors"])
