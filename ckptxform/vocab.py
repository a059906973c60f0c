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

How a wrong declared encoding is caught
---------------------------------------
EAGLE/SpecForge maps list target ids in ascending order. Their offset ``d2t`` is then
non-decreasing from ``d2t[0] = target[0]`` and repeats a value wherever two consecutive
target ids are adjacent (the leading special and byte tokens always are): read as
absolute ids, those repeats are duplicates. An absolute ``d2t`` is strictly increasing up
to ``vocab - 1``: read as offsets, its tail lands past the vocabulary. Hence:

1. With ``t2d``, at most one decoding agrees with it (both only for a 1-entry map, where
   the two decodings coincide). If only the undeclared one agrees, the declaration is wrong.
2. Without ``t2d``, a decoding is *plausible* when its ids are in ``[0, vocab)``,
   distinct and ascending. If the declared one has an id out of range or twice and the
   other is plausible, the declaration is wrong. (Sortedness of the declared decoding
   need not be checked: offsets and absolute ids of one ``d2t`` rise and fall together,
   so a valid but unsorted declared decoding never has a plausible other one.)
3. Both plausible means ``d2t`` is strictly increasing (no two draft tokens adjacent in
   the target vocabulary) and, as offsets, still inside the vocabulary: the values cannot
   tell, and the declaration stands. ``t2d`` or ``vocab_size`` settles such maps; without
   either, an absolute ``d2t`` declared ``offset`` goes unnoticed, so pass the verifier's
   ``vocab_size`` whenever it is known.
4. Otherwise the declared decoding's own first problem is reported; a valid map that is
   merely unsorted is accepted, since nothing requires third-party maps to be sorted.
