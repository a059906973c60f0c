"""Builders of EAGLE-3 drafters: AQ-MedAI-style (draft vocabulary with d2t/t2d, native or
speculators layout), lightseekorg-style (full vocabulary) and yuhuili's Llama-3.1 one."""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ckptxform.errors import UsageError, quote_keys
from ckptxform.standins.configs import native_config, speculators_config
from ckptxform.standins.dims import LLAMA31_8B_TINY, DrafterDims
from ckptxform.standins.draft_vocab import make_draft_vocab
from ckptxform.standins.tensors import (
    BuiltCheckpoint,
    TensorSpec,
    built_checkpoint,
    save_pickle,
    save_safetensors,
    numpy_dtype_named,
    seeded_values,
    write_json,
)

if TYPE_CHECKING:
    import numpy as np

__all__ = ["build_eagle3_drafter", "build_full_vocab_drafter", "build_llama_eagle3"]

Layout = Literal["native", "speculators"]
WeightFormat = Literal["safetensors", "bin"]

_LAYOUT_PREFIX = {"native": "midlayer.", "speculators": "layers.0."}


def build_eagle3_drafter(out_dir: str | Path, dims: DrafterDims,
                         target_ids: Sequence[int], *, seed: int = 0,
                         fmt: WeightFormat = "safetensors", include_embed: bool = False,
                         omit_keys: Iterable[str] = (), layout: Layout = "native",
                         d2t_encoding: Literal["offset", "absolute"] = "offset",
                         dtype_overrides: Mapping[str, str] | None = None,
                         with_training_state: bool = False,
                         verifier_name: str = "moonshotai/Kimi-K2.5",
                         verifier_architectures: Sequence[str] = (
                             "KimiK25ForConditionalGeneration",)) -> BuiltCheckpoint:
    """An EAGLE-3 drafter with a ``draft_vocab`` lm_head and d2t/t2d from ``target_ids``.

    ``layout="native"`` writes ``midlayer.*`` and a ``LlamaForCausalLMEagle3`` config;
    ``"speculators"`` writes ``layers.0.*`` and an ``Eagle3Speculator`` config.
    ``omit_keys`` (names as written) and ``dtype_overrides`` (name -> torch dtype name)
    make broken variants; ``d2t_encoding="absolute"`` stores target ids as some
    third-party tools do; ``with_training_state`` adds the optimizer-state file the
    AQ-MedAI repo carries and no conversion needs.

    Example::

        ids = make_draft_vocab(KIMI_K2_TINY.vocab, KIMI_K2_TINY.draft_vocab, seed=0)
        build_eagle3_drafter(tmp_path / "k2", KIMI_K2_TINY, ids).keys[:2]
        # ('d2t', 'fc.weight')
    """
    ids = _check_target_ids(target_ids, dims)
    specs = _drafter_specs(dims, lm_rows=dims.draft_vocab, include_embed=include_embed)
    extra = _vocab_map_tensors(ids, dims.vocab, d2t_encoding)
    config = (native_config(dims, draft_vocab=True) if layout == "native" else
              speculators_config(dims, verifier_name, tuple(verifier_architectures)))
    return _write_drafter(Path(out_dir), dims, ids, specs, extra, config, seed=seed,
                          fmt=fmt, layout=layout, omit_keys=omit_keys,
                          dtype_overrides=dtype_overrides or {},
                          with_training_state=with_training_state)


def build_full_vocab_drafter(out_dir: str | Path, dims: DrafterDims, *, seed: int = 0,
                             fmt: WeightFormat = "safetensors", include_embed: bool = False,
                             omit_keys: Iterable[str] = ()) -> BuiltCheckpoint:
    """A drafter like lightseekorg/kimi-k2.5-eagle3: native layout, lm_head over the whole
    verifier vocabulary ``[vocab, hidden]``, no d2t/t2d, no ``draft_vocab_size``."""
    specs = _drafter_specs(dims, lm_rows=dims.vocab, include_embed=include_embed)
    return _write_drafter(Path(out_dir), dims, None, specs, {},
                          native_config(dims, draft_vocab=False), seed=seed, fmt=fmt,
                          layout="native", omit_keys=omit_keys, dtype_overrides={},
                          with_training_state=False)


def build_llama_eagle3(out_dir: str | Path, dims: DrafterDims = LLAMA31_8B_TINY, *,
                       seed: int = 0, target_ids: Sequence[int] | None = None,
                       include_embed: bool = False) -> BuiltCheckpoint:
    """A drafter like yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: native layout in a pickled
    ``pytorch_model.bin``, grouped-query attention, float16."""
    ids = (make_draft_vocab(dims.vocab, dims.draft_vocab, seed=seed)
           if target_ids is None else target_ids)
    return build_eagle3_drafter(out_dir, dims, ids, seed=seed, fmt="bin",
                                include_embed=include_embed,
                                verifier_name="meta-llama/Llama-3.1-8B-Instruct",
                                verifier_architectures=("LlamaForCausalLM",))


