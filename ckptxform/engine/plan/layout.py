"""The output layout: every shard's header and every tensor's offset, fixed from the plan.

The plan knows each output tensor's key, dtype and shape before any byte is read, so the
files can be created at full size and each tensor written straight to its offset.

A tensor copied unchanged from a local file can be cloned rather than copied where the
filesystem shares extents (XFS with reflink, btrfs), but only where its bytes sit at the
same offset modulo the block size in both files. So such tensors (``copied_from``: their
source file and offset) go first in their shard, in source order, and the shard's header is
padded with spaces, as safetensors allows, until the data section lines up with the source
that gives the most bytes: tensors follow each other without gaps, so the tensors of one
source file, in its order, line up together.

Example::

    layout = plan_layout([OutputTensorSpec("w", "BF16", (4, 8))], max_shard_size=None)
    layout.placement("w").offset   # 96: after the 8-byte length and the padded header
"""

from __future__ import annotations

import heapq
import json
import sys
import zlib
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any, Protocol

from ckptxform.dtypes import DTYPE_SIZES, nbytes
from ckptxform.errors import OutputError, PlanError, UsageError

#: the safetensors library refuses headers larger than this
_MAX_HEADER_BYTES = 100_000_000
#: the block size extents are shared in (XFS and btrfs: the page size); a multiple of
#: every smaller one, so a line-up at 4 KiB is one at 1 or 2 KiB as well
CLONE_BLOCK = 4096

_DEFAULT_METADATA: Mapping[str, str] = MappingProxyType({"format": "pt"})


class TensorSpec(Protocol):
    """What the layout needs of an output tensor: an ``OutputTensorSpec``, or the plan's
    ``OutputPlan`` itself (a copy of its key, dtype and shape was 56 bytes a tensor)."""

    @property
    def key(self) -> str: ...

    @property
    def dtype(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def nbytes(self) -> int: ...


def check_spec(spec: TensorSpec) -> None:
    """A PlanError when ``spec`` cannot be a safetensors tensor (a reserved name, an
    unknown dtype, a negative dimension)."""
    if not spec.key or spec.key == "__metadata__":
        raise PlanError(f"output tensor name {spec.key!r} is reserved by safetensors; "
                        "rename it in the rule file", key=spec.key)
    if spec.dtype not in DTYPE_SIZES:
        raise PlanError(f"output tensor {spec.key!r}: unknown dtype {spec.dtype!r} "
                        f"(known: {', '.join(DTYPE_SIZES)})", key=spec.key)
    if any(not isinstance(d, int) or d < 0 for d in spec.shape):
        raise PlanError(f"output tensor {spec.key!r}: invalid shape {list(spec.shape)}; "
                        "dimensions must be non-negative integers", key=spec.key)


@dataclass(frozen=True, slots=True)  # one a tensor: no __dict__ each
class OutputTensorSpec:
    """One output tensor as the plan knows it before any byte is read."""

    key: str
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        check_spec(self)
        object.__setattr__(self, "shape", tuple(self.shape))

    @property
    def nbytes(self) -> int:
        return nbytes(self.dtype, self.shape)


@dataclass(frozen=True, slots=True)
class TensorPlacement:
    """Where one tensor's bytes go: ``offset`` is absolute in ``file``. Made when asked
    for (``ShardLayout.tensors``): a shard holds its tensors as columns."""

    spec: TensorSpec
    file: str
    offset: int

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes


#: where a tensor copied unchanged comes from: (source file, offset), or None
CopiedFrom = Callable[[TensorSpec], "tuple[str, int] | None"]


@dataclass(frozen=True)
class ShardLayout:
    """One output file: its complete header (8-byte length + padded JSON) and tensors;
    made by ``ShardLayout.of``.

    The tensors are columns: ``specs`` and, in their order, ``offsets`` (absolute, packed
    as ``array('Q')``): a ``TensorPlacement`` and its offset each were ~90 bytes a tensor
    kept to the commit, ~18 MB of a 200,000-tensor rename. ``tensors`` makes the
    placements when asked.

    The header is held compressed: ~75 bytes a tensor, kept for every shard from the layout
    to the commit, it was 15 MB of a 200,000-tensor rename's ~300 MB peak; it is asked for
    a few times a shard (written, hashed, checked on resume)."""

    file: str
    specs: tuple[TensorSpec, ...]
    offsets: bytes = field(repr=False)
    data_nbytes: int
    header_nbytes: int
    packed_header: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.offsets) != 8 * len(self.specs):
            raise ValueError(f"{len(self.offsets)} bytes of offsets for {len(self.specs)} tensors")

    @classmethod
    def of(cls, *, file: str, header: bytes, specs: Sequence[TensorSpec], offsets: Iterable[int],
           data_nbytes: int) -> ShardLayout:
        return cls(file, tuple(specs), array("Q", offsets).tobytes(), data_nbytes, len(header),
                   zlib.compress(header, 1))

    def offset(self, i: int) -> int:
        """Tensor ``i``'s (of ``specs``) absolute offset in the file."""
        return int.from_bytes(self.offsets[8 * i:8 * i + 8], sys.byteorder)

    @property
    def tensors(self) -> tuple[TensorPlacement, ...]:
        """Every tensor's placement, in data order (made on each call)."""
        offsets = array("Q", self.offsets)
        return tuple(TensorPlacement(spec, self.file, offset) for spec, offset in zip(self.specs, offsets, strict=True))

    @property
    def header(self) -> bytes:
        return zlib.decompress(self.packed_header)

    @property
    def file_nbytes(self) -> int:
        return self.header_nbytes + self.data_nbytes


