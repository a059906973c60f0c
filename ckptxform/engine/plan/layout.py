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
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from json.encoder import encode_basestring  # type: ignore[attr-defined]
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
class MadeHeader:
    """A shard header made from its tensors: ``metadata``, each tensor's entry in data
    order, then ``pad`` spaces (``_header_pad``): remade when asked for, not held."""

    metadata: dict[str, str] | None
    pad: int


@dataclass(frozen=True, eq=False)
class SourceHeader:
    """A shard whose header is a source file's own bytes (engine/plan/layout_like.py): read
    again from the open source when asked for (a few times a shard), not held."""

    ckpt: Any
    file: str

    def read(self) -> bytes:
        return self.ckpt.raw_header(self.file)


@dataclass(frozen=True)
class ShardLayout:
    """One output file: which tensors it holds, in data order, its data and header sizes,
    and how its header is made.

    A shard holds no object a tensor: its tensors are ``ranks`` into ``items``, a sequence
    every shard of the layout shares (the plan's outputs, whose items may be made on
    access), and its header is remade from them (``made_from``: a ``MadeHeader``, a
    ``SourceHeader``, or the bytes themselves). ``specs``, ``offsets``, ``header`` and
    ``tensors`` are made on each call, one shard at a time: a tuple of specs, an offsets
    array and a compressed header a shard were 25 bytes a tensor held from the layout to
    the commit, and they kept every output plan alive. Offsets follow each other from the
    end of the header, unless ``fixed_offsets`` gives them (GGUF aligns each tensor)."""

    file: str
    items: Sequence[TensorSpec] = field(repr=False)
    ranks: range | array = field(repr=False)  # type: ignore[type-arg]
    data_nbytes: int
    header_nbytes: int
    made_from: bytes | MadeHeader | SourceHeader = field(repr=False)
    #: absolute offsets packed as ``array('Q')`` bytes, when not packed from the header on
    fixed_offsets: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.fixed_offsets is not None and len(self.fixed_offsets) != 8 * len(self.ranks):
            raise ValueError(f"{len(self.fixed_offsets)} bytes of offsets for {len(self.ranks)} tensors")

    @classmethod
    def of(cls, *, file: str, header: bytes, specs: Sequence[TensorSpec], offsets: Iterable[int],
           data_nbytes: int) -> ShardLayout:
        """A shard of its own ``specs`` at the given absolute ``offsets``, under ``header``."""
        specs = tuple(specs)
        return cls(file, specs, range(len(specs)), data_nbytes, len(header), header, array("Q", offsets).tobytes())

    def standalone(self, items: Sequence[TensorSpec] | None = None, *, header: bool = False) -> ShardLayout:
        """The same shard holding its own tensors (``items``: the same keys, dtypes and
        shapes in data order, e.g. the plan's outputs for a layout of copies; default
        ``specs``) and a header that needs no open source (what a task's plan carries),
        or, with ``header``, its bytes (what a task writing the shard asks for twice)."""
        own = tuple(self.specs if items is None else items)
        made = self.made_from
        if isinstance(made, SourceHeader) or header and isinstance(made, MadeHeader):
            made = ShardLayout(self.file, own, range(len(own)), self.data_nbytes, self.header_nbytes, made).header
        return ShardLayout(self.file, own, range(len(own)), self.data_nbytes, self.header_nbytes, made,
                           self.fixed_offsets)

    @property
    def count(self) -> int:
        """How many tensors the shard holds."""
        return len(self.ranks)

    @property
    def specs(self) -> tuple[TensorSpec, ...]:
        """The shard's tensors in data order (made on each call)."""
        ranks = self.ranks
        if type(ranks) is range and ranks.step == 1:
            return tuple(self.items[ranks.start:ranks.stop])
        return tuple(_picked(self.items, ranks))

    @property
    def light_specs(self) -> list[TensorSpec]:
        """Each tensor's key, dtype and shape in data order, without its recipe (made on each
        call, a batch of outputs read at a time): what its header and offsets need."""
        return _light_specs(self.items, self.ranks, None)[0]

    @property
    def offsets(self) -> array:  # type: ignore[type-arg]
        """Every tensor's absolute offset, in data order (``array('Q')``, made on each call)."""
        return self._offsets_of(None)

    def _offsets_of(self, specs: Sequence[TensorSpec] | None) -> array:  # type: ignore[type-arg]
        offsets = array("Q")
        if self.fixed_offsets is not None:
            offsets.frombytes(self.fixed_offsets)
            return offsets
        offset = self.header_nbytes
        for spec in self.light_specs if specs is None else specs:
            offsets.append(offset)
            offset += spec.nbytes
        return offsets

    def offset(self, i: int) -> int:
        """Tensor ``i``'s (of ``specs``) absolute offset in the file. The shard's offsets are
        kept once asked for (8 bytes a tensor): the commit's table of written tensors asks
        them in key order, across shards."""
        offsets = self.__dict__.get("_kept_offsets")
        if offsets is None:
            offsets = self.__dict__["_kept_offsets"] = self.offsets
        return int(offsets[i])

    @property
    def tensors(self) -> tuple[TensorPlacement, ...]:
        """Every tensor's placement, in data order (made on each call)."""
        specs = self.specs
        return tuple(TensorPlacement(spec, self.file, offset)
                     for spec, offset in zip(specs, self._offsets_of(specs), strict=True))

    @property
    def header(self) -> bytes:
        """The 8-byte length and the padded JSON header (made on each call)."""
        made = self.made_from
        if isinstance(made, bytes):
            return made
        if isinstance(made, SourceHeader):
            return made.read()
        text, _ = _header_text(self.light_specs, made.metadata)
        blob = (len(text) + made.pad).to_bytes(8, "little") + text + b" " * made.pad
        if len(blob) != self.header_nbytes:  # the layout's sizes were fixed from the same specs
            raise OutputError(f"internal error: the header of {self.file!r} is {len(blob)} bytes, laid out as "
                              f"{self.header_nbytes}", path=self.file)
        return blob

    @property
    def file_nbytes(self) -> int:
        return self.header_nbytes + self.data_nbytes