def _drafter_specs(dims: DrafterDims, *, lm_rows: int, include_embed: bool) -> list[TensorSpec]:
    d, h = dims.dtype, dims.hidden
    specs = [
        TensorSpec("midlayer.self_attn.q_proj.weight", (dims.q_out, 2 * h), d, "linear"),
        TensorSpec("midlayer.self_attn.k_proj.weight", (dims.kv_out, 2 * h), d, "linear"),
        TensorSpec("midlayer.self_attn.v_proj.weight", (dims.kv_out, 2 * h), d, "linear"),
        TensorSpec("midlayer.self_attn.o_proj.weight", (h, dims.q_out), d, "linear"),
        TensorSpec("midlayer.mlp.gate_proj.weight", (dims.intermediate, h), d, "linear"),
        TensorSpec("midlayer.mlp.up_proj.weight", (dims.intermediate, h), d, "linear"),
        TensorSpec("midlayer.mlp.down_proj.weight", (h, dims.intermediate), d, "linear"),
        TensorSpec("midlayer.input_layernorm.weight", (h,), d, "norm"),
        TensorSpec("midlayer.hidden_norm.weight", (h,), d, "norm"),
        TensorSpec("midlayer.post_attention_layernorm.weight", (h,), d, "norm"),
        TensorSpec("fc.weight", (h, dims.fc_in), d, "linear"),
        TensorSpec("norm.weight", (h,), d, "norm"),
        TensorSpec("lm_head.weight", (lm_rows, h), d, "linear"),
    ]
    if include_embed:
        specs.append(TensorSpec("embed_tokens.weight", (dims.vocab, h), d, "linear"))
    return specs


def _check_target_ids(target_ids: Sequence[int], dims: DrafterDims) -> tuple[int, ...]:
    ids = tuple(int(t) for t in target_ids)
    if len(ids) != dims.draft_vocab:
        raise UsageError(f"target_ids: {len(ids)} ids given for draft_vocab="
                         f"{dims.draft_vocab}; pass make_draft_vocab(vocab, draft_vocab, ...)")
    if any(b <= a for a, b in itertools.pairwise(ids)) or not (0 <= ids[0] and ids[-1] < dims.vocab):
        raise UsageError(f"target_ids: must be strictly ascending ids in [0, {dims.vocab}) "
                         "as EAGLE and SpecForge write them; sort and deduplicate them")
    return ids


def _vocab_map_tensors(ids: tuple[int, ...], vocab: int,
                       encoding: str) -> dict[str, np.ndarray]:
    import numpy as np

    target = np.array(ids, dtype=np.int64)
    # d2t holds target_id - draft_index (EAGLE cnets.py); "absolute" mimics tools that
    # store the target id itself.
    d2t = target - np.arange(len(ids), dtype=np.int64) if encoding == "offset" else target.copy()
    t2d = np.zeros(vocab, dtype=np.bool_)
    t2d[target] = True
    return {"d2t": d2t, "t2d": t2d}


def _write_drafter(out: Path, dims: DrafterDims, ids: tuple[int, ...] | None,
                   specs: list[TensorSpec], extra: dict[str, np.ndarray],
                   config: dict[str, Any], *, seed: int, fmt: WeightFormat,
                   layout: Layout, omit_keys: Iterable[str],
                   dtype_overrides: Mapping[str, str],
                   with_training_state: bool) -> BuiltCheckpoint:
    if layout not in _LAYOUT_PREFIX:
        raise UsageError(f"layout: {layout!r} is not one of 'native', 'speculators'")
    if fmt not in ("safetensors", "bin"):
        raise UsageError(f"fmt: {fmt!r} is not one of 'safetensors', 'bin'")
    prefix = _LAYOUT_PREFIX[layout]

    def out_key(native: str) -> str:
        return prefix + native.removeprefix("midlayer.") if native.startswith("midlayer.") \
            else native

    tensors = {out_key(s.key): seeded_values(s, seed) for s in specs}
    tensors.update(extra)
    omit = set(omit_keys)
    unknown = (omit | set(dtype_overrides)) - set(tensors)
    if unknown:
        raise UsageError(f"omit_keys/dtype_overrides: {quote_keys(unknown)} not in this "
                         f"drafter (keys: {quote_keys(tensors)})")
    for key, name in dtype_overrides.items():
        tensors[key] = tensors[key].astype(numpy_dtype_named(name))
    tensors = {k: v for k, v in sorted(tensors.items()) if k not in omit}

    out.mkdir(parents=True, exist_ok=True)
    weights = "model.safetensors" if fmt == "safetensors" else "pytorch_model.bin"
    if fmt == "safetensors":
        save_safetensors(tensors, out / weights)
    else:
        save_pickle(tensors, out / weights)
    files = ["config.json", weights]
    write_json(out / "config.json", config)
    if with_training_state:
        # a plain pickle (no torch to write it): the file only has to be there
        (out / "training_state.pt").write_bytes(pickle.dumps(_training_state(tensors, seed), protocol=4))
        files.append("training_state.pt")
    return built_checkpoint(out, dims, ids, tensors, files)


def _training_state(tensors: Mapping[str, np.ndarray], seed: int) -> dict[str, Any]:
    # Optimizer moments for two parameters plus counters: a pickle that nothing in a
    # conversion may need, as in the AQ-MedAI repo.
    moments = {k: {"shape": list(tensors[k].shape), "float32": bytes(4 * tensors[k].size)}
               for k in ("fc.weight", "norm.weight") if k in tensors}
    return {"epoch": 2, "global_step": 1000 + seed, "optimizer": {"exp_avg": moments},
            "scheduler": {"last_epoch": 1000 + seed}}
