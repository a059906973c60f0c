"""Executors: what runs a job's shard tasks, all behind one protocol.

``run(tasks, done, progress)`` runs every task, calls ``done`` with each shard's record
as it arrives and ``progress(index, nbytes)`` as a task's bytes land (an executor that
cannot report them mid-task reports none: ``done`` completes the shard). A task's error
ends the run as ``tasks.shard_error`` makes it. ``EXECUTORS`` maps the names
``--executor`` accepts to how each is built; ``local`` is this process for one worker
and a process pool for more.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from ...errors import UsageError
from ..plan.recipes import OutputPlan, Sources

if TYPE_CHECKING:
    from ..plan.planner import Plan
    from .options import RunOptions
    from .tasks import Done, Progress, ShardTask

#: memory one worker may need (interpreter, chunks in flight, torch for a cast); bounds
#: the default number of workers on a small machine
WORKER_MEMORY = 1 << 30


class Executor(Protocol):
    def run(self, tasks: Sequence[ShardTask], done: Done, progress: Progress) -> None: ...


class Inline:
    """The tasks one after another in this process, reading through the parent's open sources."""

    def __init__(self, sources: Sources) -> None:
        self._sources = sources

    def run(self, tasks: Sequence[ShardTask], done: Done, progress: Progress) -> None:
        from .tasks import write_shard

        for task in tasks:
            done(write_shard(task, self._sources, lambda n, i=task.index: progress(i, n)))


class Ray:
    """The tasks on a Ray cluster (engine/run/ray.py); a shard's progress arrives with its record."""

    def __init__(self, address: str | None) -> None:
        self._address = address

    def run(self, tasks: Sequence[ShardTask], done: Done, progress: Progress) -> None:
        from .ray import run_on_ray

        run_on_ray(tasks, done, address=self._address)


def _local(options: RunOptions, sources: Sources, workers: int) -> Executor:
    if workers == 1:
        return Inline(sources)
    from .pool import ProcessPool

    return ProcessPool(workers)


#: ``--executor NAME`` -> the executor for a run's options, its open sources and its workers
EXECUTORS: dict[str, Callable[[RunOptions, Sources, int], Executor]] = {
    "local": _local,
    "ray": lambda options, sources, workers: Ray(options.ray_address),
}


def check_executor(name: str) -> str:
    """``name`` when the registry has it; a UsageError naming those it has otherwise."""
    if name not in EXECUTORS:
        raise UsageError(f"unknown executor {name!r}; choose one of {', '.join(map(repr, EXECUTORS))}")
    return name


def default_jobs(plan: Plan, shards: int) -> tuple[int, str]:
    """Workers for ``shards`` shards of ``plan`` when --jobs is not given, and why (the
    audit says it). An I/O-bound job gets one: its bytes move in the kernel, and a second
    process only adds its start-up (a rename took 1.11x as long with --jobs 2). A job whose
    outputs decode values (casts, block ops: dequant, quantize, transpose) for at least
    CPU_BOUND_SHARE of its bytes gets the cores this process may use, bounded by the memory
    available (WORKER_MEMORY each) and by the shards there are (a cast took 0.84x)."""
    total = plan.total_bytes
    decoded = sum(o.nbytes for o in plan.outputs if _decodes(o))  # one pass: each output is read anew
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
    return out.dtype != out.input_dtype or out.recipe.decodes()


def _available_memory() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return WORKER_MEMORY * (os.cpu_count() or 1)  # not Linux: the cores decide
