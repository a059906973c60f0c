"""Draft-vocabulary maps of EAGLE-3 drafters (``d2t`` / ``t2d``): decode, check, align.

A drafter scores a *draft vocabulary*, a subset of the verifier's vocabulary. ``d2t``
maps draft index ``i`` to a target token id, as an offset in EAGLE, SpecForge, SGLang,
vLLM and speculators (``target = i + d2t[i]``) and as the id itself in some third-party
tools (``target = d2t[i]``). ``t2d`` is True at every target id of the draft vocabulary.
A ``VocabMap`` holds the decoded absolute ids and is consistent by construction; an
``Alignment`` says which source row holds each target row's token, which is what
permuting ``lm_head`` rows needs.

Pure Python on purpose: plan-time code must not import torch (design.md), and decoding a
164k-entry map with ``array`` takes milliseconds. Reading a map from a standalone file
(``load_vocab_file``) lives in ``ckptxform.sources.vocab_files``.
The checks, and how a wrong declared encoding is caught, are in ``ckptxform.vocab.checks``.
"""

from __future__ import annotations

import itertools
import operator
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptxform.errors import VocabMapError
from ckptxform.vocab.checks import Encoding, check_encoding, check_ids, checked_targets, where_prefix

__all__ = ["Alignment", "Encoding", "VocabMap", "vocab_map_from_bytes"]

# safetensors integer dtype -> array typecode; both typecodes have these sizes on every
# platform CPython supports.
_INT_TYPECODES = {"I64": ("q", 8), "I32": ("i", 4)}
_FLAG_DTYPES = ("BOOL", "U8")


@dataclass(frozen=True)
class Alignment:
    """Where each draft index of map ``target`` finds its token in map ``source``.

    ``source_index[j]`` is the draft index of ``source`` holding the target token of
    draft index ``j`` of ``target``, or -1 when ``source`` lacks that token. Built by
    ``VocabMap.alignment_to``.
    """

    source: str
    target: str
    source_index: tuple[int, ...]
    source_draft_size: int
    positional_matches: int
    shared: int

    @property
    def target_draft_size(self) -> int:
        return len(self.source_index)

    @property
    def only_in_source(self) -> int:
        return self.source_draft_size - self.shared

    @property
    def only_in_target(self) -> int:
        return self.target_draft_size - self.shared

    @property
    def carried_fraction(self) -> float:
        """Share of the target's draft rows that the source can supply."""
        return self.shared / self.target_draft_size

    @property
    def missing_indices(self) -> tuple[int, ...]:
        """Target draft indices whose token the source lacks (rows to fill elsewhere)."""
        return tuple(j for j, i in enumerate(self.source_index) if i < 0)

    def summary(self) -> str:
        """One line for logs, e.g. ``252/32,000 positions agree; 25,750 tokens shared;
        6,250 only in k2; 6,250 only in k25``."""
        compared = min(self.source_draft_size, self.target_draft_size)
        return (
            f"{self.positional_matches:,}/{compared:,} positions agree; "
            f"{self.shared:,} tokens shared; {self.only_in_source:,} only in {self.source}; "
            f"{self.only_in_target:,} only in {self.target}"
        )

    def to_dict(self, *, include_index: bool = False) -> dict[str, Any]:
        """The statistics as JSON-ready values (``source_index`` only when asked: it has
        one entry per target draft index)."""
        out: dict[str, Any] = {
            "source": self.source,
            "target": self.target,
            "source_draft_size": self.source_draft_size,
            "target_draft_size": self.target_draft_size,
            "positional_matches": self.positional_matches,
            "shared": self.shared,
            "only_in_source": self.only_in_source,
            "only_in_target": self.only_in_target,
            "carried_fraction": self.carried_fraction,
        }
        if include_index:
            out["source_index"] = list(self.source_index)
        return out


