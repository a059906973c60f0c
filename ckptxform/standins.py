"""Small, real stand-ins of the checkpoints the headline conversion reads.

The Hub is out of reach for the demo, the tests and the benchmark, so they run on
checkpoints built here: the real key names, layouts, dtypes, config fields and vocabulary
maps of AQ-MedAI/Kimi-K2-Instruct-eagle3, AQ-MedAI/Kimi-K25-eagle3, moonshotai/Kimi-K2.5,
lightseekorg/kimi-k2.5-eagle3 and yuhuili/EAGLE3-LLaMA3.1-Instruct-8B (see
eagle3-formats.md), with the dimensions scaled down. Every builder is deterministic: the
same arguments give byte-identical files, so tests can compare hashes.

Tensor values are seeded by (seed, native key name), not by position: the speculators
layout of a drafter holds exactly the values of its native layout, and omitting a key does
not change the others. Only this module's builders import torch (lazily), so importing it
costs nothing to ``validate`` or ``plan``.

Example::

    standins = build_headline_standins(tmp_path)
    standins.sources  # {"drafter": ".../Kimi-K2-Instruct-eagle3", "target_vocab": ..., ...}
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ckptxform.dtypes import USER_DTYPES
from ckptxform.errors import UsageError, quote_keys

if TYPE_CHECKING:
    import torch

__all__ = [
    "KIMI_K2",
    "KIMI_K2_TINY",
    "LLAMA31_8B",
    "LLAMA31_8B_TINY",
    "BuiltCheckpoint",
    "DrafterDims",
    "HeadlineStandins",
    "build_eagle3_drafter",
    "build_full_vocab_drafter",
    "build_headline_standins",
    "build_kimi_k25_verifier",
    "build_llama_eagle3",
    "build_llama_verifier",
    "make_draft_vocab",
]

Layout = Literal["native", "speculators"]
WeightFormat = Literal["safetensors", "bin"]

_FLOAT_DTYPES = ("bfloat16", "float16", "float32")
_LAYOUT_PREFIX = {"native": "midlayer.", "speculators": "layers.0."}


# ----------------------------------------------------------------------------- dimensions


@dataclass(frozen=True, kw_only=True)
class DrafterDims:
    """The dimensions of an EAGLE-3 drafter and the verifier it drafts for.

    ``vocab`` is the verifier's vocabulary, ``draft_vocab`` the drafter's; ``aux_layers``
    are the verifier layers whose hidden states ``fc`` fuses (its input is
    ``len(aux_layers) * verifier_hidden`` wide). ``dtype`` is a torch-style name.
    """

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    draft_vocab: int
    verifier_hidden: int
    verifier_layers: int
    aux_layers: tuple[int, ...]
    bos_token_id: int
    eos_token_id: int
    dtype: str = "bfloat16"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 131072

    def __post_init__(self) -> None:
        positive = ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab",
                    "draft_vocab", "verifier_hidden", "verifier_layers")
        for name in positive:
            if getattr(self, name) <= 0:
                raise UsageError(f"DrafterDims.{name}: {getattr(self, name)!r} is not "
                                 "positive; give every dimension a value >= 1")
        if self.heads % self.kv_heads:
            raise UsageError(f"DrafterDims: heads={self.heads} is not a multiple of "
                             f"kv_heads={self.kv_heads}; pick kv_heads dividing heads")
        if self.draft_vocab > self.vocab:
            raise UsageError(f"DrafterDims: draft_vocab={self.draft_vocab} exceeds "
                             f"vocab={self.vocab}; the draft vocabulary is a subset")
        if not self.aux_layers or not all(0 <= i < self.verifier_layers
                                          for i in self.aux_layers):
            raise UsageError(f"DrafterDims.aux_layers: {list(self.aux_layers)!r} must be "
                             f"non-empty layer indices below verifier_layers="
                             f"{self.verifier_layers}")
        for name in ("bos_token_id", "eos_token_id"):
            if not 0 <= getattr(self, name) < self.vocab:
                raise UsageError(f"DrafterDims.{name}: {getattr(self, name)!r} is outside "
                                 f"the vocabulary [0, {self.vocab}); pick an id below vocab")
        if self.dtype not in _FLOAT_DTYPES:
            raise UsageError(f"DrafterDims.dtype: {self.dtype!r} is not one of "
                             f"{', '.join(_FLOAT_DTYPES)}")

    @property
    def q_out(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_out(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def fc_in(self) -> int:
        return len(self.aux_layers) * self.verifier_hidden

    def scaled(self, *, hidden: int = 64, head_dim: int = 16, vocab: int = 4096,
               draft_vocab: int = 512, verifier_layers: int = 8,
               **overrides: Any) -> DrafterDims:
        """The same architecture at other sizes, keeping this one's proportions.

        Heads follow ``heads*head_dim/hidden`` (Kimi's attention is wider than its hidden
        size), the MLP ratio is kept (rounded to a multiple of 32), grouped-query
        attention stays grouped, aux layers follow EAGLE's ``(2, n//2, n-3)`` and the
        special tokens keep their distance from the end of the vocabulary. Any field can
        be set explicitly, e.g. ``KIMI_K2.scaled(hidden=2048, head_dim=128, vocab=32000,
        draft_vocab=8000)`` for the benchmark.
        """
        heads = max(1, round(hidden * self.q_out / self.hidden / head_dim))
        group = self.heads // self.kv_heads
        kv_heads = heads // group if heads % group == 0 else heads
        if group > 1 and kv_heads < 2 and heads % 2 == 0 and heads >= 4:
            # Keep more than one KV head so that k/v shapes differ from q's and from a
            # single head's: multi-query attention would hide per-head reshape bugs.
            kv_heads = 2
        ratio = self.intermediate / self.hidden
        derived: dict[str, Any] = {
            "hidden": hidden,
            "heads": heads,
            "kv_heads": max(1, kv_heads),
            "head_dim": head_dim,
            "intermediate": max(32, round(hidden * ratio / 32) * 32),
            "vocab": vocab,
            "draft_vocab": draft_vocab,
            "verifier_hidden": max(1, hidden * self.verifier_hidden // self.hidden),
            "verifier_layers": verifier_layers,
            "aux_layers": (2, verifier_layers // 2, verifier_layers - 3),
            "bos_token_id": vocab - (self.vocab - self.bos_token_id),
            "eos_token_id": vocab - (self.vocab - self.eos_token_id),
        }
        unknown = set(overrides) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise UsageError(f"DrafterDims.scaled: unknown field(s) {quote_keys(unknown)}")
        derived.update(overrides)
        return dataclasses.replace(self, **derived)


# Kimi-K2 drafter (SpecForge configs/kimi-k2-eagle3.json): attention is 64x128 = 8192 wide
# on a 7168 hidden size, and the verifier (61 layers) has the same hidden size.
KIMI_K2 = DrafterDims(
    hidden=7168, heads=64, kv_heads=64, head_dim=128, intermediate=18432,
    vocab=163840, draft_vocab=32000, verifier_hidden=7168, verifier_layers=61,
    aux_layers=(2, 30, 58), bos_token_id=163584, eos_token_id=163585,
    dtype="bfloat16", rms_norm_eps=1e-6, rope_theta=1_000_000.0,
    max_position_embeddings=131072,
)

# yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: its config.json says float16 and 2048 positions.
LLAMA31_8B = DrafterDims(
    hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336,
    vocab=128256, draft_vocab=32000, verifier_hidden=4096, verifier_layers=32,
    aux_layers=(2, 16, 29), bos_token_id=128000, eos_token_id=128001,
    dtype="float16", rms_norm_eps=1e-5, rope_theta=500_000.0,
    max_position_embeddings=2048,
)

# hidden 112 with 8 heads of 16: attention wider than hidden, as in Kimi (7168 vs 64x128), and
# hidden divisible by the head count, which transformers (so speculators) requires.
KIMI_K2_TINY = KIMI_K2.scaled(hidden=112)
LLAMA31_8B_TINY = LLAMA31_8B.scaled()


# ----------------------------------------------------------------------- vocabulary maps


def make_draft_vocab(vocab: int, draft_vocab: int, *, seed: int,
                     shared_prefix: int | None = None,
                     shared_fraction: float = 0.8) -> tuple[int, ...]:
    """A draft vocabulary: ``draft_vocab`` sorted target ids out of ``vocab``.

    Two calls with different seeds behave like the Kimi-K2 and Kimi-K2.5 maps: the first
    ``shared_prefix`` ids (special and byte tokens) coincide, a fraction of about
    ``shared_fraction`` of the tokens is in both (6,250 of 32,000 K2 tokens are not in the
    K2.5 map: 0.80), and because each map is sorted, few other positions hold the same id
    (a fraction falling like 1/sqrt(draft_vocab): ~8% at 512 tokens, ~1% at 32,000; the
    real pair agrees at 252 of 32,000). Every map is drawn from one pool of "frequent" tokens that depends only on the
    sizes, so any two seeds share ``n*n/pool`` tokens on average.
    Deterministic: the same arguments give the same map on every run.

    >>> k2 = make_draft_vocab(4096, 512, seed=1)
    >>> len(k2), k2 == tuple(sorted(k2))
    (512, True)
    """
    if not 0 < draft_vocab <= vocab:
        raise UsageError(f"make_draft_vocab: draft_vocab={draft_vocab} must be in "
                         f"[1, vocab={vocab}]")
    prefix = max(4, draft_vocab // 128) if shared_prefix is None else shared_prefix
    prefix = min(prefix, draft_vocab)
    if prefix < 0:
        raise UsageError(f"make_draft_vocab: shared_prefix={shared_prefix} is negative")
    if not 0 < shared_fraction <= 1:
        raise UsageError(f"make_draft_vocab: shared_fraction={shared_fraction} must be in "
                         "(0, 1]")
    drawn = draft_vocab - prefix
    pool_size = min(vocab - prefix, round(drawn / shared_fraction))
    # String seeds go through SHA-512 in random.Random, so the draw does not depend on
    # PYTHONHASHSEED; the pool's seed leaves out `seed` so that every map shares it.
    pool = random.Random(f"pool:{vocab}:{draft_vocab}:{prefix}:{pool_size}").sample(
        range(prefix, vocab), pool_size)
    chosen = random.Random(f"map:{seed}").sample(sorted(pool), drawn)
    return tuple(range(prefix)) + tuple(sorted(chosen))


# ------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class BuiltCheckpoint:
    """What a builder wrote: where, with which dimensions and vocabulary map, which
    tensors (``shapes``/``dtypes`` use safetensors dtype names) and which files."""

    path: Path
    dims: DrafterDims
    target_ids: tuple[int, ...] | None
    keys: tuple[str, ...]
    shapes: Mapping[str, tuple[int, ...]]
    dtypes: Mapping[str, str]
    files: tuple[str, ...]


@dataclass(frozen=True)
class HeadlineStandins:
    """The three sources of the headline conversion, named as the rule file names them."""

    root: Path
    drafter: BuiltCheckpoint
    target_vocab: BuiltCheckpoint
    verifier: BuiltCheckpoint

    @property
    def k2_ids(self) -> tuple[int, ...]:
        assert self.drafter.target_ids is not None
        return self.drafter.target_ids

    @property
    def k25_ids(self) -> tuple[int, ...]:
        assert self.target_vocab.target_ids is not None
        return self.target_vocab.target_ids

    @property
    def sources(self) -> dict[str, str]:
        """``NAME -> path`` for ``--source NAME=LOC``."""
        return {"drafter": str(self.drafter.path),
                "target_vocab": str(self.target_vocab.path),
                "verifier": str(self.verifier.path)}


@dataclass(frozen=True)
class _Spec:
    key: str
    shape: tuple[int, ...]
    dtype: str  # torch-style name
    kind: Literal["linear", "norm", "packed", "shape"]
    #: for ``kind="shape"``: the logical shape of the packed weight it describes
    unpacked: tuple[int, ...] = ()


# ------------------------------------------------------------------------------ drafters


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
    config = (_native_config(dims, draft_vocab=True) if layout == "native" else
              _speculators_config(dims, verifier_name, tuple(verifier_architectures)))
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
                          _native_config(dims, draft_vocab=False), seed=seed, fmt=fmt,
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


def _drafter_specs(dims: DrafterDims, *, lm_rows: int, include_embed: bool) -> list[_Spec]:
    d, h = dims.dtype, dims.hidden
    specs = [
        _Spec("midlayer.self_attn.q_proj.weight", (dims.q_out, 2 * h), d, "linear"),
        _Spec("midlayer.self_attn.k_proj.weight", (dims.kv_out, 2 * h), d, "linear"),
        _Spec("midlayer.self_attn.v_proj.weight", (dims.kv_out, 2 * h), d, "linear"),
        _Spec("midlayer.self_attn.o_proj.weight", (h, dims.q_out), d, "linear"),
        _Spec("midlayer.mlp.gate_proj.weight", (dims.intermediate, h), d, "linear"),
        _Spec("midlayer.mlp.up_proj.weight", (dims.intermediate, h), d, "linear"),
        _Spec("midlayer.mlp.down_proj.weight", (h, dims.intermediate), d, "linear"),
        _Spec("midlayer.input_layernorm.weight", (h,), d, "norm"),
        _Spec("midlayer.hidden_norm.weight", (h,), d, "norm"),
        _Spec("midlayer.post_attention_layernorm.weight", (h,), d, "norm"),
        _Spec("fc.weight", (h, dims.fc_in), d, "linear"),
        _Spec("norm.weight", (h,), d, "norm"),
        _Spec("lm_head.weight", (lm_rows, h), d, "linear"),
    ]
    if include_embed:
        specs.append(_Spec("embed_tokens.weight", (dims.vocab, h), d, "linear"))
    return specs


def _check_target_ids(target_ids: Sequence[int], dims: DrafterDims) -> tuple[int, ...]:
    ids = tuple(int(t) for t in target_ids)
    if len(ids) != dims.draft_vocab:
        raise UsageError(f"target_ids: {len(ids)} ids given for draft_vocab="
                         f"{dims.draft_vocab}; pass make_draft_vocab(vocab, draft_vocab, ...)")
    if any(b <= a for a, b in zip(ids, ids[1:])) or not (0 <= ids[0] and ids[-1] < dims.vocab):
        raise UsageError(f"target_ids: must be strictly ascending ids in [0, {dims.vocab}) "
                         "as EAGLE and SpecForge write them; sort and deduplicate them")
    return ids


def _vocab_map_tensors(ids: tuple[int, ...], vocab: int,
                       encoding: str) -> dict[str, torch.Tensor]:
    import torch

    target = torch.tensor(ids, dtype=torch.int64)
    # d2t holds target_id - draft_index (EAGLE cnets.py); "absolute" mimics tools that
    # store the target id itself.
    d2t = target - torch.arange(len(ids)) if encoding == "offset" else target.clone()
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[target] = True
    return {"d2t": d2t, "t2d": t2d}


def _write_drafter(out: Path, dims: DrafterDims, ids: tuple[int, ...] | None,
                   specs: list[_Spec], extra: dict[str, torch.Tensor],
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

    tensors = {out_key(s.key): _values(s, seed) for s in specs}
    tensors.update(extra)
    omit = set(omit_keys)
    unknown = (omit | set(dtype_overrides)) - set(tensors)
    if unknown:
        raise UsageError(f"omit_keys/dtype_overrides: {quote_keys(unknown)} not in this "
                         f"drafter (keys: {quote_keys(tensors)})")
    for key, name in dtype_overrides.items():
        tensors[key] = tensors[key].to(_torch_dtype(name))
    tensors = {k: v for k, v in sorted(tensors.items()) if k not in omit}

    out.mkdir(parents=True, exist_ok=True)
    weights = "model.safetensors" if fmt == "safetensors" else "pytorch_model.bin"
    if fmt == "safetensors":
        _save_safetensors(tensors, out / weights)
    else:
        _save_pickle(tensors, out / weights)
    files = ["config.json", weights]
    _write_json(out / "config.json", config)
    if with_training_state:
        _save_pickle(_training_state(tensors, seed), out / "training_state.pt")
        files.append("training_state.pt")
    return _record(out, dims, ids, tensors, files)


def _training_state(tensors: Mapping[str, torch.Tensor], seed: int) -> dict[str, Any]:
    import torch

    # Optimizer moments for two parameters plus counters: a pickle that nothing in a
    # conversion may need, as in the AQ-MedAI repo.
    moments = {k: torch.zeros(tensors[k].shape, dtype=torch.float32)
               for k in ("fc.weight", "norm.weight") if k in tensors}
    return {"epoch": 2, "global_step": 1000 + seed, "optimizer": {"exp_avg": moments},
            "scheduler": {"last_epoch": 1000 + seed}}


# ----------------------------------------------------------------------------- verifier


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
        tensors = {s.key: _values(s, seed) for s in specs}
        _save_safetensors(tensors, out / name)
        for key, t in tensors.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
        shapes.update(_shapes(tensors))
        dtypes.update(_dtypes(tensors))
    _write_json(out / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    _write_json(out / "config.json", _kimi_k25_config(dims))
    return BuiltCheckpoint(path=out, dims=dims, target_ids=None,
                           keys=tuple(sorted(weight_map)), shapes=shapes, dtypes=dtypes,
                           files=tuple(sorted(["config.json", "model.safetensors.index.json",
                                               *names])))


def _verifier_groups(dims: DrafterDims) -> tuple[list[_Spec], list[list[_Spec]], list[_Spec]]:
    """(first shard, middle groups in order, last shard) of the stand-in verifier."""
    vh, d, lm = dims.verifier_hidden, dims.dtype, "language_model.model"
    inter = dims.intermediate
    vision = max(16, vh // 4)

    def layer(i: int) -> list[_Spec]:
        p = f"{lm}.layers.{i}"
        specs = [_Spec(f"{p}.input_layernorm.weight", (vh,), d, "norm"),
                 _Spec(f"{p}.self_attn.o_proj.weight", (vh, dims.q_out), d, "linear"),
                 _Spec(f"{p}.post_attention_layernorm.weight", (vh,), d, "norm")]
        if i == 0:  # DeepSeek-V3 keeps its first layer dense
            return specs + [_Spec(f"{p}.mlp.down_proj.weight", (vh, inter), d, "linear")]
        e = f"{p}.mlp.experts.0.down_proj"  # int4 experts: packed int32 + bf16 scales
        return specs + [_Spec(f"{e}.weight_packed", (vh, max(1, inter // 8)), "int32", "packed"),
                        _Spec(f"{e}.weight_scale", (vh, max(1, inter // 32)), d, "norm"),
                        _Spec(f"{e}.weight_shape", (2,), "int32", "shape", (vh, inter))]

    n = dims.verifier_layers
    first = [_Spec(f"{lm}.embed_tokens.weight", (dims.vocab, vh), d, "linear"), *layer(0)]
    middle = [layer(i) for i in range(1, n - 1)]
    middle.insert(len(middle) // 2, [
        _Spec("vision_tower.patch_embed.proj.weight", (vision, 3, 2, 2), d, "linear"),
        _Spec("vision_tower.encoder.blocks.0.wqkv.weight", (3 * vision, vision), d, "linear"),
        _Spec("mm_projector.proj.0.weight", (vh, 4 * vision), d, "linear"),
    ])
    last = [*(layer(n - 1) if n > 1 else []),
            _Spec(f"{lm}.norm.weight", (vh,), d, "norm"),
            _Spec("language_model.lm_head.weight", (dims.vocab, vh), d, "linear")]
    return first, middle, last


def _assign_shards(groups: tuple[list[_Spec], list[list[_Spec]], list[_Spec]],
                   num_shards: int) -> list[list[_Spec]]:
    first, middle, last = groups
    shards: list[list[_Spec]] = [[] for _ in range(num_shards)]
    shards[0].extend(first)
    inner = list(range(1, num_shards - 1)) or [0]
    for i, group in enumerate(middle):
        # contiguous runs of layers per shard, as save_pretrained writes them
        shards[inner[i * len(inner) // max(1, len(middle))]].extend(group)
    shards[-1].extend(last)
    return shards


def _kimi_k25_config(dims: DrafterDims) -> dict[str, Any]:
    text = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "kimi_k2",
        "hidden_size": dims.verifier_hidden,
        "intermediate_size": dims.intermediate,
        "num_hidden_layers": dims.verifier_layers,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads,
        "first_k_dense_replace": 1,
        "n_routed_experts": 1,
        "vocab_size": dims.vocab,
        "bos_token_id": dims.bos_token_id,
        "eos_token_id": dims.eos_token_id,
        "rms_norm_eps": dims.rms_norm_eps,
        "rope_theta": dims.rope_theta,
        "max_position_embeddings": dims.max_position_embeddings,
        "tie_word_embeddings": False,
        "torch_dtype": dims.dtype,
    }
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": {"model_type": "kimi_k25_vision", "patch_size": 14,
                          "hidden_size": max(16, dims.verifier_hidden // 4),
                          "num_hidden_layers": 1, "mm_projector_type": "patchmerger"},
        "media_placeholder_token_id": dims.vocab - 235,
        "tie_word_embeddings": False,
        "torch_dtype": dims.dtype,
    }


def build_llama_verifier(out_dir: str | Path, dims: DrafterDims = LLAMA31_8B_TINY, *,
                         seed: int = 0) -> BuiltCheckpoint:
    """What a drafter's consumer reads from a Llama-3.1 verifier
    (meta-llama/Llama-3.1-8B-Instruct): ``model.embed_tokens.weight``,
    ``model.norm.weight`` and ``lm_head.weight`` in one ``model.safetensors``, with the
    verifier's ``LlamaForCausalLM`` config.json (``verifier_layers`` layers, whose
    weights are left out: no drafter conversion or consumer reads them)."""
    vh, d = dims.verifier_hidden, dims.dtype
    specs = [_Spec("model.embed_tokens.weight", (dims.vocab, vh), d, "linear"),
             _Spec("model.norm.weight", (vh,), d, "norm"),
             _Spec("lm_head.weight", (dims.vocab, vh), d, "linear")]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {s.key: _values(s, seed) for s in specs}
    _save_safetensors(tensors, out / "model.safetensors")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **_llama_fields(dims),
              "hidden_size": vh, "num_hidden_layers": dims.verifier_layers,
              "torch_dtype": dims.dtype}
    _write_json(out / "config.json", config)
    return _record(out, dims, None, tensors, ["config.json", "model.safetensors"])


# ----------------------------------------------------------------------------- headline


def build_headline_standins(root: str | Path, *, dims: DrafterDims | None = None,
                            seed: int = 0) -> HeadlineStandins:
    """The three sources of ``rules/aqmedai_k2_to_k25.yaml`` under ``root``:
    ``Kimi-K2-Instruct-eagle3`` (K2 map, with ``training_state.pt``), ``Kimi-K25-eagle3``
    (another drafter carrying the K2.5 map) and ``Kimi-K2.5`` (the sharded verifier)."""
    dims = KIMI_K2_TINY if dims is None else dims
    if dims.verifier_hidden != dims.hidden:
        raise UsageError(f"build_headline_standins: verifier_hidden={dims.verifier_hidden} "
                         f"!= hidden={dims.hidden}; lm_head rows copied from the Kimi "
                         "verifier must have the drafter's width, keep them equal")
    root = Path(root)
    k2 = make_draft_vocab(dims.vocab, dims.draft_vocab, seed=_derive(seed, "k2-vocab"))
    k25 = make_draft_vocab(dims.vocab, dims.draft_vocab, seed=_derive(seed, "k25-vocab"))
    drafter = build_eagle3_drafter(root / "Kimi-K2-Instruct-eagle3", dims, k2,
                                   seed=_derive(seed, "k2-drafter"), with_training_state=True)
    target = build_eagle3_drafter(root / "Kimi-K25-eagle3", dims, k25,
                                  seed=_derive(seed, "k25-drafter"))
    verifier = build_kimi_k25_verifier(root / "Kimi-K2.5", dims,
                                       seed=_derive(seed, "k25-verifier"))
    return HeadlineStandins(root=root, drafter=drafter, target_vocab=target,
                            verifier=verifier)


# --------------------------------------------------------------------------------- config


def _native_config(dims: DrafterDims, *, draft_vocab: bool) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        **_llama_fields(dims),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(dims.aux_layers),
                         "use_aux_hidden_state": True},
        "initializer_range": 0.02,
        "torch_dtype": dims.dtype,
        "transformers_version": "4.53.2",
        "use_cache": True,
    }
    if draft_vocab:
        config["draft_vocab_size"] = dims.draft_vocab
    if dims.verifier_hidden != dims.hidden:
        config["target_hidden_size"] = dims.verifier_hidden
    return config


def _speculators_config(dims: DrafterDims, verifier_name: str,
                        verifier_architectures: tuple[str, ...]) -> dict[str, Any]:
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "draft_vocab_size": dims.draft_vocab,
        "norm_before_residual": False,
        "target_hidden_size": dims.verifier_hidden,
        "eagle_aux_hidden_state_layer_ids": list(dims.aux_layers),
        "dtype": dims.dtype,
        "transformer_layer_config": {"model_type": "llama", **_llama_fields(dims),
                                     "torch_dtype": dims.dtype},
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name,
                         "architectures": list(verifier_architectures)},
        },
    }


def _llama_fields(dims: DrafterDims) -> dict[str, Any]:
    return {
        "hidden_size": dims.hidden,
        "intermediate_size": dims.intermediate,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads,
        "head_dim": dims.head_dim,
        "num_hidden_layers": 1,
        "vocab_size": dims.vocab,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": dims.rms_norm_eps,
        "rope_theta": dims.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": dims.max_position_embeddings,
        "bos_token_id": dims.bos_token_id,
        "eos_token_id": dims.eos_token_id,
        "tie_word_embeddings": False,
    }


# ---------------------------------------------------------------------- values and files


def _derive(seed: int, label: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{label}".encode(),
                                          digest_size=8).digest(), "little") >> 1


def _torch_dtype(name: str) -> torch.dtype:
    from ckptxform.dtypes import torch_dtype

    if name not in USER_DTYPES:
        raise UsageError(f"dtype: {name!r} is not one of {', '.join(USER_DTYPES)}")
    return torch_dtype(USER_DTYPES[name])


def _values(spec: _Spec, seed: int) -> torch.Tensor:
    """Seeded values for one tensor: linear weights ~N(0, 0.02), norms and scales near 1,
    packed int4 words uniform, shape tensors the logical shape they describe."""
    import torch

    gen = torch.Generator().manual_seed(_derive(seed, spec.key))
    dtype = _torch_dtype(spec.dtype)
    if spec.kind == "shape":
        return torch.tensor(spec.unpacked, dtype=dtype)
    if spec.kind == "packed":
        return torch.randint(-(2**31), 2**31 - 1, spec.shape, generator=gen, dtype=dtype)
    values = torch.randn(spec.shape, generator=gen, dtype=torch.float32)
    if spec.kind == "norm":
        return (1.0 + 0.05 * values).to(dtype)
    return (0.02 * values).to(dtype)


def _save_safetensors(tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(dict(tensors), str(path), metadata={"format": "pt"})


def _save_pickle(obj: Any, path: Path) -> None:
    import torch

    # torch's zip writer derives the archive's serialization id from its content, so
    # equal objects give equal bytes (the determinism test guards this).
    torch.save(obj, path)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _shapes(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in tensors.items()}


def _dtypes(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    from ckptxform.dtypes import from_torch_dtype

    return {k: from_torch_dtype(v.dtype) for k, v in tensors.items()}


def _record(out: Path, dims: DrafterDims, ids: tuple[int, ...] | None,
            tensors: Mapping[str, torch.Tensor], files: list[str]) -> BuiltCheckpoint:
    return BuiltCheckpoint(path=out, dims=dims, target_ids=ids, keys=tuple(sorted(tensors)),
                           shapes=_shapes(tensors), dtypes=_dtypes(tensors),
                           files=tuple(sorted(files)))
