"""``ckptxform diff A B``: what differs between two checkpoints, and a starting rule file.

Keys only in A, only in B, shape/dtype differences, the structural ops that explain some
of them (stack, concat, split, transpose: diff_structure.py), and the prefix renames that
map A's keys onto B's (``midlayer\\.(.+)`` -> ``layers.0.\\1``, or a prefix dropped), found
by pairing keys that end alike and have the same shape and dtype; then the values
(``values.py``): which tensors hold other bytes, and which tensors only in A are tensors
only in B under another name (the same bytes).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .structure import StructuralRule, infer_structure
from .values import ValueComparison, compare_values
from ..errors import quote
from ..sources.base import TensorInfo
from ..sources.resolve import open_location


@dataclass(frozen=True)
class Rename:
    prefix_a: str
    prefix_b: str
    keys: tuple[str, ...]

    @property
    def match(self) -> str:
        # '.' takes no newline: a key holding one (after the prefix) needs DOTALL to match
        rest = "((?s:.+))" if any("\n" in k[len(self.prefix_a):] for k in self.keys) else "(.+)"
        return re.escape(self.prefix_a) + rest

    @property
    def rename(self) -> str:
        return self.prefix_b + "\\1"


@dataclass(frozen=True)
class CheckpointDiff:
    location_a: str
    location_b: str
    only_a: tuple[str, ...]
    only_b: tuple[str, ...]
    changed: tuple[tuple[str, str, str], ...]  # key, A's "dtype shape", B's
    same: tuple[str, ...]
    renames: tuple[Rename, ...] = field(default=())
    structural: tuple[StructuralRule, ...] = field(default=())
    #: A has a config.json (a Meta checkpoint has params.json): the rule passes it on
    a_has_config: bool = True
    #: the digests' verdict; None: headers only (``--structure-only``)
    values: ValueComparison | None = None

    @property
    def renamed_by_digest(self) -> tuple[tuple[str, str], ...]:
        """(A's key, B's key): only in A, only in B, the same bytes, explained by no other rule."""
        return self.values.renamed if self.values is not None else ()

    @property
    def unexplained_a(self) -> list[str]:
        covered = ({k for r in self.renames for k in r.keys} | {k for s in self.structural for k in s.a_keys}
                   | {a for a, _ in self.renamed_by_digest})
        return [k for k in self.only_a if k not in covered]

    @property
    def unexplained_b(self) -> list[str]:
        produced = ({r.prefix_b + k[len(r.prefix_a):] for r in self.renames for k in r.keys}
                    | {k for s in self.structural for k in s.b_keys} | {b for _, b in self.renamed_by_digest})
        return [k for k in self.only_b if k not in produced]

    @property
    def differs(self) -> bool:
        """A and B hold other tensors: keys, shapes, dtypes or (values compared) bytes."""
        return bool(self.only_a or self.only_b or self.changed or (self.values is not None and self.values.differ))

    def text(self) -> str:
        """The report ``diff`` prints; every key quoted (``errors.quote``)."""
        values = self.values
        lines = [f"A: {quote(self.location_a)}", f"B: {quote(self.location_b)}"]
        if values is None:
            lines.append(f"{len(self.same)} keys in both with the same shape and dtype")
        else:
            other = [a for a, b in values.differ if a == b]
            lines.append(f"{len(self.same)} keys in both with the same shape and dtype: "
                         f"{len(self.same) - len(other)} hold the same bytes")
            lines.append(f"{len(other)} in both with the same shape and dtype but other bytes" + (":" if other else ""))
            lines.extend(f"  {quote(k)}" for k in other)
        for title, keys in (("only in A", self.only_a), ("only in B", self.only_b)):
            lines.append(f"{len(keys)} {title}" + (":" if keys else ""))
            lines.extend(f"  {quote(k)}" for k in keys)
        lines.append(f"{len(self.changed)} in both with another shape or dtype" + (":" if self.changed else ""))
        lines.extend(f"  {quote(k)}: A {a}, B {b}" for k, a, b in self.changed)
        for s in self.structural:
            lines.append(f"{'; '.join(s.ops)}: {quote(s.key)} -> {quote(s.to)} explains {len(s.a_keys)} keys of A, "
                         f"{len(s.b_keys)} of B")
        for r in self.renames:
            lines.append(f"rename {quote(r.match)} -> {quote(r.rename)} maps {len(r.keys)} keys of A onto B")
        if values is not None:
            lines.extend(f"renamed, other bytes: {quote(a)} -> {quote(b)}" for a, b in values.differ if a != b)
            lines.extend(f"renamed, same bytes: {quote(a)} -> {quote(b)}" for a, b in values.renamed)
            moved = sum(len(s.a_keys) for s in self.structural)
            if moved:
                lines.append(f"{moved} tensors of A that structural ops move: values not compared "
                             "(--emit-rules applies the ops and compares the result with B)")
            lines.append(f"digests ({values.algorithm}): A {values.sources[0]}; B {values.sources[1]}")
        lines.append(self.verdict())
        return "\n".join(lines)

    def verdict(self) -> str:
        if self.values is None:
            return ("headers differ" if self.differs else
                    "headers agree (values not compared: drop --structure-only to compare them)")
        if not self.differs:
            return "equal: the same keys, shapes, dtypes and bytes"
        return (f"different: {len(self.only_a)} only in A, {len(self.only_b)} only in B, {len(self.changed)} "
                f"with another shape or dtype, {len(self.values.differ)} with other bytes")

    def to_dict(self) -> dict[str, Any]:
        values = self.values
        return {"a": self.location_a, "b": self.location_b, "differ": self.differs, "same": list(self.same),
                "only_a": list(self.only_a), "only_b": list(self.only_b),
                "changed": [{"key": k, "a": a, "b": b} for k, a, b in self.changed],
                "renames": [{"match": r.match, "rename": r.rename, "keys": list(r.keys)} for r in self.renames],
                "structural": [{"key": s.key, "to": s.to, "ops": list(s.ops), "a_keys": list(s.a_keys),
                                "b_keys": list(s.b_keys)} for s in self.structural],
                "values": None if values is None else {
                    "digest": values.algorithm, "compared": values.compared,
                    "other_bytes": [{"a": a, "b": b} for a, b in values.differ],
                    "renamed_same_bytes": [{"a": a, "b": b} for a, b in values.renamed],
                    "digests_a": values.sources[0], "digests_b": values.sources[1],
                    "hashed_bytes": values.hashed_bytes}}


def _describe(info: TensorInfo) -> str:
    return f"{info.dtype} {list(info.shape)}"


def _suffix_split(key: str) -> list[tuple[str, str]]:
    """Every (prefix, suffix) split of ``key`` at a dot, longest suffix first."""
    parts = key.split(".")
    # i == 0: no prefix at all (A's 'model.norm.weight' is B's 'norm.weight')
    return [(".".join(parts[:i]) + "." if i else "", ".".join(parts[i:])) for i in range(len(parts))]


def find_renames(a: dict[str, TensorInfo], b: dict[str, TensorInfo]) -> list[Rename]:
    """Prefix renames mapping keys only in A onto keys only in B (same shape and dtype)."""
    remaining_a = set(a)
    remaining_b = set(b)
    found: list[Rename] = []
    by_suffix: dict[str, list[tuple[str, str]]] = {}
    for kb in b:
        for prefix_b, suffix in _suffix_split(kb):
            by_suffix.setdefault(suffix, []).append((prefix_b, kb))
    while True:
        votes: Counter[tuple[str, str]] = Counter()
        for ka in remaining_a:
            for prefix_a, suffix in _suffix_split(ka):
                for prefix_b, kb in by_suffix.get(suffix, ()):
                    if kb in remaining_b and _describe(a[ka]) == _describe(b[kb]):
                        votes[(prefix_a, prefix_b)] += 1
        best = max(votes.items(), key=lambda item: (item[1], len(item[0][0])), default=None)
        if best is None or best[1] < 2:
            return found
        prefix_a, prefix_b = best[0]
        keys = sorted(k for k in remaining_a if k.startswith(prefix_a)
                      and prefix_b + k[len(prefix_a):] in remaining_b)
        if not keys:
            return found
        found.append(Rename(prefix_a, prefix_b, tuple(keys)))
        remaining_a -= set(keys)
        remaining_b -= {prefix_b + k[len(prefix_a):] for k in keys}


def checkpoint_diff(location_a: str, location_b: str, *, values: bool = True, use_audits: bool = True,
                    jobs: int | None = None) -> CheckpointDiff:
    """Compare two checkpoints: headers, then (``values``) the bytes of every tensor the
    headers pair, by digest (``values.compare_values``: from a trusted audit unless not
    ``use_audits``, else hashed on ``jobs`` threads)."""
    with open_location(location_a, name="A") as ca, open_location(location_b, name="B") as cb:
        a, b = dict(ca.tensors), dict(cb.tensors)
        a_has_config = ca.config() is not None
        common = sorted(set(a) & set(b))
        only_a = sorted(set(a) - set(b))
        only_b = sorted(set(b) - set(a))
        changed = tuple((k, _describe(a[k]), _describe(b[k])) for k in common
                        if _describe(a[k]) != _describe(b[k]))
        same = tuple(k for k in common if _describe(a[k]) == _describe(b[k]))
        moved = set(only_a) | {k for k, _, _ in changed}
        structural = infer_structure({k: a[k] for k in sorted(moved)},
                                     {k: b[k] for k in sorted(set(only_b) | {k for k, _, _ in changed})})
        explained_a = {k for s in structural for k in s.a_keys}
        explained_b = {k for s in structural for k in s.b_keys}
        renames = find_renames({k: a[k] for k in only_a if k not in explained_a},
                               {k: b[k] for k in only_b if k not in explained_b})
        comparison = None
        if values:
            renamed = [(k, r.prefix_b + k[len(r.prefix_a):]) for r in renames for k in r.keys]
            explained_a |= {x for x, _ in renamed}
            explained_b |= {y for _, y in renamed}
            left_a = [k for k in only_a if k not in explained_a]
            left_b = [k for k in only_b if k not in explained_b]
            comparison = compare_values(ca, cb, [(k, k) for k in same] + renamed, left_a, left_b,
                                        use_audits=use_audits, jobs=jobs)
    return CheckpointDiff(location_a, location_b, tuple(only_a), tuple(only_b), changed, same, tuple(renames),
                          tuple(structural), a_has_config, comparison)
