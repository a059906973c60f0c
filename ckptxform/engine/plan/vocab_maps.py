"""The rule file's ``vocab`` maps, read for a plan: from a source's ``d2t``/``t2d`` tensors
(the only tensor bytes a plan reads), from a standalone vocabulary file, or as the rows of
a full-vocabulary tensor; a ``vocab_size`` expression is evaluated over the source's config.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ...errors import PlanError
from ...rules.model import VocabSpec
from ...sources.base import Checkpoint, TensorInfo
from ...sources.pins import FilePin, pin_existing, pin_path
from ...sources.vocab_files import load_vocab_file
from ...vocab.maps import VocabMap, vocab_map_from_bytes
from .references import References

#: (source, key, what asks for it, the fix) -> the tensor's header entry, or a one-line error
TensorLookup = Callable[[str, str, str, "str | None"], TensorInfo]


@dataclass(frozen=True)
class VocabRead:
    """One vocabulary map and what was read to make it."""

    vmap: VocabMap
    #: the vocabulary file, as it stood when read (None for a map from a source)
    file: FilePin | None = None
    #: the source's d2t (and t2d), read as the map
    tensors: tuple[TensorInfo, ...] = ()


def read_vocab_map(name: str, spec: VocabSpec, ckpts: Mapping[str, Checkpoint], tensor: TensorLookup,
                   references: Callable[[str], References]) -> VocabRead:
    """Read vocabulary map ``name``; ``tensor`` looks up a source tensor (and notes its file
    as opened), ``references`` resolves ``${...}`` for a source."""
    where = f"vocab.{name} ({spec.where.short})"
    if spec.file is not None:
        assert spec.encoding is not None
        pin = pin_existing(spec.file)  # before reading: a later write must show
        vmap = load_vocab_file(spec.file, name=name, encoding=spec.encoding,
                               vocab_size=_vocab_size(spec, where, ckpts, references))
        return VocabRead(vmap, file=pin or pin_path(spec.file))
    assert spec.source is not None
    if spec.identity_rows_of is not None:
        info = tensor(spec.source, spec.identity_rows_of, where, None)
        return VocabRead(VocabMap(name, tuple(range(info.shape[0])), info.shape[0],
                                  origin=f"rows of {spec.source}:{spec.identity_rows_of}"))
    assert spec.encoding is not None
    ckpt = ckpts[spec.source]
    d2t = tensor(spec.source, spec.d2t, where, None)
    has_t2d = spec.t2d is not None and not (spec.t2d_optional and spec.t2d not in ckpt.tensors)
    t2d = tensor(spec.source, spec.t2d, where,
                 f"set vocab.{name}.t2d to its key, or t2d_optional: true (it is then derived "
                 "from d2t)") if has_t2d and spec.t2d else None
    vmap = vocab_map_from_bytes(
        name, ckpt.read(d2t), d2t.dtype, ckpt.read(t2d) if t2d else None,
        t2d.dtype if t2d else None, encoding=spec.encoding,
        vocab_size=_vocab_size(spec, where, ckpts, references),
        origin=f"source {spec.source!r} tensor {spec.d2t!r}")
    return VocabRead(vmap, tensors=(d2t, t2d) if t2d else (d2t,))


def _vocab_size(spec: VocabSpec, where: str, ckpts: Mapping[str, Checkpoint],
                references: Callable[[str], References]) -> int | None:
    """``vocab_size`` as written, or an expression over the source's config (``${config.PATH}``)."""
    if not isinstance(spec.vocab_size, str):
        return spec.vocab_size
    assert spec.source is not None
    value = references(spec.source).evaluate(spec.vocab_size, f"{where}: vocab_size")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{where}: vocab_size {spec.vocab_size}: the config of source {spec.source!r} "
                        f"({ckpts[spec.source].location}) has {value!r} there, not a positive integer; "
                        "give the size as an integer in the rule file", source=spec.source)
    return value