@dataclass(frozen=True)
class OutputLayout:
    """Every output file and where each tensor lives in it. ``index_file`` is None when
    the output is a single file."""

    shards: tuple[ShardLayout, ...]
    index_file: str | None

    @cached_property
    def placements(self) -> Mapping[str, TensorPlacement]:
        """Every tensor, by key, in data order: made when first asked for (a shard's
        writer asks of its shard's layout; a run asks nothing by key of the whole layout,
        where the table was ~100 bytes a tensor)."""
        return MappingProxyType({p.spec.key: p for shard in self.shards for p in shard.tensors})

    def placement(self, key: str) -> TensorPlacement:
        try:
            return self.placements[key]
        except KeyError:
            raise OutputError(f"tensor {key!r} is not in the output layout "
                              f"(it has {sum(len(s.specs) for s in self.shards)} tensors)", key=key) from None

    @property
    def total_bytes(self) -> int:
        """Tensor data bytes of all shards (the index's ``total_size``)."""
        return sum(s.data_nbytes for s in self.shards)

    @property
    def file_bytes(self) -> int:
        """Bytes of all shard files, headers included."""
        return sum(s.file_nbytes for s in self.shards)

    def index_json(self) -> dict[str, Any]:
        """The standard ``model.safetensors.index.json`` content (also valid when unsharded)."""
        # the keys sorted, then each one's file: one dict, not a table by key and its sorted copy
        weight_map: dict[str, str] = dict.fromkeys(sorted(spec.key for shard in self.shards for spec in shard.specs))
        for shard in self.shards:
            for spec in shard.specs:
                weight_map[spec.key] = shard.file
        return {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}

    def index_text(self) -> Iterator[str]:
        """``json.dumps(self.index_json(), indent=2)``, a piece at a time: the keys merged
        from each shard's sorted ones (8 bytes a tensor), not a dict of every key (its
        ~50 bytes a tensor were the peak of a 1,000,000-tensor run's commit)."""
        yield f'{{\n  "metadata": {{\n    "total_size": {self.total_bytes}\n  }},\n  "weight_map": {{'
        separator = "\n    "
        for key, file in heapq.merge(*(_keyed_by_file(shard) for shard in self.shards)):
            yield f"{separator}{json.dumps(key)}: {json.dumps(file)}"
            separator = ",\n    "
        yield "}\n}" if separator == "\n    " else "\n  }\n}"


