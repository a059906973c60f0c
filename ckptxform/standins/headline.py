"""The three sources of the headline conversion (``rules/aqmedai_k2_to_k25.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ckptxform.errors import UsageError
from ckptxform.standins.dims import KIMI_K2_TINY, DrafterDims
from ckptxform.standins.draft_vocab import make_draft_vocab
from ckptxform.standins.drafters import build_eagle3_drafter
from ckptxform.standins.tensors import BuiltCheckpoint, derive_seed
from ckptxform.standins.verifiers import build_kimi_k25_verifier

__all__ = ["HeadlineStandins", "build_headline_standins"]


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
    k2 = make_draft_vocab(dims.vocab, dims.draft_vocab, seed=derive_seed(seed, "k2-vocab"))
    k25 = make_draft_vocab(dims.vocab, dims.draft_vocab, seed=derive_seed(seed, "k25-vocab"))
    drafter = build_eagle3_drafter(root / "Kimi-K2-Instruct-eagle3", dims, k2,
                                   seed=derive_seed(seed, "k2-drafter"), with_training_state=True)
    target = build_eagle3_drafter(root / "Kimi-K25-eagle3", dims, k25,
                                  seed=derive_seed(seed, "k25-drafter"))
    verifier = build_kimi_k25_verifier(root / "Kimi-K2.5", dims,
                                       seed=derive_seed(seed, "k25-verifier"))
    return HeadlineStandins(root=root, drafter=drafter, target_vocab=target,
                            verifier=verifier)
