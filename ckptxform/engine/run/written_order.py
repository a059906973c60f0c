"""The run's written tensors in key order, merged from the shard records in the job
directory and the plan's outputs (in key order too).

A record lists its shard's tensors in key order (engine/output/shard_record.py), so the
merge (heapq) reads a few lines of each record at a time: nothing is held per tensor.
Held until the commit, the records' digests and moved pairs were ~48 bytes a tensor, and
the table that found each output's place in them 16 more.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import Any

from ...errors import OutputError
from ...tensor_digest import NO_DIGEST
from ..output.jobdir import JobDir
from ..output.shard_record import record_head, tensor_lines
from ..plan.layout import OutputLayout, ShardLayout
from ..plan.planner import Plan
from .result import WrittenTensor

#: record text the merge reads at once, over all records (a chunk of each), whatever the
#: tensor count: parsed, ~2 bytes held a byte of text; a chunk is at least _MIN_CHUNK
#: bytes (~30 lines: each chunk opens the file again, ~10 us)
_MERGE_BYTES = 512 << 10
_MIN_CHUNK = 4 << 10


def record_heads(layout: OutputLayout, job: JobDir) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """What the commit keeps of each shard's record (its first line): the Hub fetch events,
    in an order no executor changes (by source, then shard), and the cloned bytes, by file."""
    fetches: list[dict[str, Any]] = []
    cloned: dict[str, int] = {}
    for shard in layout.shards:
        head = record_head(job.record_path(shard))
        if head is None or head["file"] != shard.file or head["algorithm"] != job.identity["algorithm"]:
            raise _changed(job, shard)
        fetches.extend(head["fetches"])
        cloned[shard.file] = head["cloned"]
    return sorted(fetches, key=lambda event: str(event["source"])), cloned


def written_in_order(plan: Plan, layout: OutputLayout, job: JobDir) -> Iterator[WrittenTensor]:
    """Every output of ``plan``, in key order, as written: its digest and moved bytes from
    its shard's record; a ValueError when the records do not cover the plan's outputs
    exactly (a digest is never read at another tensor's place)."""
    algorithm = job.identity["algorithm"]
    chunk = max(_MIN_CHUNK, _MERGE_BYTES // max(1, len(layout.shards)))
    runs = [_run(job, shard, r, chunk) for r, shard in enumerate(layout.shards)]
    outputs = iter(plan.outputs)
    for key, r, j, digest, cloned, copied in heapq.merge(*runs):
        output = next(outputs, None)
        shard = layout.shards[r]
        if output is not None and output.key < key:
            raise ValueError(f"no shard record has tensor {output.key!r}, which the plan writes")
        if output is None or output.key != key:
            raise ValueError(f"the record of {shard.file} has tensor {key!r}, which the plan does not write")
        span = None
        if algorithm == NO_DIGEST:
            offset = shard.offset(j)
            span = (offset, offset + output.nbytes)
        yield WrittenTensor(key, shard.file, output.shape, output.dtype, digest, output.origin(), algorithm, span,
                            {"cloned": cloned, "copied": copied, "written": output.nbytes - cloned - copied})
    missing = next(outputs, None)
    if missing is not None:
        raise ValueError(f"no shard record has tensor {missing.key!r}, which the plan writes")


def _run(job: JobDir, shard: ShardLayout, r: int, chunk: int) -> Iterator[tuple[str, int, int, str, int, int]]:
    """``(key, r, place, digest, cloned, copied)`` of each tensor of ``shard`` (number
    ``r``), in key order, from its record."""
    previous = None
    try:
        for key, j, digest, cloned, copied in tensor_lines(job.record_path(shard), chunk):
            if previous is not None and not previous < key:  # the merge would be out of order
                raise ValueError(key)
            previous = key
            yield key, r, j, digest, cloned, copied
    except (OSError, ValueError, TypeError):
        raise _changed(job, shard) from None


def _changed(job: JobDir, shard: ShardLayout) -> OutputError:
    return OutputError(f"the record of finished shard {shard.file!r} in {str(job.path)!r} is missing or is not "
                       "this plan's (was the job directory changed during the run?); run the same command again",
                       path=str(job.record_path(shard)))