def _keyed_by_file(shard: ShardLayout) -> Iterator[tuple[str, str]]:
    """``shard``'s keys in order, each with its file."""
    file = shard.file
    for key in sorted(spec.key for spec in shard.specs):
        yield key, file


def plan_layout(
    specs: Sequence[TensorSpec],
    *,
    max_shard_size: int | None,
    file_name: str = "model.safetensors",
    metadata: Mapping[str, str] | None = _DEFAULT_METADATA,
    copied_from: Mapping[str, tuple[str, int]] | CopiedFrom | None = None,
) -> OutputLayout:
    """Lay out ``specs`` (kept in order) in shards of at most ``max_shard_size`` data bytes.

    ``copied_from``: key -> (source file, offset) of the tensors copied unchanged from one
    run of a local file (or a function of the spec giving it, or None: asked a shard at a
    time, so a run's answers are not all held at once); they lead their shard in source order, and its header is padded
    so that most of their bytes land at their source's offset modulo CLONE_BLOCK (see the
    module's docstring). Which tensors a shard holds does not depend on it.

    A tensor larger than the limit gets a shard of its own, as huggingface does. One shard
    is named ``file_name``; several are ``model-00001-of-00003.safetensors`` and an index.

    >>> layout = plan_layout([OutputTensorSpec("a", "F32", (4,))], max_shard_size=None)
    >>> layout.shards[0].file, layout.shards[0].tensors[0].offset
    ('model.safetensors', 96)
    """
    if max_shard_size is not None and max_shard_size <= 0:
        raise UsageError(f"max_shard_size must be positive, got {max_shard_size}")
    return layout_in_groups(_pack(specs, max_shard_size), file_name=file_name, metadata=metadata,
                            copied_from=copied_from)


