"""The output laid out as a source's files (``output: {shards: {like: SOURCE}}``).

A graft that replaces one layer of a 160 GB verifier should rewrite the shard that holds
that layer, not re-shard the whole model: so each output tensor goes into the file that
holds the source's tensor of the same key, in that file's order, under the source's file
names and index name. An output key the source has no tensor of goes into the source's
last file, after its tensors (in plan order). A source file no output tensor goes into
is not written.

A file whose output tensors are the source file's own list (same keys, dtypes and shapes,
in the same order, its data packed without gaps) gets the source file's header bytes as
they are: every tensor then sits at its source offset, so a file all of whose tensors are
copied unchanged comes out byte-identical to the source file (copied in the kernel,
cloned where the filesystem shares extents: engine/run/kernel_copy.py), and one whose
tensors changed only in value differs only in those bytes. Any other file gets a new
header (the source file's ``__metadata__``), its tensors still in source order.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Mapping, Sequence

from ...errors import PlanError
from ...sources.base import Checkpoint, TensorInfo
from .layout import (
    CopiedFrom,
    KeyScan,
    OutputLayout,
    ShardLayout,
    SourceHeader,
    TensorSpec,
    compact_ranks,
    made_shard,
)

#: where the index of a sharded output goes (what transformers looks for)
INDEX_FILE = "model.safetensors.index.json"


def plan_layout_like(specs: Sequence[TensorSpec], *, source: str, ckpt: Checkpoint,
                     copied_from: Mapping[str, tuple[str, int]] | CopiedFrom | None = None) -> OutputLayout:
    """Lay out ``specs`` in the files of ``ckpt`` (source ``source`` of the rule file): see
    the module's docstring. ``copied_from`` as for ``plan_layout`` (a new header lines its
    unchanged copies up for cloning). Each shard holds the ranks of its ``specs`` (4 bytes
    a tensor), not the specs; the source's files are listed one at a time.

    >>> layout = plan_layout_like(specs, source="verifier", ckpt=verifier)   # doctest: +SKIP
    >>> layout.index_json()["weight_map"] == verifier_index["weight_map"]    # doctest: +SKIP
    True
    """
    files = list(ckpt.files)
    if not files or not all(f.endswith(".safetensors") for f in files):
        raise PlanError(f"output.shards.like: source {source!r} ({ckpt.location}) is not a safetensors checkpoint; "
                        "lay the output out like a safetensors source, or use output.max_shard_size")
    number = {file: n for n, file in enumerate(files)}
    last = len(files) - 1
    scan = KeyScan()
    groups: dict[int, array] = {}  # type: ignore[type-arg]
    for rank, spec in enumerate(specs):
        scan.see(spec)
        info = ckpt.tensors.get(spec.key)
        n = last if info is None else number.get(info.file, last)  # a new key: the last file
        groups.setdefault(n, array("I")).append(rank)
    in_order = scan.finish(specs)
    shards = tuple(_shard_like(files[n], specs, groups[n], ckpt, copied_from) for n in sorted(groups))
    return OutputLayout(shards=shards, index_file=INDEX_FILE if len(files) > 1 else None,
                        keyed=specs if in_order else None)


def _shard_like(file: str, items: Sequence[TensorSpec], ranks: array, ckpt: Checkpoint,  # type: ignore[type-arg]
                copied_from: Mapping[str, tuple[str, int]] | CopiedFrom | None) -> ShardLayout:
    """``file`` of the output, of the tensors ``ranks`` of ``items`` in the source file's
    order (a key it does not have after its own, in plan order): the source file's header
    when they are its tensor list, else a new one."""
    theirs = ckpt.tensors_of_file(file)
    position = {info.key: i for i, info in enumerate(theirs)}
    group = [items[rank] for rank in ranks]
    order = sorted(range(len(group)), key=lambda i: position.get(group[i].key, len(theirs) + i))
    group = [group[i] for i in order]
    ordered = compact_ranks([ranks[i] for i in order])
    raw = ckpt.raw_header(file)
    if _same_list(group, theirs, len(raw)):
        return ShardLayout(file, items, ordered, sum(s.nbytes for s in group), len(raw), SourceHeader(ckpt, file))
    metadata = json.loads(raw[8:]).get("__metadata__")  # parsed before, strictly: a dict of strings or absent
    return made_shard(file, items, ordered, metadata, copied_from, copies_lead=False)


def _same_list(group: list[TensorSpec], theirs: list[TensorInfo], data_start: int) -> bool:
    """Whether ``group`` is ``theirs`` (in offset order) tensor for tensor, and ``theirs`` is
    packed from the end of the header on without a gap, so their offsets are the output's."""
    if len(group) != len(theirs):
        return False
    at = data_start
    for spec, info in zip(group, theirs, strict=True):
        if (spec.key, spec.dtype, spec.shape) != (info.key, info.dtype, info.shape) or info.offset != at:
            return False
        at += info.nbytes
    return True
