"""Shard tasks: one output shard is the unit of work, run in this process or in workers.

The plan fixes every shard's header, so a task writes one whole file: ``write_shard``
runs the shard's outputs through whatever produces their bytes (engine/run/execute.py), then
commits the file to the job directory with its record (engine/output/jobdir.py) and returns the
record. A ``ShardTask`` is what a worker needs, small and picklable: the rule set with the
run's source locations, the job directory, the shard's index, and the ETags of the Hub
files the run read first. A worker plans again from headers (once per process), refuses to
write when its plan is not the parent's and refuses bytes of another object than the run
read first, so workers need nothing from the parent's memory: the same tasks run in a
process pool here and on other machines (engine/run/ray.py). A worker's task error
reaches the run as one error naming its shard (``shard_error``), in either executor.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass, field

from ...errors import CkptxformError, OutputError
from ...rules.model import RuleSet
from ..output.jobdir import JobDir, ShardRecord, job_identity
from ..output.digest import run_digest
from ..plan.layout import OutputLayout, ShardLayout
from ..plan.planner import Plan
from ..plan.recipes import BlockProgram, ByteRecipe, OutputPlan
from ...ops.base import Block
from .writer import ShardWriter

#: memory one worker may need (interpreter, chunks in flight, torch for a cast); bounds
#: the default number of workers on a small machine
WORKER_MEMORY = 1 << 30


@dataclass(frozen=True)
class ShardTask:
    """Write shard ``index`` of the plan of ``rules`` into ``job`` (``file``: its name),
    holding to ``etags``."""

    rules: RuleSet
    job: JobDir
    index: int
    file: str
    #: source -> file -> ETag of the first bytes the run was served of it (Hub sources)
    etags: Mapping[str, Mapping[str, str]]
    #: the run's working directory, where relative source locations resolve (a Ray worker
    #: starts elsewhere; on another node this path is on the shared filesystem)
    cwd: str = field(default_factory=os.getcwd)


def first_etags(plan: Plan) -> dict[str, dict[str, str]]:
    """What ``ShardTask.etags`` holds for the tasks of ``plan``."""
    return {name: etags for name, ckpt in sorted(plan.checkpoints.items()) if (etags := ckpt.first_etags())}


def write_shard(plan: Plan, layout: OutputLayout, shard: ShardLayout, job: JobDir,
                progress: Callable[[int], None] | None = None) -> ShardRecord:
    """Write ``shard`` of ``plan`` into ``job``, flush and commit it; its record."""
    from .execute import write_outputs

    by_key = {o.key: o for o in plan.outputs}
    partial = job.begin_shard(shard)
    before = {name: len(ckpt.fetch_events()) for name, ckpt in plan.checkpoints.items()}
    with ShardWriter(job, OutputLayout(shards=(shard,), index_file=None), algorithm=job.identity["algorithm"]) as writer:
        write_outputs([by_key[p.spec.key] for p in shard.tensors], plan, writer, progress)
    digests = tuple((p.spec.key, writer.digest(p.spec.key)) for p in shard.tensors)
    # how this shard's Hub bytes were fetched (a worker's plan serves many shards)
    fetches = tuple(event for name in sorted(plan.checkpoints)
                    for event in plan.checkpoints[name].fetch_events()[before[name]:])
    return job.commit_shard(shard, partial, digests, fetches, writer.bytes_cloned)


def run_shard(task: ShardTask) -> ShardRecord:
    """A worker's entry point: plan (once per process), check the plan is the parent's, write the shard."""
    if os.getcwd() != task.cwd:
        os.chdir(task.cwd)
    plan, layout = _plan_of(task)
    return write_shard(plan, layout, layout.shards[task.index], task.job)


#: plans this worker made, by job digest
_PLANS: dict[str, tuple[Plan, OutputLayout]] = {}


def _plan_of(task: ShardTask) -> tuple[Plan, OutputLayout]:
    from ...api import plan as make_plan
    from .execute import layout_of

    cached = _PLANS.get(task.job.digest)
    if cached is None:
        plan = make_plan(task.rules)
        layout = layout_of(plan)
        if job_identity(layout, task.job.identity["algorithm"], run_digest(plan)) != task.job.identity:
            plan.close()
            raise OutputError("the sources or rules changed while the run was going (a worker planned "
                              "something else than the run did); rerun the command",
                              path=str(task.job.out / task.file))
        for name, etags in task.etags.items():
            plan.checkpoints[name].expect_etags(etags)
        cached = _PLANS[task.job.digest] = (plan, layout)
    return cached


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


def default_jobs(plan: Plan, shards: int) -> tuple[int, str]:
    """Workers for ``shards`` shards of ``plan`` when --jobs is not given, and why (the
    audit says it). An I/O-bound job gets one: its bytes move in the kernel, and a second
    process only adds its start-up (a rename took 1.11x as long with --jobs 2). A job whose
    outputs decode values (casts, block ops: dequant, quantize, transpose) for at least
    CPU_BOUND_SHARE of its bytes gets the cores this process may use, bounded by the memory
    available (WORKER_MEMORY each) and by the shards there are (a cast took 0.84x)."""
    total = sum(o.nbytes for o in plan.outputs)
    decoded = sum(o.nbytes for o in plan.outputs if _decodes(o))
    if not decoded or decoded < CPU_BOUND_SHARE * total:
        return 1, (f"I/O-bound: {decoded / max(total, 1):.0%} of the output's bytes are decoded (casts, block ops), "
                   "the rest copied; one process")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    memory = _available_memory() // WORKER_MEMORY or 1
    workers = max(1, min(cores, memory, shards))
    return workers, (f"CPU-bound: {decoded / total:.0%} of the output's bytes are decoded (casts, block ops); "
                     f"{workers} process(es): {cores} core(s), memory for {memory}, {shards} shard(s)")


#: the share of an output's bytes that, decoded, makes a job CPU-bound (more processes)
CPU_BOUND_SHARE = 0.1


def _decodes(out: OutputPlan) -> bool:
    """Whether making ``out`` decodes values (a cast or a block op): CPU per byte, not I/O."""
    recipe = out.recipe
    return (out.dtype != out.input_dtype or isinstance(recipe, BlockProgram)
            or (isinstance(recipe, ByteRecipe) and any(isinstance(item, Block) for item in recipe.sources())))


def _available_memory() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return WORKER_MEMORY * (os.cpu_count() or 1)  # not Linux: the cores decide


def run_in_processes(tasks: Sequence[ShardTask], jobs: int, done: Callable[[ShardRecord], None]) -> None:
    """Run ``tasks`` in ``jobs`` worker processes, calling ``done`` with each record as it
    arrives. A task's error ends the run as ``shard_error`` makes it; a worker that dies
    is one OutputError naming the shards that were running, never a hang."""
    import multiprocessing  # here: a run in one process does not pay for importing it
    from concurrent.futures.process import BrokenProcessPool, ProcessPoolExecutor

    context = multiprocessing.get_context("spawn")  # no inherited threads, locks or sockets
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=_worker_started,
                               initargs=(os.getpid(),))
    futures: dict[Future[ShardRecord], ShardTask] = {pool.submit(run_shard, t): t for t in tasks}
    pending = set(futures)
    try:
        while pending:
            finished, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for future in sorted(finished, key=lambda f: futures[f].index):
                try:
                    record = future.result()
                except BrokenProcessPool:
                    lost = sorted(t.file for f, t in futures.items() if not _succeeded(f))
                    raise OutputError(f"a worker process died (killed, or out of memory?) while {len(lost)} "
                                      f"shard(s) were unwritten: {', '.join(map(repr, lost[:8]))}; the finished "
                                      "shards are kept: rerun the same command to resume",
                                      path=str(tasks[0].job.out)) from None
                except Exception as err:  # noqa: BLE001 - the task's own error, whatever it is
                    raise shard_error(futures[future], err)  # its context: err, with the worker's traceback
                done(record)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _succeeded(future: Future[ShardRecord]) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None


def _worker_started(parent: int) -> None:
    """In each worker: die with the parent (a SIGKILLed run must not leave writers behind),
    leave Ctrl-C to the parent, log errors only (the parent reports the run)."""
    from ...log import configure_stderr

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_stderr("ERROR")
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def run_inline(plan: Plan, layout: OutputLayout, tasks: Sequence[ShardTask], done: Callable[[ShardRecord], None],
               progress: Callable[[int], None] | None) -> None:
    """Run ``tasks`` one after another in this process, on the parent's plan."""
    for task in tasks:
        done(write_shard(plan, layout, layout.shards[task.index], task.job, progress))