@dataclass(frozen=True)
class VocabMap:
    """A draft vocabulary: ``target_ids[i]`` is the verifier token id of draft index ``i``.

    Construction checks that every id is in ``[0, vocab_size)`` and appears once; use
    ``VocabMap.from_d2t`` to decode and check a ``d2t``/``t2d`` pair.

    >>> m = VocabMap.from_d2t("k2", [0, 0, 3], encoding="offset", vocab_size=8)
    >>> m.target_ids, m.t2d_bytes()
    ((0, 1, 5), b'\\x01\\x01\\x00\\x00\\x00\\x01\\x00\\x00')
    """

    name: str
    target_ids: tuple[int, ...]
    vocab_size: int
    #: where the map came from, for messages ("source 'drafter' tensor 'd2t'"); two maps
    #: with the same ids are equal wherever they came from
    origin: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_ids", tuple(self.target_ids))
        where = where_prefix(self.name, self.origin)
        if not self.target_ids:
            raise VocabMapError(
                f"{where}: the draft vocabulary is empty; fix: give at least one target id"
            )
        check_ids(where, self.target_ids, self.vocab_size)

    @property
    def draft_size(self) -> int:
        return len(self.target_ids)

    def d2t_offsets(self) -> list[int]:
        """``d2t`` in the offset encoding: ``target_ids[i] - i``."""
        return [t - i for i, t in enumerate(self.target_ids)]

    def d2t_bytes(self, encoding: Encoding = "offset") -> bytes:
        """``d2t`` as little-endian int64, the data of a safetensors ``I64`` tensor."""
        check_encoding(encoding)
        values = array("q", self.d2t_offsets() if encoding == "offset" else self.target_ids)
        if sys.byteorder == "big":
            values.byteswap()
        return values.tobytes()

    def t2d_bytes(self) -> bytes:
        """``t2d`` as one 0/1 byte per target id, the data of a safetensors ``BOOL`` tensor."""
        flags = bytearray(self.vocab_size)
        for t in self.target_ids:
            flags[t] = 1
        return bytes(flags)

    def alignment_to(self, other: VocabMap) -> Alignment:
        """For each draft index of ``other``, the draft index of ``self`` with the same
        target token (-1 if none): the row order that turns ``self``'s ``lm_head`` into
        ``other``'s.

        >>> a = VocabMap("a", (0, 1, 5), 8); b = VocabMap("b", (0, 5, 6), 8)
        >>> a.alignment_to(b).source_index
        (0, 2, -1)
        """
        if self.vocab_size != other.vocab_size:
            raise VocabMapError(
                f"cannot align vocab map {self.name!r} (vocab_size {self.vocab_size}) with "
                f"{other.name!r} (vocab_size {other.vocab_size}): target ids of different "
                "vocabularies mean different tokens; fix: give both maps the verifier's "
                "vocabulary size, or compare drafters of the same verifier family"
            )
        position = dict(zip(self.target_ids, range(self.draft_size)))
        source_index = tuple(map(position.get, other.target_ids, itertools.repeat(-1)))
        return Alignment(
            source=self.name,
            target=other.name,
            source_index=source_index,
            source_draft_size=self.draft_size,
            positional_matches=sum(map(operator.eq, source_index, range(len(source_index)))),
            shared=len(source_index) - source_index.count(-1),
        )

    @classmethod
    def from_d2t(
        cls,
        name: str,
        d2t: Sequence[int],
        *,
        encoding: Encoding,
        vocab_size: int | None = None,
        t2d: Sequence[bool] | bytes | None = None,
        origin: str = "",
    ) -> VocabMap:
        """Decode and check a ``d2t`` (and ``t2d``) as stored in a checkpoint.

        ``vocab_size`` is ``len(t2d)`` when ``t2d`` is given (a different ``vocab_size``
        is an error), else ``vocab_size``, else the largest target id + 1. A declared
        ``encoding`` that the values contradict raises (see the module docstring).

        >>> m = VocabMap.from_d2t("k25", [0, 0, 3], encoding="offset", t2d=[1, 1, 0, 0, 0, 1])
        >>> m.target_ids
        (0, 1, 5)
        """
        targets, size = checked_targets(where_prefix(name, origin), d2t, encoding, vocab_size, t2d)
        return cls(name, tuple(targets), size, origin)


def vocab_map_from_bytes(
    name: str,
    d2t_raw: bytes | memoryview,
    d2t_dtype: str,
    t2d_raw: bytes | memoryview | None = None,
    t2d_dtype: str | None = None,
    *,
    encoding: Encoding,
    vocab_size: int | None = None,
    origin: str = "",
) -> VocabMap:
    """A ``VocabMap`` from the raw data of safetensors tensors: ``d2t`` ``I64`` or ``I32``,
    ``t2d`` ``BOOL`` or ``U8`` (little-endian, as the format stores them)."""
    where = where_prefix(name, origin)
    if d2t_dtype not in _INT_TYPECODES:
        raise VocabMapError(
            f"{where}: d2t has dtype {d2t_dtype!r}; fix: d2t must be an integer tensor "
            "('I64', or 'I32'): point the map at the drafter's d2t"
        )
    typecode, width = _INT_TYPECODES[d2t_dtype]
    if len(d2t_raw) % width:
        raise VocabMapError(
            f"{where}: d2t holds {len(d2t_raw)} bytes, not a multiple of {width} "
            f"({d2t_dtype}); fix: the file is truncated or its header lies: re-download it"
        )
    values = array(typecode)
    values.frombytes(bytes(d2t_raw))
    if sys.byteorder == "big":
        values.byteswap()
    if t2d_raw is not None and t2d_dtype not in _FLAG_DTYPES:
        raise VocabMapError(
            f"{where}: t2d has dtype {t2d_dtype!r}; fix: t2d must be 'BOOL' (or 'U8'), "
            "one flag per target id"
        )
    t2d = None if t2d_raw is None else bytes(t2d_raw)
    return VocabMap.from_d2t(
        name, values, encoding=encoding, vocab_size=vocab_size, t2d=t2d, origin=origin
    )
