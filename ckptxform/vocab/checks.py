"""Checks of draft-vocabulary maps: every message says which draft index is wrong and why.

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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from ckptxform.errors import UsageError, VocabMapError

Encoding = Literal["offset", "absolute"]
_ENCODINGS: tuple[Encoding, ...] = ("offset", "absolute")
_FIRST_FEW = 5
_FIX_ENCODING = "'offset': target = index + d2t[index]; 'absolute': target = d2t[index]"


def checked_targets(where: str, d2t: Sequence[int], encoding: Encoding, vocab_size: int | None,
                    t2d: Sequence[bool] | bytes | None) -> tuple[list[int], int]:
    """The target ids of ``d2t`` declared ``encoding`` and the vocabulary size, once checked
    (see ``VocabMap.from_d2t``); ``where`` starts each message."""
    check_encoding(encoding)
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
    return targets, size


def check_ids(where: str, target_ids: Sequence[int], vocab_size: int) -> None:
    """Every id in ``[0, vocab_size)`` and listed once."""
    _check_sizes(where, len(target_ids), vocab_size)
    problem = _first_problem(target_ids, target_ids, "absolute", vocab_size, None)
    if problem is not None:
        raise VocabMapError(f"{where}: {problem.text}; fix: {problem.fix}")

@dataclass(frozen=True)
class _Problem:
    """The first thing wrong with one decoding, phrased for a message."""

    kind: Literal["range", "duplicate", "unmarked"]
    text: str
    fix: str


def where_prefix(name: str, origin: str) -> str:
    return f"vocab map {name!r} ({origin})" if origin else f"vocab map {name!r}"


def check_encoding(encoding: str) -> None:
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
    return list(map(operator.add, range(len(values)), values))


def _all_valid(targets: Sequence[int], upper: int, marked: bytes | None) -> bool:
    """Whether ``_first_problem`` would find nothing, at C speed (a 164k-entry map is
    checked on every plan; the explaining loop runs only when something is wrong)."""
    if not targets:
        return True
    if min(targets) < 0 or max(targets) >= upper or len(set(targets)) != len(targets):
        return False
    return marked is None or 0 not in map(marked.__getitem__, targets)


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
    if _all_valid(targets, upper, marked):
        return None
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
    # the ids t2d marks are exactly the targets: each valid, marked, and as many
    if len(flags) - flags.count(0) == len(targets) and _all_valid(targets, len(flags), flags):
        return
    problem = _first_problem(values, targets, encoding, len(flags), flags)
    marked = [t for t, flag in enumerate(flags) if flag]
    if sorted(other_targets) == marked:
        assert problem is not None  # sorted(targets) != marked leaves one
        evidence = f"all {len(values)} target ids agree with t2d"
        raise _wrong_encoding(where, encoding, problem, evidence)
    if problem is not None and problem.kind == "unmarked":
        # an unmarked id found first may hide a later target out of range or repeated
        problem = _first_problem(values, targets, encoding, len(flags), None)
    if problem is not None:
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