@dataclass(frozen=True)
class OutputLayout:
    """Every output file and where each tensor lives in it. ``index_file`` is None when
    the output is a single file."""

    shards: tuple[ShardLayout, ...]
    index_file: str | None
    #: the items every shard takes its tensors from, when they are in key order (a plan's
    #: outputs): the index walks them once instead of sorting each shard's keys
    keyed: Sequence[TensorSpec] | None = field(default=None, repr=False)

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
                              f"(it has {sum(s.count for s in self.shards)} tensors)", key=key) from None

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
        return {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(self.keys_with_files())}

    def keys_with_files(self) -> Iterator[tuple[str, str]]:
        """Every key in order, with its file: the ``keyed`` items walked once with the shard
        of each rank (2 bytes a tensor), else each shard's sorted keys merged."""
        if self.keyed is None or any(shard.items is not self.keyed for shard in self.shards):
            yield from heapq.merge(*(_keyed_by_file(shard) for shard in self.shards))
            return
        code = "H" if len(self.shards) < 1 << 16 else "I"
        owner = array(code, bytes(array(code).itemsize * len(self.keyed)))
        for number, shard in enumerate(self.shards):
            ranks = shard.ranks
            if type(ranks) is range and ranks.step == 1:
                owner[ranks.start:ranks.stop] = array(code, [number]) * len(ranks)
            else:
                for rank in ranks:
                    owner[rank] = number
        files = [shard.file for shard in self.shards]
        for rank, spec in enumerate(self.keyed):
            yield spec.key, files[owner[rank]]


def _keyed_by_file(shard: ShardLayout) -> Iterator[tuple[str, str]]:
    """``shard``'s keys in order, each with its file."""
    file = shard.file
    for key in sorted(spec.key for spec in shard.specs):
        yield key, file


