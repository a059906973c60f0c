"""Running a planned conversion: its shards by an executor, then the all-or-nothing commit.

The shards run by the executor ``options.executor`` names (engine/run/executors.py), each
task carrying its slice of the plan (engine/run/tasks.py). ``shard_of=(RANK, WORLD)`` writes only the shards whose index
is RANK modulo WORLD into the job directory and stops there, for a launcher that runs
WORLD such processes (srun, torchrun, a Kubernetes indexed job); ``finalize`` then
writes no shard: it checks every shard is finished and commits OUT.
"""

from __future__ import annotations

import hashlib
from array import array
from bisect import bisect_left
from operator import attrgetter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar, overload

from ...errors import OutputError, SourceChangedError
from ...log import logger
from ...sources.hub.meter import reporting
from ...sources.pins import check_unchanged
from ...tensor_digest import NO_DIGEST
from ..output.audit import AUDIT_FILE, AuditLog, run_event
from ..output.copied_files import CopiedFile, copy_files
from ..output.digest import RunDigest, file_digests
from ..output.jobdir import JobDir, ShardRecord
from ..output.outdir import OutputDir
from ..plan.layout import OutputLayout
from ..plan.opened import OpenSources
from ..plan.planner import Plan
from .executors import EXECUTORS, default_jobs
from .options import RunOptions
from .progress import RunProgress
from .result import ApplyResult, WrittenTensor
from .shard_plan import forget_run_plans
from .tasks import ShardTask, shard_tasks
from .writer import write_index, write_json_file

_T = TypeVar("_T")


def run_job(plan: Plan, sources: OpenSources, layout: OutputLayout, out: Path, options: RunOptions, *,
            digest: RunDigest, identity: dict[str, Any], started: Any) -> ApplyResult:
    """Write ``plan``'s shards as ``options`` say, then (unless ``shard_of``) commit OUT;
    ``sources`` are the checkpoints it was planned from (the tasks' slices name them, the
    copied files come from them)."""
    job = JobDir(out, identity, fsync=options.fsync, rules_path=plan.rules.path)
    if options.shard_of is not None:
        return _write_rank(plan, sources, layout, job, options)
    with OutputDir(out, force=options.force, fsync=options.fsync) as odir:
        try:
            if options.finalize:
                records = job.open(layout, resume=True, discard_others=False, must_exist=True)
                missing = [s.file for s in layout.shards if s.file not in records]
                if missing:
                    raise OutputError(f"{len(missing)} of {len(layout.shards)} shard(s) are not finished in "
                                      f"{job.path}: {', '.join(map(repr, missing[:8]))}"
                                      f"{' ...' if len(missing) > 8 else ''}; run the ranks that write them "
                                      "(apply --shard-of), then finalize again", path=str(job.path))
                tasks: list[ShardTask] = []
                jobs: dict[str, Any] | None = None  # the ranks' runs chose theirs
            else:
                records = job.open(layout, resume=options.resume)
                tasks = _tasks(plan, sources, layout, job, records, range(len(layout.shards)), options)
                jobs = _run(plan, sources, layout, tasks, records, options)
            written, copied, final = _commit(plan, sources, digest, layout, odir, job, records, started, jobs,
                                             hash_inputs=options.hash_inputs)
        except BaseException as err:
            if not options.finalize:  # finalize never loses the ranks' shards
                _keep_or_remove(job, err)
            raise
    job.remove()
    return ApplyResult(out=final, plan=plan, written=written, audit_path=final / AUDIT_FILE,
                       bytes_written=sum(layout.shards[t.index].data_nbytes for t in tasks),
                       stale_removed=odir.stale_removed, copied=copied, shards_kept=len(layout.shards) - len(tasks))


def _write_rank(plan: Plan, sources: OpenSources, layout: OutputLayout, job: JobDir,
                options: RunOptions) -> ApplyResult:
    assert options.shard_of is not None
    rank, world = options.shard_of
    mine = range(rank, len(layout.shards), world)
    # other ranks write into the same job directory at the same time: touch only our shards
    records = job.open(layout, resume=options.resume, discard_others=False,
                       mine=[layout.shards[i].file for i in mine])
    tasks = _tasks(plan, sources, layout, job, records, mine, options)
    try:
        _run(plan, sources, layout, tasks, records, options)
    except BaseException:
        if job.finished_shards():
            logger.warning("{} finished shard(s) are kept in {}: rerun this rank to resume", job.finished_shards(),
                           job.path)
        raise  # never removed: the other ranks write into it too
    return ApplyResult(out=job.out, plan=plan, written=(), audit_path=job.path, job_path=job.path,
                       bytes_written=sum(layout.shards[t.index].data_nbytes for t in tasks),
                       shards_kept=len(mine) - len(tasks), shard_of=options.shard_of, shards_of_rank=len(mine))


