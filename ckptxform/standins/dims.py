"""Dimensions of the model families the stand-ins imitate, full size and scaled down.

``DrafterDims`` describes an EAGLE-3 drafter and its verifier; ``KIMI_K2`` and
``LLAMA31_8B`` are the real drafters' dimensions, ``KIMI_K2_TINY`` and
``LLAMA31_8B_TINY`` the same architectures at test size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ckptxform.errors import UsageError, quote_keys

__all__ = ["KIMI_K2", "KIMI_K2_TINY", "LLAMA31_8B", "LLAMA31_8B_TINY", "DrafterDims"]

_FLOAT_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True, kw_only=True)
class DrafterDims:
    """The dimensions of an EAGLE-3 drafter and the verifier it drafts for.

    ``vocab`` is the verifier's vocabulary, ``draft_vocab`` the drafter's; ``aux_layers``
    are the verifier layers whose hidden states ``fc`` fuses (its input is
    ``len(aux_layers) * verifier_hidden`` wide). ``dtype`` is a torch-style name;
    ``model_type`` is what the native config.json says (SpecForge's Kimi-K2 drafter config
    says ``kimi_k2`` although its layer is a Llama layer).
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
    model_type: str = "llama"

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
    max_position_embeddings=131072, model_type="kimi_k2",
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