def layout_in_groups(
    groups: Sequence[Sequence[TensorSpec]],
    *,
    file_name: str = "model.safetensors",
    metadata: Mapping[str, str] | None = _DEFAULT_METADATA,
    copied_from: Mapping[str, tuple[str, int]] | CopiedFrom | None = None,
) -> OutputLayout:
    """One shard a group (at least one group), named as ``plan_layout`` names them;
    ``copied_from`` as for ``plan_layout``."""
    if not file_name.endswith(".safetensors") or "/" in file_name or file_name == ".safetensors":
        raise UsageError(f"output file name {file_name!r} must be a plain name ending in "
                         "'.safetensors', e.g. 'model.safetensors'")
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str)
                                        for k, v in metadata.items()):
        raise UsageError("safetensors metadata must map strings to strings")
    seen: set[str] = set()
    for group in groups:
        for spec in group:
            if spec.key in seen:
                raise PlanError(f"output tensor {spec.key!r} is produced twice; "
                                "make the rules give each output a distinct name", key=spec.key)
            seen.add(spec.key)
    if len(groups) == 1:
        names = [file_name]
        index_file = None
    else:
        stem = file_name.removesuffix(".safetensors")
        names = [f"{stem}-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)]
        index_file = f"{file_name}.index.json"
    shards = tuple(shard_layout(name, *_source_order(group, copied_from), metadata)
                   for name, group in zip(names, groups, strict=True))
    return OutputLayout(shards=shards, index_file=index_file)


def _pack(specs: Sequence[TensorSpec], limit: int | None) -> list[list[TensorSpec]]:
    """Greedy, order-keeping packing; always at least one (possibly empty) group. A tensor
    over the limit lands alone: it starts a group, and the group is then over the limit."""
    groups: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if limit is not None and groups[-1] and size + spec.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += spec.nbytes
    return groups


def copies_of(group: Sequence[TensorSpec],
              copied_from: Mapping[str, tuple[str, int]] | CopiedFrom | None) -> list[tuple[str, int] | None]:
    """Where each of ``group`` is copied unchanged from (``copied_from`` as for ``plan_layout``)."""
    if copied_from is None:
        return [None] * len(group)
    if isinstance(copied_from, Mapping):
        return [copied_from.get(spec.key) for spec in group]
    return [copied_from(spec) for spec in group]


def _source_order(group: Sequence[TensorSpec], copied_from: Mapping[str, tuple[str, int]] | CopiedFrom | None
                  ) -> tuple[list[TensorSpec], list[tuple[str, int] | None]]:
    """The tensors copied unchanged first, in source file and offset order, then the rest
    in plan order; and where each is copied from."""
    copies = copies_of(group, copied_from)
    order = sorted(range(len(group)), key=lambda i: (1, "", 0) if copies[i] is None else (0, *copies[i]))
    return [group[i] for i in order], [copies[i] for i in order]


def _header_pad(text_len: int, group: list[TensorSpec], copies: list[tuple[str, int] | None]) -> int:
    """Spaces after a header of ``text_len`` JSON bytes: the least that starts the data
    8-aligned, as the library does, or, when tensors of ``group`` have phases, the pad that
    puts the most of their bytes at their source's offset modulo CLONE_BLOCK (ties: the smaller pad). Those
    tensors then have the alignment they have in their source file."""
    votes: dict[int, int] = {}
    start = 0
    for spec, source in zip(group, copies, strict=True):
        if source is not None and spec.nbytes >= 2 * CLONE_BLOCK:
            pad = (source[1] - 8 - text_len - start) % CLONE_BLOCK
            votes[pad] = votes.get(pad, 0) + spec.nbytes
        start += spec.nbytes
    return max(votes, key=lambda pad: (votes[pad], -pad)) if votes else -(8 + text_len) % 8


def _header_text(group: list[TensorSpec], metadata: Mapping[str, str] | None) -> tuple[bytes, int]:
    """``json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()`` of the
    header of ``group`` (and the data bytes), made an entry at a time: the whole header as
    a dict of dicts and lists was ~400 bytes a tensor held at once, the peak of laying out
    a shard of many small tensors."""
    def dumps(value: Any) -> str:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)

    parts = [] if metadata is None else [dumps("__metadata__") + ":" + dumps(dict(metadata))]
    start = 0
    for spec in group:
        parts.append(f'{dumps(spec.key)}:{{"dtype":{dumps(spec.dtype)},"shape":{dumps(list(spec.shape))},'
                     f'"data_offsets":[{start},{start + spec.nbytes}]}}')
        start += spec.nbytes
    return ("{" + ",".join(parts) + "}").encode(), start


def shard_layout(name: str, group: list[TensorSpec], copies: list[tuple[str, int] | None],
                 metadata: Mapping[str, str] | None) -> ShardLayout:
    """One output file of ``group``'s tensors, in that order, its header padded to line up
    the unchanged copies among them (``copies``: where each is copied from, ``copies_of``)
    with their source files."""
    # JSON keys follow data order (the safetensors library sorts by alignment instead;
    # readers do not care, and data order keeps the file in the plan's order).
    text, start = _header_text(group, metadata)
    text += b" " * _header_pad(len(text), group, copies)
    if len(text) > _MAX_HEADER_BYTES:
        raise PlanError(f"the header of {name!r} would be {len(text)} bytes, more than "
                        f"safetensors reads ({_MAX_HEADER_BYTES}); set a smaller max_shard_size")
    blob = len(text).to_bytes(8, "little") + text
    offsets, offset = array("Q"), len(blob)
    for spec in group:
        offsets.append(offset)
        offset += spec.nbytes
    return ShardLayout.of(file=name, header=blob, specs=group, offsets=offsets, data_nbytes=start)

