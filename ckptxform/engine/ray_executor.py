"""``apply --executor ray``: shard tasks on a Ray cluster (the optional ``ray`` extra).

The nodes must share the source and output paths (a shared POSIX filesystem) and have
ckptxform installed. Each task is a ``ShardTask`` (engine/shards.py): a worker plans
again from headers, checks its plan is the run's, writes its shard into the job
directory and returns the shard's record. Ray retries a task whose worker or node is
lost (``max_retries``); a task's own error is not retried and becomes one ckptxform
error naming the shard. With no address (no ``--ray-address``, no ``RAY_ADDRESS``) a
local Ray instance is started for the run and stopped after it, as ``ray.init()`` does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import CkptxformError, OutputError, UsageError
from .jobdir import ShardRecord
from .shards import ShardTask, run_shard

#: attempts after the first when a task's worker process or node dies
TASK_RETRIES = 3


def run_on_ray(tasks: Sequence[ShardTask], done: Callable[[ShardRecord], None], *,
               address: str | None = None) -> None:
    """Run ``tasks`` on the Ray cluster at ``address`` (or ``RAY_ADDRESS``, or a local
    instance started here), calling ``done`` with each record as it arrives."""
    # Ray's driver prints the cluster's messages (a worker died, ...) to stdout, which
    # belongs to the command's result (--json): they go to stderr with the logs.
    with contextlib.redirect_stdout(sys.stderr):
        _run_on_ray(tasks, done, address)


def _run_on_ray(tasks: Sequence[ShardTask], done: Callable[[ShardRecord], None], address: str | None) -> None:
    try:
        import ray
        from ray import exceptions as ray_errors
    except ImportError:
        raise UsageError("--executor ray needs Ray: pip install 'ckptxform[ray]'") from None
    started_here = not ray.is_initialized()
    if started_here:
        options: dict[str, Any] = {"logging_level": logging.ERROR, "log_to_driver": False}
        if address is None and "RAY_ADDRESS" not in os.environ:
            options["include_dashboard"] = False
        try:
            ray.init(address=address, **options)
        except (ConnectionError, RuntimeError, ValueError) as err:
            raise OutputError(f"cannot connect to the Ray cluster at {address or os.environ.get('RAY_ADDRESS')!r}: "
                              f"{err}; check --ray-address (or RAY_ADDRESS), or leave both unset to start a "
                              "local Ray instance") from None
    remote = ray.remote(max_retries=TASK_RETRIES, retry_exceptions=False)(_ray_shard)
    refs = {remote.remote(task): task for task in tasks}
    pending = list(refs)
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                try:
                    done(ray.get(ref))
                except ray_errors.RayTaskError as err:
                    raise _task_error(refs[ref], err.cause) from None
                except ray_errors.RayError as err:  # the worker or node was lost more often than retried
                    raise OutputError(f"shard {refs[ref].file!r}: the Ray worker writing it was lost "
                                      f"{TASK_RETRIES + 1} times ({type(err).__name__}); the finished shards "
                                      "are kept: rerun the same command to resume",
                                      path=str(refs[ref].job.out / refs[ref].file)) from None
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)
        if started_here:
            ray.shutdown()


def _ray_shard(task: ShardTask) -> ShardRecord:
    return run_shard(task)


def _task_error(task: ShardTask, cause: BaseException | None) -> CkptxformError:
    """One ckptxform error naming the shard, of the type and fields of the task's own error."""
    message = str(cause) if cause is not None else "it failed"
    if isinstance(cause, CkptxformError):
        if message.startswith(f"shard {task.file!r}"):
            return cause
        cause.message = f"shard {task.file!r}: {message}"
        cause.args = (cause.message,)
        return cause
    return OutputError(f"shard {task.file!r}: {type(cause).__name__}: {message} (on the Ray cluster; rerun with "
                       "CKPTXFORM_DEBUG=1 and report it)", path=str(task.job.out / task.file))