def _tasks(plan: Plan, sources: OpenSources, layout: OutputLayout, job: JobDir, records: dict[str, ShardRecord],
           indices: range, options: RunOptions) -> list[ShardTask]:
    kept = [layout.shards[i].file for i in indices if layout.shards[i].file in records]
    if kept:
        logger.info("resuming from {}: kept {} of {} shard(s) an interrupted run had finished",
                    job.path, len(kept), len(indices))
    todo = [i for i in indices if layout.shards[i].file not in records]
    # tasks run by this process itself take the run plan from memory: no file to write
    in_process = options.executor == "local" and _workers(plan, options, len(todo))[0] == 1
    return shard_tasks(plan, sources, layout, job, todo, in_process=in_process)


def _workers(plan: Plan, options: RunOptions, tasks: int) -> tuple[int, str]:
    """How many processes run ``tasks`` tasks of ``plan``, and why (the audit summary's ``jobs``)."""
    workers, why = (options.jobs, "--jobs") if options.jobs else default_jobs(plan, tasks)
    return min(workers, max(1, tasks)), why


def _run(plan: Plan, sources: OpenSources, layout: OutputLayout, tasks: list[ShardTask],
         records: dict[str, ShardRecord], options: RunOptions) -> dict[str, Any]:
    """Run ``tasks`` by the executor of ``options``, adding each record to ``records``; how
    many processes ran them and why (the audit summary's ``jobs``). The run plan the tasks
    read is freed when they are done."""
    workers, why = _workers(plan, options, len(tasks))
    executor = EXECUTORS[options.executor](options, sources, workers)
    bar = RunProgress({t.index: layout.shards[t.index].data_nbytes for t in tasks}, bool(options.progress))
    by_file = {t.file: t.index for t in tasks}

    def done(record: ShardRecord) -> None:
        records[record.file] = record
        bar.finish(by_file[record.file])

    try:
        with reporting(bar.fetched):  # the Hub bytes the tasks fetch, into the same bar
            executor.run(tasks, done, bar.update)
        bar.fetches_done()
    finally:
        bar.close()
        forget_run_plans()
    if options.executor == "ray":
        return {"executor": "ray", "reason": "--executor ray: one task a shard on the cluster"}
    return {"executor": "local", "workers": workers, "reason": why}


class _Audit:
    """The run's audit log. A failed write (a full disk) is one OutputError like any other
    write to OUT; closing after another failure must not replace that failure with its own."""

    def __init__(self, odir: OutputDir) -> None:
        self._odir = odir
        self._log = self._guard(lambda: AuditLog(odir.tmp_path / AUDIT_FILE))

    def event(self, obj: dict[str, Any]) -> None:
        self._guard(lambda: self._log.event(obj))

    def close(self, *, failing: bool = False) -> None:
        try:
            self._log.close()
        except OSError as err:
            if not failing:
                raise self._odir.write_error(AUDIT_FILE, err) from None

    def _guard(self, action: Callable[[], _T]) -> _T:
        try:
            return action()
        except OSError as err:
            raise self._odir.write_error(AUDIT_FILE, err) from None


def _keep_or_remove(job: JobDir, err: BaseException) -> None:
    """After a failed or stopped run: keep the job directory when it holds finished shards
    a rerun can resume, remove it otherwise (none finished, or read from a source that
    changed since: no rerun of this plan can keep them)."""
    finished = job.finished_shards()  # on disk: workers may have committed shards not yet reported
    if finished and not isinstance(err, SourceChangedError):
        logger.warning("{} finished shard(s) are kept in {}: rerun the same command to resume "
                       "(--no-resume starts over)", finished, job.path)
    else:
        job.remove()


