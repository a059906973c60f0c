"""Shard tasks: one output shard is the unit of work, run in this process or in workers.

The plan fixes every shard's header, so a task writes one whole file: ``write_shard``
runs the shard's outputs through whatever produces their bytes (engine/run/execute.py), then
commits the file to the job directory with its record (engine/output/jobdir.py) and returns the
record. A ``ShardTask`` is what a worker needs, small and picklable: the job directory
and the shard; the run's plan for its tasks is saved in the job directory, a file a
shard (engine/run/shard_plan.py: the outputs, what they read, the pins). A worker never plans: it opens the pinned sources (once per
process), refuses a source that changed and bytes of another object than the run read
first, so the same tasks run in a process pool here and on other machines
(engine/run/ray.py). A worker's task error reaches the run as one error naming its shard
(``shard_error``), in any executor (engine/run/executors.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...bulk_gc import collector_paused
from ...errors import CkptxformError, OutputError
from ..output.jobdir import JobDir, ShardRecord
from ..plan.layout import OutputLayout
from ..plan.planner import Plan, forbid_planning
from ..plan.recipes import Sources
from .shard_plan import keep_run_plan, load_run_plan, open_pinned, save_run_plan, slice_plan
from .stream import write_outputs
from .writer import ShardWriter

#: what an executor calls with each shard's record, and with (shard index, bytes) as they land
Done = Callable[[ShardRecord], None]
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ShardTask:
    """Write shard ``index`` (``file``: its name) into ``job`` as the run plan saved
    there says (engine/run/shard_plan.py)."""

    job: JobDir
    index: int
    file: str
    #: the file of the job directory holding the run's plan for its tasks
    plan: str
    #: the run's working directory, where relative source locations resolve (a Ray worker
    #: starts elsewhere; on another node this path is on the shared filesystem)
    cwd: str = field(default_factory=os.getcwd)


def first_etags(sources: Sources) -> dict[str, dict[str, str]]:
    """Source -> file -> ETag of the first bytes the run was served of it (Hub sources)."""
    return {name: etags for name, ckpt in sorted(sources.checkpoints.items()) if (etags := ckpt.first_etags())}


def shard_tasks(plan: Plan, sources: Sources, layout: OutputLayout, job: JobDir,
                indices: list[int], *, in_process: bool = False) -> list[ShardTask]:
    """One task per shard of ``indices``, their slice of ``plan`` (read through ``sources``,
    the open checkpoints it was planned from) saved in ``job``, or only held in memory when
    the tasks run ``in_process``."""
    if not indices:
        return []
    run = slice_plan(plan, sources, [layout.shards[i] for i in indices], first_etags(sources),
                     for_workers=not in_process)
    name = keep_run_plan(job, run) if in_process else save_run_plan(job, run)
    return [ShardTask(job, i, layout.shards[i].file, name) for i in indices]


@collector_paused()  # no cycle per tensor: see bulk_gc.py
def write_shard(task: ShardTask, sources: Sources, progress: Callable[[int], None] | None = None) -> ShardRecord:
    """Write ``task``'s shard, reading through ``sources``, into its job directory; flush,
    commit and return its record."""
    work, job = load_run_plan(task.job, task.plan).shards[task.file], task.job
    outputs = work.outputs
    # the shard's outputs made once, for the writer's placements and the streams alike,
    # and its header once, for the file and its record
    shard = work.shard.standalone(outputs, header=True)
    partial = job.begin_shard(shard)
    before = {name: len(ckpt.fetch_events()) for name, ckpt in sources.checkpoints.items()}
    with ShardWriter(job, OutputLayout(shards=(shard,), index_file=None), algorithm=job.identity["algorithm"]) as writer:
        write_outputs(list(outputs), sources, writer, progress)
    digests, moved = writer.take_results()
    cloned = writer.bytes_cloned
    # how this shard's Hub bytes were fetched (a worker's sources serve many shards)
    fetches = tuple(event for name in sorted(sources.checkpoints)
                    for event in sources.checkpoints[name].fetch_events()[before[name]:])
    return job.commit_shard(shard, partial, digests, fetches, cloned, moved)


def run_shard(task: ShardTask, progress: Callable[[int], None] | None = None) -> ShardRecord:
    """A worker's entry point: open the task's pinned sources (once per process), write the shard."""
    forbid_planning("a shard worker executes its task's slice of the run's plan")
    if os.getcwd() != task.cwd:
        os.chdir(task.cwd)
    run = load_run_plan(task.job, task.plan)
    if _OPENED.get("run") is not run:  # a worker serves one run at a time: another run, other sources
        for ckpt in _OPENED.get("sources", {}).values():
            ckpt.close()
        _OPENED.update(run=run, sources={})
    return write_shard(task, open_pinned(run, run.shards[task.file], _OPENED["sources"]), progress)


#: the run plan this worker serves and the sources it opened for it
_OPENED: dict[str, Any] = {}


def shard_error(task: ShardTask, err: BaseException | None) -> CkptxformError:
    """The one error a worker's task that raised ``err`` (None: unknown) ends the run
    with: its own ckptxform error with the shard named first, else an OutputError naming
    the shard and what was raised (a bug)."""
    prefix = f"shard {task.file!r}: "
    if isinstance(err, CkptxformError):
        err.message = prefix + err.message
        err.args = (err.message,)
        return err
    what = f"{type(err).__name__}: {err}" if err is not None else "the task failed"
    return OutputError(f"{prefix}{what} (rerun with CKPTXFORM_DEBUG=1 and report it)",
                       path=str(task.job.out / task.file))
