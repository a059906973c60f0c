"""What the plan and the audit say of a vocabulary row permutation (ops/rows.py): where its
rows come from and which rows it reads. Plain data: the op's Context receives it, a recipe
keeps it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RowAccount:
    """Where the rows of a vocabulary row permutation come from: ``from_source`` rows of
    ``source``'s tensor, ``filled`` rows made by ``fill`` (its ``init``; ``label`` as the
    audit names it: ``zeros``, or ``SOURCE:KEY`` for rows_of)."""

    source: str
    from_source: int
    filled: int
    init: str | None
    label: str | None

    @property
    def total(self) -> int:
        return self.from_source + self.filled


@dataclass(frozen=True)
class RowsOrigin:
    """What the audit, the plan and a Hub prefetch say of a vocabulary row permutation:
    ``source``'s tensor ``key``, where its rows come from, and the rows it reads
    (``(source, key, rows)``: the source's rows taken, the rows_of tensor's rows; empty
    when the permutation reads another op's output)."""

    source: str
    key: str
    account: RowAccount
    reads: tuple[tuple[str, str, tuple[int, ...]], ...]

    def origin(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source, "key": self.key,
                               "rows_from_source": self.account.from_source, "rows_filled": self.account.filled}
        if self.account.label is not None:
            out["fill"] = self.account.label
        return out