class KeyScan:
    """Checks a layout's specs as they are walked once (``see``): each can be a safetensors
    tensor, and whether their keys come in strictly increasing order (a plan's outputs
    do); ``finish`` refuses a key given twice, with a table of keys only when they did not
    come in order."""

    def __init__(self) -> None:
        self._last: str | None = None
        self.in_order = True

    def see(self, spec: TensorSpec) -> None:
        check_spec(spec)
        key = spec.key
        if self.in_order and self._last is not None and key <= self._last:
            self.in_order = False
        self._last = key

    def finish(self, specs: Iterable[TensorSpec]) -> bool:
        """Whether the keys came in order (then each is there once); a PlanError for a key
        given twice otherwise."""
        if not self.in_order:
            seen: set[str] = set()
            for spec in specs:
                if spec.key in seen:
                    raise PlanError(f"output tensor {spec.key!r} is produced twice; "
                                    "make the rules give each output a distinct name", key=spec.key)
                seen.add(spec.key)
        return self.in_order


def compact_ranks(ranks: Sequence[int]) -> range | array:  # type: ignore[type-arg]
    """``ranks`` as a range when they are one contiguous increasing run (no byte a tensor),
    else ``array('I')`` (4 bytes a tensor)."""
    first = ranks[0] if ranks else 0
    if all(rank == first + i for i, rank in enumerate(ranks)):
        return range(first, first + len(ranks))
    return array("I", ranks)


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
    # Greedy, order-keeping packing; always at least one (possibly empty) group. A tensor
    # over the limit lands alone: it starts a group, and the group is then over the limit.
    scan, starts, size, count = KeyScan(), [0], 0, 0
    for rank, spec in enumerate(specs):
        scan.see(spec)
        nbytes = spec.nbytes
        if max_shard_size is not None and rank > starts[-1] and size + nbytes > max_shard_size:
            starts.append(rank)
            size = 0
        size += nbytes
        count = rank + 1
    groups = [range(a, b) for a, b in zip(starts, [*starts[1:], count], strict=True)]
    return layout_in_groups(specs, groups, in_order=scan.finish(specs), file_name=file_name, metadata=metadata,
                            copied_from=copied_from)


