"""Which shards of a sharded source the plan never opens: those whose every key, as the
index says, is skipped by its rule (or matched by none, under ``require.strict: false``).

Decided from the index before any header is read, so ``mtp_extract`` on a 60-shard
verifier reads the header of the shard holding ``mtp.*`` and nothing of the others: their
keys are recorded from the index (``TensorRecord.unread_file``: no shape or dtype). What
such a shard holds is not checked against the index (that needs its header); every shard
that is read is (``sources/lazy_index.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace

from ...rules.model import TensorRule
from ...sources.base import Checkpoint, TensorInfo
from .recipes import TensorRecord
from .record_table import RecordTable


def source_tensors(ckpt: Checkpoint, rules: list[TensorRule], *, read_all: bool = False
                   ) -> Iterator[tuple[str, TensorInfo | str, TensorRule | None]]:
    """Each tensor of ``ckpt`` with the first of ``rules`` that matches it (None: none),
    file by file in offset order; for the keys of a shard left unread, the shard's name in
    place of a header entry, in key order. ``read_all``: read every header all the same
    (the source whose files the output is laid out like)."""

    def first_rule(key: str) -> TensorRule | None:
        return next((r for r in rules if r.pattern.fullmatch(key)), None)

    if read_all or all(ckpt.unread_header_keys(file) is None for file in ckpt.files):
        ckpt.read_headers(ckpt.files)
        for key, info in ckpt.tensors.items():
            yield key, info, first_rule(key)
        return
    # which shards' headers are needed, from the index: up to the first key a rule takes
    unread: dict[str, tuple[Sequence[str], dict[str, TensorRule | None]]] = {}
    for file in ckpt.files:
        keys = ckpt.unread_header_keys(file)  # None once read (by a vocabulary map, say)
        if keys is not None:
            firsts: dict[str, TensorRule | None] = {}
            for key in keys:
                firsts[key] = rule = first_rule(key)
                if rule is not None and rule.skip is None:
                    break
            else:
                unread[file] = keys, firsts
    ckpt.read_headers([file for file in ckpt.files if file not in unread])
    for file in ckpt.files:
        if file in unread:
            keys, firsts = unread.pop(file)
            for key in keys:
                yield key, file, firsts[key]
            continue
        # matched again key by key (not from ``firsts``): the planner then asks the rule for
        # the same key, which its pattern answers from the match it just made
        for info in ckpt.tensors_of_file(file):
            yield info.key, info, first_rule(info.key)


def unread_record(source: str, key: str, file: str, rule: TensorRule | None) -> TensorRecord:
    """The record of a key of shard ``file``, not read, skipped by ``rule`` (None: by no rule)."""
    reason = rule.skip if rule is not None and rule.skip is not None else "no rule matches (require.strict: false)"
    return TensorRecord(source, key, "skipped", None, None, None, rule.where.short if rule is not None else None,
                        reason, unread_file=file)


def complete_unread_records(records: RecordTable, ckpts: Mapping[str, Checkpoint]) -> None:
    """Give shape and dtype to the records of a shard first left unread whose header a
    later step read after all (an ``add``, a fill's rows, a config reference)."""
    # the few to change first: a list of every record was ~70 bytes a tensor at planning's peak
    read_since = [record for record in records.stored() if record.unread_file is not None
                  and ckpts[record.source].unread_header_keys(record.unread_file) is None]
    for record in read_since:
        info = ckpts[record.source].tensors[record.key]
        records.put(replace(record, shape=info.shape, dtype=info.dtype, unread_file=None))
