"""What the plan says about each output tensor and each source tensor.

An output tensor has a recipe: how its bytes are made. Recipes are data; the executor
keeps a registry from recipe type to the function that streams its bytes
(engine/execute.py), so adding a verb means adding a recipe and one function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ..dtypes import nbytes
from ..rules.model import MissingRows


@dataclass(frozen=True)
class CopyTensor:
    """The bytes of ``source``'s tensor ``key``, unchanged (a keep or a rename)."""

    source: str
    key: str


@dataclass(frozen=True)
class GatherRows:
    """Output row ``j`` is row ``rows[j]`` of ``source``'s ``key``; where ``rows[j]`` is -1
    the row is filled by ``fill`` for target token ``targets[j]``."""

    source: str
    key: str
    rows: tuple[int, ...]
    targets: tuple[int, ...]
    fill: MissingRows | None = None

    @property
    def rows_from_source(self) -> int:
        return len(self.rows) - self.rows.count(-1)

    @property
    def rows_filled(self) -> int:
        return len(self.rows) - self.rows_from_source


@dataclass(frozen=True)
class VocabField:
    """``d2t`` or ``t2d`` of a vocabulary map."""

    vocab: str
    field: Literal["d2t", "t2d"]
    encoding: Literal["offset", "absolute"] = "offset"


Recipe = CopyTensor | GatherRows | VocabField


@dataclass(frozen=True)
class OutputPlan:
    """One tensor of the output: its key, dtype, shape and how its bytes are made.

    ``input_dtype`` is the dtype the recipe produces; when it differs from ``dtype`` the
    executor casts (the only case, with numeric fills, that decodes values)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    recipe: Recipe
    input_dtype: str
    rule: str
    #: True when the tensor comes from the converted source (what require.loaded asks)
    loaded: bool

    @property
    def nbytes(self) -> int:
        return nbytes(self.dtype, self.shape)

    def origin(self) -> dict[str, Any]:
        """The ``from`` field of the audit's ``written`` record."""
        r = self.recipe
        if isinstance(r, CopyTensor):
            out: dict[str, Any] = {"source": r.source, "key": r.key}
        elif isinstance(r, GatherRows):
            out = {"source": r.source, "key": r.key, "rows_from_source": r.rows_from_source,
                   "rows_filled": r.rows_filled}
            if r.fill is not None and r.rows_filled:
                out["fill"] = (f"{r.fill.rows_of}:{r.fill.tensor}" if r.fill.init == "rows_of"
                               else r.fill.init)
        else:
            out = {"vocab": r.vocab, "field": r.field}
            if r.field == "d2t":
                out["encoding"] = r.encoding
        if self.dtype != self.input_dtype:
            out["cast_from"] = self.input_dtype
        return out


@dataclass(frozen=True)
class TensorRecord:
    """What happened to one tensor of a source file the run opened (an audit ``tensor`` event)."""

    source: str
    key: str
    action: str
    target: str | None
    shape: tuple[int, ...]
    dtype: str
    rule: str | None
    reason: str

    def to_event(self) -> dict[str, Any]:
        return {"event": "tensor", "source": self.source, "key": self.key, "action": self.action,
                "target": self.target, "shape": list(self.shape), "dtype": self.dtype,
                "rule": self.rule, "reason": self.reason}


@dataclass(frozen=True)
class SourceRecord:
    """Where a source came from, for the audit's ``run`` record."""

    name: str
    location: str
    revision: str | None
    commit: str | None

    fingerprint: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"location": self.location, "revision": self.revision, "commit": self.commit,
                "fingerprint": self.fingerprint}