def layout_in_groups(
    items: Sequence[TensorSpec],
    groups: Sequence[range | array],  # type: ignore[type-arg]
    *,
    in_order: bool,
    file_name: str = "model.safetensors",
    metadata: Mapping[str, str] | None = _DEFAULT_METADATA,
    copied_from: Mapping[str, tuple[str, int]] | CopiedFrom | None = None,
) -> OutputLayout:
    """One shard a group of ranks into ``items`` (at least one group; together each rank
    once, their keys checked by a ``KeyScan``, which says whether they are ``in_order``),
    named as ``plan_layout`` names them; ``copied_from`` as for ``plan_layout``."""
    if not file_name.endswith(".safetensors") or "/" in file_name or file_name == ".safetensors":
        raise UsageError(f"output file name {file_name!r} must be a plain name ending in "
                         "'.safetensors', e.g. 'model.safetensors'")
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str)
                                        for k, v in metadata.items()):
        raise UsageError("safetensors metadata must map strings to strings")
    if len(groups) == 1:
        names = [file_name]
        index_file = None
    else:
        stem = file_name.removesuffix(".safetensors")
        names = [f"{stem}-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)]
        index_file = f"{file_name}.index.json"
    shards = tuple(made_shard(name, items, ranks, metadata, copied_from)
                   for name, ranks in zip(names, groups, strict=True))
    return OutputLayout(shards=shards, index_file=index_file, keyed=items if in_order else None)


def copies_of(group: Sequence[TensorSpec],
              copied_from: Mapping[str, tuple[str, int]] | CopiedFrom | None) -> list[tuple[str, int] | None]:
    """Where each of ``group`` is copied unchanged from (``copied_from`` as for ``plan_layout``)."""
    if copied_from is None:
        return [None] * len(group)
    if isinstance(copied_from, Mapping):
        return [copied_from.get(spec.key) for spec in group]
    return [copied_from(spec) for spec in group]


def made_shard(name: str, items: Sequence[TensorSpec], ranks: range | array,  # type: ignore[type-arg]
               metadata: Mapping[str, str] | None,
               copied_from: Mapping[str, tuple[str, int]] | CopiedFrom | None, *,
               copies_lead: bool = True) -> ShardLayout:
    """One output file of the tensors ``ranks`` of ``items``, in that order but for the
    unchanged copies among them, which lead in source file and offset order (unless not
    ``copies_lead``); its header padded to line those up with their source files
    (``_header_pad``)."""
    group, copies = _light_specs(items, ranks, copied_from)
    if copies_lead and any(c is not None for c in copies):
        order = sorted(range(len(group)), key=lambda i: (1, "", 0) if copies[i] is None else (0, *copies[i]))
        if order != list(range(len(group))):
            group, copies = [group[i] for i in order], [copies[i] for i in order]
            ranks = compact_ranks([ranks[i] for i in order])
    # JSON keys follow data order (the safetensors library sorts by alignment instead;
    # readers do not care, and data order keeps the file in the plan's order).
    text, data_nbytes = _header_text(group, metadata)
    pad = _header_pad(len(text), group, copies)
    if len(text) + pad > _MAX_HEADER_BYTES:
        raise PlanError(f"the header of {name!r} would be {len(text) + pad} bytes, more than "
                        f"safetensors reads ({_MAX_HEADER_BYTES}); set a smaller max_shard_size")
    return ShardLayout(name, items, ranks, data_nbytes, 8 + len(text) + pad,
                       MadeHeader(None if metadata is None else dict(metadata), pad))


#: outputs a shard's layout reads at a time
_SPECS_AT_ONCE = 4096


def _light_specs(items: Sequence[TensorSpec], ranks: range | array,  # type: ignore[type-arg]
                 copied_from: Mapping[str, tuple[str, int]] | CopiedFrom | None,
                 ) -> tuple[list[TensorSpec], list[tuple[str, int] | None]]:
    """The key, dtype and shape of each of ``ranks`` (an ``OutputTensorSpec``) and where it
    is copied unchanged from, read ``_SPECS_AT_ONCE`` at a time: a shard's outputs made at
    once with their recipes were ~5 KB a tensor for a dequant's (350 MB for the one shard of
    a Kimi-shaped INT4), where the layout needs ~130 bytes."""
    specs: list[TensorSpec] = []
    copies: list[tuple[str, int] | None] = []
    contiguous = type(ranks) is range and ranks.step == 1
    for start in range(0, len(ranks), _SPECS_AT_ONCE):
        part = ranks[start:start + _SPECS_AT_ONCE]
        made = items[part.start:part.stop] if contiguous else _picked(items, part)
        copies.extend(copies_of(made, copied_from))
        specs.extend(spec if type(spec) is OutputTensorSpec else OutputTensorSpec(spec.key, spec.dtype, spec.shape)
                     for spec in made)
    return specs, copies


def _picked(items: Sequence[TensorSpec], ranks: Sequence[int]) -> Sequence[TensorSpec]:
    picked = getattr(items, "picked", None)  # a plan's stored outputs: fetched in batches
    return picked(ranks) if picked is not None else [items[r] for r in ranks]


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


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _header_text(group: Sequence[TensorSpec], metadata: Mapping[str, str] | None) -> tuple[bytes, int]:
    """``json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()`` of the
    header of ``group`` (and the data bytes), made an entry at a time: the whole header as
    a dict of dicts and lists was ~400 bytes a tensor held at once, the peak of laying out
    a shard of many small tensors. Strings go through json's own escaping function
    (what ``json.dumps`` calls for a str), and a shape of ints is joined: a header is made
    a few times a run now, and three ``json.dumps`` calls a tensor were most of its cost."""
    parts = [] if metadata is None else [_dumps("__metadata__") + ":" + _dumps(dict(metadata))]
    start = 0
    for spec in group:
        shape, nbytes = spec.shape, spec.nbytes
        dims = ",".join(map(str, shape)) if all(type(d) is int for d in shape) else _dumps(list(shape))[1:-1]
        parts.append(f'{encode_basestring(spec.key)}:{{"dtype":{encode_basestring(spec.dtype)},"shape":[{dims}],'
                     f'"data_offsets":[{start},{start + nbytes}]}}')
        start += nbytes
    return ("{" + ",".join(parts) + "}").encode(), start
