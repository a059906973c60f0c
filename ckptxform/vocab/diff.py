"""``ckptxform vocab-diff A B``: compare two drafters' draft vocabularies.

Reads only the small ``d2t``/``t2d`` tensors (or a vocab-map file), so it works on Hub
repos as cheaply as on local files. The report is the one that would have caught the
founding bug: "252/32000 positions agree" means B's lm_head cannot be A's as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import SourceNotFoundError
from ..sources.resolve import open_location
from ..sources.vocab_files import load_vocab_file
from .maps import Alignment, Encoding, VocabMap, vocab_map_from_bytes

_MAP_FILES = (".json", ".pt", ".pth")


def read_vocab_map(location: str, *, name: str, encoding: Encoding = "offset",
                   d2t: str = "d2t", t2d: str | None = "t2d") -> VocabMap:
    """A drafter's vocab map from its ``d2t``/``t2d`` tensors, or from a vocab-map file."""
    if Path(location).is_file() and Path(location).suffix.lower() in _MAP_FILES:
        return load_vocab_file(location, name=name, encoding=encoding)
    with open_location(location, name=name) as ckpt:
        d2t_info = ckpt.tensors.get(d2t)
        if d2t_info is None:
            raise SourceNotFoundError(
                f"{location}: no {d2t!r} tensor; give a drafter with a draft vocabulary (d2t/t2d) "
                "or a vocab-map file (.json, .pt, .safetensors)", source=name, key=d2t)
        t2d_info = ckpt.tensors.get(t2d) if t2d else None
        return vocab_map_from_bytes(
            name, ckpt.read(d2t_info), d2t_info.dtype,
            ckpt.read(t2d_info) if t2d_info else None, t2d_info.dtype if t2d_info else None,
            encoding=encoding, origin=f"{location} tensor {d2t!r}")


@dataclass(frozen=True)
class VocabDiff:
    a: VocabMap
    b: VocabMap
    alignment: Alignment
    location_a: str
    location_b: str

    @property
    def verdict(self) -> str:
        al = self.alignment
        size_b = al.target_draft_size
        if al.positional_matches == size_b == al.source_draft_size:
            return "identical draft vocabularies: lm_head rows load as they are"
        if al.only_in_target == 0:
            return (f"same tokens in another order: lm_head rows must be permuted (permute_rows); "
                    f"loading them as they are misaligns {size_b - al.positional_matches:,} of {size_b:,} rows")
        return (f"different draft vocabularies: permute lm_head rows (permute_rows) and fill "
                f"{al.only_in_target:,} rows (missing_rows); loading them as they are misaligns "
                f"{size_b - al.positional_matches:,} of {size_b:,} rows")

    def text(self) -> str:
        al = self.alignment
        return "\n".join([
            f"A: {self.location_a} (draft vocabulary {self.a.draft_size:,} of {self.a.vocab_size:,})",
            f"B: {self.location_b} (draft vocabulary {self.b.draft_size:,} of {self.b.vocab_size:,})",
            al.summary(),
            f"lm_head rows of B that a permutation carries over from A: {al.shared:,}/{al.target_draft_size:,} "
            f"({al.carried_fraction:.1%})",
            f"verdict: {self.verdict}",
        ])

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.location_a, "b": self.location_b, **self.alignment.to_dict(),
                "vocab_size": self.a.vocab_size, "verdict": self.verdict}


def vocab_diff(location_a: str, location_b: str, *, encoding: Encoding = "offset") -> VocabDiff:
    """Compare the draft vocabularies at two locations (drafters or vocab-map files).

    >>> vocab_diff("k2-drafter", "k25-drafter").alignment.summary()   # doctest: +SKIP
    '252/32,000 positions agree; 25,750 tokens shared; 6,250 only in A; 6,250 only in B'
    """
    a = read_vocab_map(location_a, name="A", encoding=encoding)
    b = read_vocab_map(location_b, name="B", encoding=encoding)
    return VocabDiff(a, b, a.alignment_to(b), location_a, location_b)