def _commit(plan: Plan, sources: OpenSources, digest: RunDigest, layout: OutputLayout, odir: OutputDir, job: JobDir,
            records: dict[str, ShardRecord], started: Any,
            jobs: dict[str, Any] | None, *, hash_inputs: bool) -> tuple[Sequence[WrittenTensor], tuple[CopiedFile, ...], Path]:
    """The all-or-nothing end of a run: every shard, the index, the config, the copied
    files and the audit (in a fixed order) into OUT's temporary sibling, then the rename."""
    written = _WrittenTable(plan, layout, records, job.identity["algorithm"])
    job.link_into(odir.tmp_path, [s.file for s in layout.shards])
    write_index(odir, layout)
    config_sha256 = None
    if plan.config is not None:
        config_path = write_json_file(odir, layout, plan.rules.output.config_file, plan.config)
        config_sha256 = hashlib.sha256(config_path.read_bytes()).hexdigest()
    audit = _Audit(odir)
    try:
        copied = tuple(copy_files(plan.files, sources.checkpoints, odir.tmp_path))
        run = run_event(plan, started, digest)
        if hash_inputs:  # what settles a large input whose pin moved (engine/output/digest.py)
            run["file_digests"] = file_digests(digest)
        audit.event(run)
        for tensor_record in plan.records:
            audit.event(tensor_record.to_event())
        for event in _fetch_events(layout, records):
            audit.event(event)
        for name, ckpt in sorted(sources.checkpoints.items()):
            for note in ckpt.audit_notes():
                audit.event({**note, "source": name})
        for item in written:
            audit.event(item.to_event())
        for event in [skip.to_event() for skip in plan.files.skips] + [c.to_event() for c in copied]:
            audit.event(event)
        audit.event({"event": "summary", "status": "ok", "tensors": plan.counts(), "copied_files": len(copied),
                     "written": len(written), "bytes_written": layout.total_bytes,
                     "files": [s.file for s in layout.shards], "config_sha256": config_sha256,
                     # per shard, the data bytes cloned from a source (shared extents), not copied
                     "cloned_bytes": {s.file: records[s.file].cloned for s in layout.shards},
                     "jobs": jobs,  # how many processes wrote the shards, and why
                     "config_file": plan.rules.output.config_file,
                     "warnings": list(plan.warnings)})
        # every byte is read: a source written to since it was planned fails the run here
        check_unchanged({pin.path: pin for pin in (*plan.files_read(), *sources.pins())}.values())
    except BaseException:
        audit.close(failing=True)
        raise
    audit.close()
    return written, copied, odir.commit()


_key_of = attrgetter("key")
#: no record has this output's tensor (yet): no shard and place is 2**64 - 1
_NOT_FOUND = (1 << 64) - 1


class _WrittenTable(Sequence[WrittenTensor]):
    """The written tensors, by key, each made when it is asked for: as a tuple of
    ``WrittenTensor`` (with its ``from`` and ``moved`` dicts) they were ~450 bytes a tensor
    held at once, the peak of a many-tensor run. Holds the outputs in key order and, in
    the same order, where each one's digest and moved bytes are in the shard records
    (record and place, 8 bytes a tensor; its digest's hex is made with its record)."""

    def __init__(self, plan: Plan, layout: OutputLayout, records: dict[str, ShardRecord], algorithm: str) -> None:
        self._layout, self._algorithm = layout, algorithm
        self._outputs = sorted(plan.outputs, key=lambda o: o.key)
        #: in the layout's order: record r is of shard r, its tensor j the shard's j
        self._records = tuple(records[shard.file] for shard in layout.shards)
        #: output i's is record ``found[i] >> 32``'s tensor ``found[i] & 0xFFFFFFFF``
        self._found = array("Q", [_NOT_FOUND]) * len(self._outputs)
        for r, record in enumerate(self._records):
            if len(record.moved) != len(record.digests):
                raise ValueError(f"the record of {record.file} has {len(record.moved)} moved pairs "
                                 f"for {len(record.digests)} digests")
            for j, key in enumerate(record.digests.keys):
                # found by bisection in the sorted outputs: a table by key was ~80 bytes a tensor
                i = bisect_left(self._outputs, key, key=_key_of)
                if i == len(self._outputs) or self._outputs[i].key != key:
                    raise ValueError(f"the record of {record.file} has tensor {key!r}, which the plan does not write")
                self._found[i] = r << 32 | j
        if _NOT_FOUND in self._found:  # else it would read another tensor's digest
            missing = self._outputs[self._found.index(_NOT_FOUND)].key
            raise ValueError(f"no shard record has tensor {missing!r}, which the plan writes")

    def __len__(self) -> int:
        return len(self._outputs)

    @overload
    def __getitem__(self, i: int) -> WrittenTensor: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[WrittenTensor, ...]: ...

    def __getitem__(self, i: int | slice) -> WrittenTensor | tuple[WrittenTensor, ...]:
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        output = self._outputs[i]
        r, j = self._found[i] >> 32, self._found[i] & 0xFFFFFFFF
        record, shard = self._records[r], self._layout.shards[r]
        offset = shard.offset(j)
        span = (offset, offset + output.nbytes) if self._algorithm == NO_DIGEST else None
        cloned, copied = record.moved[j]
        digest = record.digests.raw(j).hex()
        return WrittenTensor(output.key, shard.file, output.shape, output.dtype, digest, output.origin(),
                             self._algorithm, span,
                             {"cloned": cloned, "copied": copied, "written": output.nbytes - cloned - copied})


def _fetch_events(layout: OutputLayout, records: dict[str, ShardRecord]) -> list[dict[str, Any]]:
    """How the shards' Hub bytes were fetched, by whichever process wrote each shard (its
    record), in an order no executor changes: by source, then shard."""
    events = [event for shard in layout.shards for event in records[shard.file].fetches]
    return sorted(events, key=lambda event: str(event["source"]))
