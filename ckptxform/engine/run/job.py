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
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from ...errors import OutputError, SourceChangedError
from ...log import logger
from ...sources.hub.meter import reporting
from ...sources.pins import check_unchanged
from ..output.audit import AUDIT_FILE, AuditLog, run_event
from ..output.copied_files import CopiedFile, copy_files
from ..output.digest import RunDigest, file_digests
from ..output.index_file import IndexFile
from ..output.jobdir import JobDir, ShardRecord
from ..output.outdir import OutputDir
from ..plan.layout import OutputLayout
from ..plan.opened import OpenSources
from ..plan.planner import Plan
from .executors import EXECUTORS, default_jobs
from .options import RunOptions
from .progress import RunProgress
from .result import MARK_EVERY, ApplyResult, WrittenInAudit
from .shard_plan import forget_run_plans
from .tasks import ShardTask, shard_tasks
from .writer import write_json_file
from .written_order import record_heads, written_in_order

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
                kept = job.open(layout, resume=True, discard_others=False, must_exist=True)
                missing = [s.file for s in layout.shards if s.file not in kept]
                if missing:
                    raise OutputError(f"{len(missing)} of {len(layout.shards)} shard(s) are not finished in "
                                      f"{job.path}: {', '.join(map(repr, missing[:8]))}"
                                      f"{' ...' if len(missing) > 8 else ''}; run the ranks that write them "
                                      "(apply --shard-of), then finalize again", path=str(job.path))
                tasks: list[ShardTask] = []
                jobs: dict[str, Any] | None = None  # the ranks' runs chose theirs
            else:
                kept = job.open(layout, resume=options.resume)
                tasks, workers = _tasks(plan, sources, layout, job, kept, range(len(layout.shards)), options)
                jobs = _run(layout, tasks, workers, options, sources)
            written, copied, final = _commit(plan, sources, digest, layout, odir, job, started, jobs,
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
    kept = job.open(layout, resume=options.resume, discard_others=False,
                    mine=[layout.shards[i].file for i in mine])
    tasks, workers = _tasks(plan, sources, layout, job, kept, mine, options)
    try:
        _run(layout, tasks, workers, options, sources)
    except BaseException:
        if job.finished_shards():
            logger.warning("{} finished shard(s) are kept in {}: rerun this rank to resume", job.finished_shards(),
                           job.path)
        raise  # never removed: the other ranks write into it too
    return ApplyResult(out=job.out, plan=plan, written=(), audit_path=job.path, job_path=job.path,
                       bytes_written=sum(layout.shards[t.index].data_nbytes for t in tasks),
                       shards_kept=len(mine) - len(tasks), shard_of=options.shard_of, shards_of_rank=len(mine))


def _tasks(plan: Plan, sources: OpenSources, layout: OutputLayout, job: JobDir, kept: set[str],
           indices: range, options: RunOptions) -> tuple[list[ShardTask], tuple[int, str]]:
    """The tasks of the shards of ``indices`` not ``kept`` (finished by an interrupted run),
    and how many processes run them and why (decided once: it reads every output)."""
    todo = [i for i in indices if layout.shards[i].file not in kept]
    if len(todo) < len(indices):
        logger.info("resuming from {}: kept {} of {} shard(s) an interrupted run had finished",
                    job.path, len(indices) - len(todo), len(indices))
    # tasks run by this process itself take the run plan from memory: no file to write
    workers = _workers(plan, options, len(todo))
    in_process = options.executor == "local" and workers[0] == 1
    return shard_tasks(plan, sources, layout, job, todo, in_process=in_process), workers


def _workers(plan: Plan, options: RunOptions, tasks: int) -> tuple[int, str]:
    """How many processes run ``tasks`` tasks of ``plan``, and why (the audit summary's ``jobs``)."""
    workers, why = (options.jobs, "--jobs") if options.jobs else default_jobs(plan, tasks)
    return min(workers, max(1, tasks)), why


def _run(layout: OutputLayout, tasks: list[ShardTask], workers_why: tuple[int, str], options: RunOptions,
         sources: OpenSources) -> dict[str, Any]:
    """Run ``tasks`` by the executor of ``options`` in ``workers_why[0]`` processes; how many
    ran them and why (the audit summary's ``jobs``). Each shard's record stays in the job
    directory, where the commit reads it back. The run plan the tasks read is freed when
    they are done."""
    workers, why = workers_why
    executor = EXECUTORS[options.executor](options, sources, workers)
    bar = RunProgress({t.index: layout.shards[t.index].data_nbytes for t in tasks}, bool(options.progress))
    by_file = {t.file: t.index for t in tasks}

    def done(record: ShardRecord) -> None:
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
    """The run's audit log, its writes ``_guarded``; closing after another failure must
    not replace that failure with its own."""

    def __init__(self, odir: OutputDir) -> None:
        self._odir = odir
        self._log = _guarded(odir, AUDIT_FILE, lambda: AuditLog(odir.tmp_path / AUDIT_FILE))

    def event(self, obj: dict[str, Any]) -> int:
        """Append ``obj``; the byte offset its line starts at."""
        return _guarded(self._odir, AUDIT_FILE, lambda: self._log.event(obj))

    def close(self, *, failing: bool = False) -> None:
        try:
            self._log.close()
        except OSError as err:
            if not failing:
                raise self._odir.write_error(AUDIT_FILE, err) from None


def _guarded(odir: OutputDir, file: str, action: Callable[[], _T]) -> _T:
    """``action()``, a write to ``file`` of OUT: a failure (a full disk) is one OutputError
    like any other write to OUT."""
    try:
        return action()
    except OSError as err:
        raise odir.write_error(file, err) from None


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
            started: Any, jobs: dict[str, Any] | None, *,
            hash_inputs: bool) -> tuple[WrittenInAudit, tuple[CopiedFile, ...], Path]:
    """The all-or-nothing end of a run: every shard, the index, the config, the copied
    files and the audit (in a fixed order) into OUT's temporary sibling, then the rename.
    The written tensors are merged in key order from the shards' records in the job
    directory into the audit and the index as they come (engine/run/written_order.py)."""
    fetches, cloned = record_heads(layout, job)
    job.link_into(odir.tmp_path, [s.file for s in layout.shards])
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
        for event in fetches:
            audit.event(event)
        for name, ckpt in sorted(sources.checkpoints.items()):
            for note in ckpt.audit_notes():
                audit.event({**note, "source": name})
        count, marks = _write_written(plan, layout, job, audit, odir)
        for event in [skip.to_event() for skip in plan.files.skips] + [c.to_event() for c in copied]:
            audit.event(event)
        audit.event({"event": "summary", "status": "ok", "tensors": plan.counts(), "copied_files": len(copied),
                     "written": count, "bytes_written": layout.total_bytes,
                     "files": [s.file for s in layout.shards], "config_sha256": config_sha256,
                     # per shard, the data bytes cloned from a source (shared extents), not copied
                     "cloned_bytes": cloned,
                     "jobs": jobs,  # how many processes wrote the shards, and why
                     "config_file": plan.rules.output.config_file,
                     "warnings": list(plan.warnings)})
        # every byte is read: a source written to since it was planned fails the run here
        check_unchanged({pin.path: pin for pin in (*plan.files_read(), *sources.pins())}.values())
    except BaseException:
        audit.close(failing=True)
        raise
    audit.close()
    final = odir.commit()
    return WrittenInAudit(final / AUDIT_FILE, count, marks), copied, final


def _write_written(plan: Plan, layout: OutputLayout, job: JobDir, audit: _Audit,
                   odir: OutputDir) -> tuple[int, array[int]]:
    """The ``written`` records, in key order, into the audit and (when sharded) the
    index, as they are merged; how many, and the audit offsets ``WrittenInAudit`` reads
    them back from."""
    marks: array[int] = array("Q")
    count = 0
    name = layout.index_file
    if name is None:
        index = None
    else:
        index = _guarded(odir, name, lambda: IndexFile(odir.tmp_path / name, layout.total_bytes))
    try:
        for item in written_in_order(plan, layout, job):
            at = audit.event(item.to_event())
            if count % MARK_EVERY == 0:
                marks.append(at)
            count += 1
            if index is not None:
                _guarded(odir, index.name, partial(index.add, item.key, item.file))
        if index is not None:
            _guarded(odir, index.name, index.close)
    finally:
        if index is not None:
            index.discard()
    return count, marks
