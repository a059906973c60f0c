"""``apply --executor ray``: shard tasks on a Ray cluster (the optional ``ray`` extra).

The nodes must share the source and output paths (a shared POSIX filesystem) and have
ckptxform installed. Each task is a ``ShardTask`` (engine/run/tasks.py): a worker reads
its slice of the run's plan from the job directory, opens the pinned sources (it never
plans), writes its shard into the job directory and returns the shard's record. Ray retries a task whose worker or node is
lost (``max_retries``); a task's own error is not retried and becomes one ckptxform
error naming the shard (``shards.shard_error``). With no address (no ``--ray-address``,
no ``RAY_ADDRESS``) a local Ray instance is started for the run and stopped after it, as
``ray.init()`` does.
Tasks run with the run's ``HF_*`` and ``CKPTXFORM_*`` settings (which Hub, which cache,
offline or not: a worker must read the Hub the run planned against), never with
``HF_TOKEN``: a token would be kept in the cluster's metadata; each node authenticates
with its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ...digits import is_ascii_digits
from ...errors import OutputError, UsageError
from ..output.jobdir import ShardRecord
from .tasks import ShardTask, run_shard, shard_error

#: attempts after the first when a task's worker process or node dies
TASK_RETRIES = 3
#: settings of the run that its tasks take, and the secret among them that they do not
_FORWARDED = ("HF_", "CKPTXFORM_")
_SECRET = "HF_TOKEN"
#: seconds the run waits for its cancelled tasks to end
CANCEL_WAIT = 30.0
#: seconds a cluster's address gets to accept a connection (``CKPTXFORM_RAY_CONNECT_TIMEOUT``)
CONNECT_TIMEOUT = 10.0


def run_on_ray(tasks: Sequence[ShardTask], done: Callable[[ShardRecord], None], *,
               address: str | None = None) -> None:
    """Run ``tasks`` on the Ray cluster at ``address`` (or ``RAY_ADDRESS``, or a local
    instance started here), calling ``done`` with each record as it arrives."""
    # Ray's driver prints the cluster's messages (a worker died, ...) to stdout, which
    # belongs to the command's result (--json): they go to stderr with the logs.
    with contextlib.redirect_stdout(sys.stderr):
        _run_on_ray(tasks, done, address)


def _run_on_ray(tasks: Sequence[ShardTask], done: Callable[[ShardRecord], None], address: str | None) -> None:
    check_reachable(address or os.environ.get("RAY_ADDRESS"))
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
    remote = ray.remote(max_retries=TASK_RETRIES, retry_exceptions=False,
                        runtime_env={"env_vars": task_settings(os.environ)})(_ray_shard)
    refs = {remote.remote(task): task for task in tasks}
    pending = list(refs)
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                try:
                    done(ray.get(ref))
                except ray_errors.RayTaskError as err:
                    raise shard_error(refs[ref], err.cause) from None
                except ray_errors.RayError as err:  # the worker or node was lost more often than retried
                    lost = OutputError(f"the Ray worker writing it was lost {TASK_RETRIES + 1} times "
                                       f"({type(err).__name__}); the finished shards are kept: rerun the same "
                                       "command to resume", path=str(refs[ref].job.out / refs[ref].file))
                    raise shard_error(refs[ref], lost) from None
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)
        if pending:  # nothing of this run may write into the job directory once it has ended
            ray.wait(pending, num_returns=len(pending), timeout=CANCEL_WAIT, fetch_local=False)
        if started_here:
            ray.shutdown()


def check_reachable(address: str | None) -> None:
    """Refuse, within CONNECT_TIMEOUT, a cluster address that accepts no connection: Ray's
    own connect retries for minutes inside native code, where no SIGTERM or Ctrl-C is
    acted on. The wait here is a socket's, so a stop signal ends it (and the run cleans up)."""
    endpoint = _endpoint(address)
    if endpoint is None:  # no address, "auto", "local": Ray finds or starts the cluster itself
        return
    seconds = _connect_timeout()
    try:
        socket.create_connection(endpoint, timeout=seconds).close()
    except OSError as err:
        why = "no answer" if isinstance(err, TimeoutError) else (err.strerror or str(err))
        raise OutputError(f"cannot connect to the Ray cluster at {address!r}: {why} within {seconds:g} s; check "
                          "--ray-address (or RAY_ADDRESS), or leave both unset to start a local Ray instance") from None


def _endpoint(address: str | None) -> tuple[str, int] | None:
    """``(host, port)`` of a Ray address (``HOST:PORT``, ``ray://HOST:PORT``), or None when
    it names no endpoint of its own."""
    if not address or address in ("auto", "local"):
        return None
    rest = address.split("://", 1)[1] if "://" in address else address
    host, _, port = rest.rstrip("/").rpartition(":")
    if not host or not is_ascii_digits(port):
        return None  # Ray says what is wrong with it
    return host.strip("[]"), int(port)


def _connect_timeout() -> float:
    value = os.environ.get("CKPTXFORM_RAY_CONNECT_TIMEOUT", "")
    try:
        return float(value) if value else CONNECT_TIMEOUT
    except ValueError:
        raise UsageError(f"CKPTXFORM_RAY_CONNECT_TIMEOUT={value!r}: expected a number of seconds") from None


def task_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of the run's ``environ`` its tasks run with: ``HF_*`` and
    ``CKPTXFORM_*`` but ``HF_TOKEN``."""
    return {name: value for name, value in environ.items() if name.startswith(_FORWARDED) and name != _SECRET}


def _ray_shard(task: ShardTask) -> ShardRecord:
    return run_shard(task)

