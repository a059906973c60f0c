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
from collections.abc import Mapping, Sequence

from ...errors import PlanError
from ...sources.base import Checkpoint, TensorInfo
from .layout import CopiedFrom, OutputLayout, ShardLayout, TensorSpec, copies_of, shard_layout

#: where the index of a sharded output goes (what transformers looks for)
INDEX_FILE = "model.safetensors.index.json"


def plan_layout_like(specs: Sequence[TensorSpec], *, source: str, ckpt: Checkpoint,
                     copied_from: Mapping[str, tuple[str, int]] | CopiedFrom | None = None) -> OutputLayout:
    """Lay out ``specs`` in the files of ``ckpt`` (source ``source`` of the rule file): see
    the module's docstring. ``copied_from`` as for ``plan_layout`` (a new header lines its
    unchanged copies up for cloning).

    >>> layout = plan_layout_like(specs, source="verifier", ckpt=verifier)   # doctest: +SKIP
    >>> layout.index_json()["weight_map"] == verifier_index["weight_map"]    # doctest: +SKIP
    True
    """
    files = list(ckpt.files)
    if not files or not all(f.endswith(".safetensors") for f in files):
        raise PlanError(f"output.shards.like: source {source!r} ({ckpt.location}) is not a safetensors checkpoint; "
                        "lay the output out like a safetensors source, or use output.max_shard_size")
    listed = {file: ckpt.tensors_of_file(file) for file in files}
    home = {info.key: (n, pos) for n, file in enumerate(files) for pos, info in enumerate(listed[file])}
    last = len(files) - 1
    groups: dict[int, list[tuple[tuple[int, int], TensorSpec]]] = {}
    for order, spec in enumerate(specs):
        n, pos = home.get(spec.key, (last, len(home) + order))  # a new key: the last file, after its own
        groups.setdefault(n, []).append(((pos, order), spec))
    shards = []
    for n in sorted(groups):
        group = [spec for _, spec in sorted(groups[n], key=lambda item: item[0])]
        shards.append(_shard_like(files[n], group, listed[files[n]], ckpt, copied_from))
    return OutputLayout(shards=tuple(shards), index_file=INDEX_FILE if len(files) > 1 else None)


def _shard_like(file: str, group: list[TensorSpec], theirs: list[TensorInfo], ckpt: Checkpoint,
                copied_from: Mapping[str, tuple[str, int]] | CopiedFrom | None) -> ShardLayout:
    """``file`` of the output: the source file's header when ``group`` is its tensor list, else a new one."""
    raw = ckpt.raw_header(file)
    if _same_list(group, theirs, len(raw)):
        return ShardLayout.of(file=file, header=raw, specs=group, offsets=(info.offset for info in theirs),
                              data_nbytes=sum(s.nbytes for s in group))
    metadata = json.loads(raw[8:]).get("__metadata__")  # parsed before, strictly: a dict of strings or absent
    return shard_layout(file, group, copies_of(group, copied_from), metadata)


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