"""

from __future__ import annotations

import itertools
import operator
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ckptxform.errors import UsageError, VocabMapError

__all__ = ["Alignment", "Encoding", "VocabMap", "vocab_map_from_bytes"]

Encoding = Literal["offset", "absolute"]
_ENCODINGS: tuple[Encoding, ...] = ("offset", "absolute")
# safetensors integer dtype -> array typecode; both typecodes have these sizes on every
# platform CPython supports.
_INT_TYPECODES = {"I64": ("q", 8), "I32": ("i", 4)}
_FLAG_DTYPES = ("BOOL", "U8")
_FIRST_FEW = 5
_FIX_ENCODING = "'offset': target = index + d2t[index]; 'absolute': target = d2t[index]"


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
        where = _prefix(self.name, self.origin)
        if not self.target_ids:
            raise VocabMapError(
                f"{where}: the draft vocabulary is empty; fix: give at least one target id"
            )
        _check_sizes(where, len(self.target_ids), self.vocab_size)
        problem = _first_problem(
            self.target_ids, self.target_ids, "absolute", self.vocab_size, None
        )
        if problem is not None:
            raise VocabMapError(f"{where}: {problem.text}; fix: {problem.fix}")

    @property
    def draft_size(self) -> int:
        return len(self.target_ids)

    def d2t_offsets(self) -> list[int]:
        """``d2t`` in the offset encoding: ``target_ids[i] - i``."""
        return [t - i for i, t in enumerate(self.target_ids)]

    def d2t_bytes(self, encoding: Encoding = "offset") -> bytes:
        """``d2t`` as little-endian int64, the data of a safetensors ``I64`` tensor."""
        _check_encoding(encoding)
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
        position = {t: i for i, t in enumerate(self.target_ids)}
        source_index = tuple(position.get(t, -1) for t in other.target_ids)
        return Alignment(
            source=self.name,
            target=other.name,
            source_index=source_index,
            source_draft_size=self.draft_size,
            positional_matches=sum(1 for j, i in enumerate(source_index) if i == j),
            shared=sum(1 for i in source_index if i >= 0),
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
        _check_encoding(encoding)
        where = _prefix(name, origin)
        values = _as_ints(d2t, where)
        flags = None if t2d is None else _as_flags(t2d, where)
        if flags is not None:
            if vocab_size is not None and len(flags) != vocab_size:
                raise VocabMapError(
                    f"{where}: t2d has {len(flags)} entries but vocab_size is {vocab_size}; "
                    "fix: t2d is indexed by target id, so both must be the verifier's "
                    "vocabulary size: correct vocab_size or use this map's own t2d"
                )
            vocab_size = len(flags)
        if not values:
            raise VocabMapError(
                f"{where}: d2t is empty; fix: point the map at the drafter's d2t tensor "
                "(shape [draft_vocab])"
            )
        _check_sizes(where, len(values), vocab_size)
        targets = _decode(values, encoding)
        other: Encoding = "absolute" if encoding == "offset" else "offset"
        other_targets = _decode(values, other)
        if flags is not None:
            _check_against_t2d(where, values, targets, other_targets, encoding, flags)
        else:
            _check_without_t2d(where, values, targets, other_targets, encoding, vocab_size)
        size = max(targets) + 1 if vocab_size is None else vocab_size
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
    where = _prefix(name, origin)
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


# ---------------------------------------------------------------- checks


@dataclass(frozen=True)
class _Problem:
    """The first thing wrong with one decoding, phrased for a message."""

    kind: Literal["range", "duplicate", "unmarked"]
    text: str
    fix: str


def _prefix(name: str, origin: str) -> str:
    return f"vocab map {name!r} ({origin})" if origin else f"vocab map {name!r}"


def _check_encoding(encoding: str) -> None:
    if encoding not in _ENCODINGS:
        raise UsageError(f"unknown d2t encoding {encoding!r}; fix: use 'offset' or 'absolute'")


def _check_sizes(where: str, draft_size: int, vocab_size: int | None) -> None:
    if vocab_size is not None and draft_size > vocab_size:
        raise VocabMapError(
            f"{where}: the draft vocabulary has {draft_size} entries but the target "
            f"vocabulary only {vocab_size}; fix: a draft vocabulary is a subset of the "
            "verifier's: check vocab_size (and that t2d belongs to this map)"
        )


def _decode(values: Sequence[int], encoding: Encoding) -> list[int]:
    if encoding == "absolute":
        return list(values)
    return [i + v for i, v in enumerate(values)]


def _first_problem(
    values: Sequence[int],
    targets: Sequence[int],
    encoding: Encoding,
    vocab_size: int | None,
    marked: bytes | None,
) -> _Problem | None:
    """The first draft index whose target is out of range, a duplicate, or unmarked in
    ``marked`` (a t2d)."""
    upper = sys.maxsize if vocab_size is None else vocab_size
    seen: dict[int, int] = {}
    for i, t in enumerate(targets):
        if 0 <= t < upper and t not in seen and (marked is None or marked[t]):
            seen[t] = i
            continue
        if not 0 <= t < upper:
            bound = "a negative id" if vocab_size is None else f"outside [0, {vocab_size})"
            return _Problem(
                "range",
                f"{_maps(i, t, values, encoding)}, {bound}",
                "set vocab_size to the verifier's vocabulary size or correct the encoding "
                f"({_FIX_ENCODING})",
            )
        if t in seen:
            j = seen[t]
            return _Problem(
                "duplicate",
                f"draft indices {j} and {i} both map to target id {t} (d2t[{j}] = "
                f"{values[j]}, d2t[{i}] = {values[i]}, encoding {encoding!r})",
                "a draft vocabulary lists each target token once: rebuild d2t or correct "
                "the encoding",
            )
        return _Problem(
            "unmarked",
            f"{_maps(i, t, values, encoding)}, which t2d does not mark",
            "take d2t and t2d from the same checkpoint",
        )
    return None


def _maps(i: int, t: int, values: Sequence[int], encoding: Encoding) -> str:
    return f"draft index {i} maps to target id {t} (d2t[{i}] = {values[i]}, encoding {encoding!r})"


def _wrong_encoding(
    where: str, declared: Encoding, problem: _Problem, evidence: str
) -> VocabMapError:
    actual = "absolute" if declared == "offset" else "offset"
    return VocabMapError(
        f"{where}: declared {declared!r} but the values decode consistently as {actual!r}: "
        f"read as {declared!r}, {problem.text}, while read as {actual!r} {evidence}; "
        f"fix: set encoding: {actual}"
    )


def _check_against_t2d(
    where: str,
    values: Sequence[int],
    targets: list[int],
    other_targets: list[int],
    encoding: Encoding,
    flags: bytes,
) -> None:
    marked = [t for t, flag in enumerate(flags) if flag]
    if sorted(targets) == marked:
        return
    problem = _first_problem(values, targets, encoding, len(flags), flags)
    if sorted(other_targets) == marked:
        assert problem is not None  # sorted(targets) != marked leaves one
        evidence = f"all {len(values)} target ids agree with t2d"
        raise _wrong_encoding(where, encoding, problem, evidence)
    if problem is not None and problem.kind != "unmarked":
        raise VocabMapError(f"{where}: {problem.text}; fix: {problem.fix}")
    # Every target is distinct and in range: some are unmarked, or t2d marks extra ids.
    mapped = set(targets)
    extra = [t for t in marked if t not in mapped]
    unmarked = [(i, t) for i, t in enumerate(targets) if not flags[t]]
    parts = []
    if extra:
        shown = ", ".join(str(t) for t in extra[:_FIRST_FEW])
        parts.append(f"t2d marks {len(extra)} that d2t does not map to (first: {shown})")
    if unmarked:
        shown = ", ".join(f"{t} at draft index {i}" for i, t in unmarked[:_FIRST_FEW])
        parts.append(f"d2t maps {len(unmarked)} that t2d does not mark (first: {shown})")
    raise VocabMapError(
        f"{where}: t2d disagrees with d2t (encoding {encoding!r}) on "
        f"{len(extra) + len(unmarked)} target ids: {' and '.join(parts)}; fix: take d2t "
        "and t2d from the same checkpoint, or drop t2d and let it be rebuilt from d2t"
    )


def _check_without_t2d(
    where: str,
    values: Sequence[int],
    targets: list[int],
    other_targets: list[int],
    encoding: Encoding,
    vocab_size: int | None,
) -> None:
    problem = _first_problem(values, targets, encoding, vocab_size, None)
    if problem is None:
        return
    other: Encoding = "absolute" if encoding == "offset" else "offset"
    if (
        _is_ascending(other_targets)
        and _first_problem(values, other_targets, other, vocab_size, None) is None
    ):
        bound = "" if vocab_size is None else f" in [0, {vocab_size})"
        evidence = f"they are {len(values)} distinct ascending target ids{bound}"
        raise _wrong_encoding(where, encoding, problem, evidence)
    raise VocabMapError(f"{where}: {problem.text}; fix: {problem.fix}")


def _is_ascending(targets: Sequence[int]) -> bool:
    return all(a < b for a, b in itertools.pairwise(targets))


# ---------------------------------------------------------------- value coercion


def _as_ints(d2t: Sequence[int], where: str) -> list[int]:
    try:
        return list(map(operator.index, d2t))
    except TypeError:
        pass
    if isinstance(d2t, Iterable):
        for i, v in enumerate(d2t):
            if not hasattr(v, "__index__"):
                raise VocabMapError(
                    f"{where}: d2t[{i}] is {v!r}, not an integer; fix: d2t must be an "
                    "integer tensor (int64)"
                )
    raise VocabMapError(
        f"{where}: d2t is of type {type(d2t).__name__!r}, not a sequence of integers; "
        "fix: d2t must be an integer tensor (int64)"
    )


def _as_flags(t2d: Sequence[bool] | bytes, where: str) -> bytes:
    if isinstance(t2d, (bytes, bytearray, memoryview)):
        flags = bytes(t2d)
        if not flags.translate(None, b"\x00\x01"):
            return flags
        i = next(i for i, v in enumerate(flags) if v > 1)
        value: object = flags[i]
    elif isinstance(t2d, Iterable):
        items = list(t2d)
        bad = next((i for i, v in enumerate(items) if not _is_flag(v)), None)
        if bad is None:
            return bytes(map(int, items))
        i, value = bad, items[bad]
    else:
        raise VocabMapError(
            f"{where}: t2d is of type {type(t2d).__name__!r}, not a sequence of flags; fix: t2d "
            "must be a bool tensor with one entry per target id"
        )
    raise VocabMapError(
        f"{where}: t2d[{i}] is {value!r}, not a flag (0/1, False/True); fix: t2d must "
        "be a bool tensor with one entry per target id"
    )


def _is_flag(v: object) -> bool:
    return isinstance(v, int) and v in (0, 1)
