"""Builders of verifier stand-ins: the sharded Kimi-K2.5 multimodal wrapper and the parts
of a Llama-3.1 verifier that a drafter's consumer reads."""

from __future__ import annotations

from pathlib import Path

from ckptxform.errors import UsageError
from ckptxform.standins.configs import kimi_k25_config, llama_fields
from ckptxform.standins.dims import LLAMA31_8B_TINY, DrafterDims
from ckptxform.standins.tensors import (
    BuiltCheckpoint,
    TensorSpec,
    built_checkpoint,
    dtypes_of,
    save_safetensors,
    seeded_values,
    shapes_of,
    write_json,
)

__all__ = ["build_kimi_k25_verifier", "build_llama_verifier"]


def build_kimi_k25_verifier(out_dir: str | Path, dims: DrafterDims, *, num_shards: int = 4,
                            seed: int = 0) -> BuiltCheckpoint:
    """The text and vision weights of a Kimi-K2.5-like multimodal wrapper, sharded.

    ``model-0000N-of-0000M.safetensors`` with ``model.safetensors.index.json``:
    ``language_model.model.embed_tokens.weight`` in the first shard, decoder layers
    (dense, then int4-packed experts as compressed-tensors stores them) and
    ``vision_tower.*``/``mm_projector.*`` in the middle ones, and
    ``language_model.lm_head.weight`` [vocab, verifier_hidden] in the last.
    """
    if num_shards < 1:
        raise UsageError(f"num_shards: {num_shards} must be >= 1")
    out = Path(out_dir)
    groups = _verifier_groups(dims)
    shards = _assign_shards(groups, num_shards)
    names = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    weight_map: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    total = 0
    out.mkdir(parents=True, exist_ok=True)
    for name, specs in zip(names, shards):
        tensors = {s.key: seeded_values(s, seed) for s in specs}
        save_safetensors(tensors, out / name)
        for key, t in tensors.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
        shapes.update(shapes_of(tensors))
        dtypes.update(dtypes_of(tensors))
    write_json(out / "model.safetensors.index.json",
               {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    write_json(out / "config.json", kimi_k25_config(dims))
    return BuiltCheckpoint(path=out, dims=dims, target_ids=None,
                           keys=tuple(sorted(weight_map)), shapes=shapes, dtypes=dtypes,
                           files=tuple(sorted(["config.json", "model.safetensors.index.json",
                                               *names])))


def _verifier_groups(dims: DrafterDims) -> tuple[list[TensorSpec], list[list[TensorSpec]], list[TensorSpec]]:
    """(first shard, middle groups in order, last shard) of the stand-in verifier."""
    vh, d, lm = dims.verifier_hidden, dims.dtype, "language_model.model"
    inter = dims.intermediate
    vision = max(16, vh // 4)

    def layer(i: int) -> list[TensorSpec]:
        p = f"{lm}.layers.{i}"
        specs = [TensorSpec(f"{p}.input_layernorm.weight", (vh,), d, "norm"),
                 TensorSpec(f"{p}.self_attn.o_proj.weight", (vh, dims.q_out), d, "linear"),
                 TensorSpec(f"{p}.post_attention_layernorm.weight", (vh,), d, "norm")]
        if i == 0:  # DeepSeek-V3 keeps its first layer dense
            return specs + [TensorSpec(f"{p}.mlp.down_proj.weight", (vh, inter), d, "linear")]
        e = f"{p}.mlp.experts.0.down_proj"  # int4 experts: packed int32 + bf16 scales
        return specs + [TensorSpec(f"{e}.weight_packed", (vh, max(1, inter // 8)), "int32", "packed"),
                        TensorSpec(f"{e}.weight_scale", (vh, max(1, inter // 32)), d, "norm"),
                        TensorSpec(f"{e}.weight_shape", (2,), "int32", "shape", (vh, inter))]

    n = dims.verifier_layers
    first = [TensorSpec(f"{lm}.embed_tokens.weight", (dims.vocab, vh), d, "linear"), *layer(0)]
    middle = [layer(i) for i in range(1, n - 1)]
    middle.insert(len(middle) // 2, [
        TensorSpec("vision_tower.patch_embed.proj.weight", (vision, 3, 2, 2), d, "linear"),
        TensorSpec("vision_tower.encoder.blocks.0.wqkv.weight", (3 * vision, vision), d, "linear"),
        TensorSpec("mm_projector.proj.0.weight", (vh, 4 * vision), d, "linear"),
    ])
    last = [*(layer(n - 1) if n > 1 else []),
            TensorSpec(f"{lm}.norm.weight", (vh,), d, "norm"),
            TensorSpec("language_model.lm_head.weight", (dims.vocab, vh), d, "linear")]
    return first, middle, last


def _assign_shards(groups: tuple[list[TensorSpec], list[list[TensorSpec]], list[TensorSpec]],
                   num_shards: int) -> list[list[TensorSpec]]:
    first, middle, last = groups
    shards: list[list[TensorSpec]] = [[] for _ in range(num_shards)]
    shards[0].extend(first)
    inner = list(range(1, num_shards - 1)) or [0]
    for i, group in enumerate(middle):
        # contiguous runs of layers per shard, as save_pretrained writes them
        shards[inner[i * len(inner) // max(1, len(middle))]].extend(group)
    shards[-1].extend(last)
    return shards


def build_llama_verifier(out_dir: str | Path, dims: DrafterDims = LLAMA31_8B_TINY, *,
                         seed: int = 0) -> BuiltCheckpoint:
    """What a drafter's consumer reads from a Llama-3.1 verifier
    (meta-llama/Llama-3.1-8B-Instruct): ``model.embed_tokens.weight``,
    ``model.norm.weight`` and ``lm_head.weight`` in one ``model.safetensors``, with the
    verifier's ``LlamaForCausalLM`` config.json (``verifier_layers`` layers, whose
    weights are left out: no drafter conversion or consumer reads them)."""
    vh, d = dims.verifier_hidden, dims.dtype
    specs = [TensorSpec("model.embed_tokens.weight", (dims.vocab, vh), d, "linear"),
             TensorSpec("model.norm.weight", (vh,), d, "norm"),
             TensorSpec("lm_head.weight", (dims.vocab, vh), d, "linear")]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {s.key: seeded_values(s, seed) for s in specs}
    save_safetensors(tensors, out / "model.safetensors")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **llama_fields(dims),
              "hidden_size": vh, "num_hidden_layers": dims.verifier_layers,
              "torch_dtype": dims.dtype}
    write_json(out / "config.json", config)
    return built_checkpoint(out, dims, None, tensors, ["config.json", "model.safetensors"])
