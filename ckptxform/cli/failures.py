"""How every ``ckptxform`` command fails: one line per problem on stderr (redacted, safe for
a terminal), the contract's exit codes (2 an invalid rule file or usage, 1 anything else
that failed, 130 Ctrl-C, 143 SIGTERM) and, with ``--json``, one failure object on stdout
(README, "Exit status and --json"); never a traceback unless ``CKPTXFORM_DEBUG=1``.
"""

from __future__ import annotations

import functools
import io
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click

from ..errors import CkptxformError, RuleError, redact, terminal_line
from .terminal import guarded_stdout

F = TypeVar("F", bound=Callable[..., Any])


def usage_failure(err: click.ClickException, argv: list[str]) -> NoReturn:
    """Exit with click's own error (an unknown option, a missing ``--out``): its usage text,
    and with ``--json`` in ``argv`` the failure object, like every other failure."""
    shown = io.StringIO()
    err.show(file=shown)  # click's usage text, each line made safe for a terminal
    for line in shown.getvalue().splitlines():
        click.echo(terminal_line(line), err=True)
    if _wants_json(argv):
        error = "UsageError" if isinstance(err, click.UsageError) else type(err).__name__
        click.echo(_failure_json([err.format_message()], err.exit_code, error))
    sys.exit(err.exit_code)


def _wants_json(argv: list[str]) -> bool:
    options = argv[:argv.index("--")] if "--" in argv else argv
    return "--json" in options


class _Terminated(BaseException):
    """SIGTERM (what timeout, systemd and Kubernetes send), raised where the run is, like
    KeyboardInterrupt for SIGINT, so that it unwinds the same way: no temporary output, no lock."""


def _terminate(signum: int, frame: object) -> NoReturn:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a repeated SIGTERM must not cut the cleanup short
    raise _Terminated


def reports_errors(func: F) -> F:
    """Turn ckptxform errors into one line per problem and the contract's exit codes."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            if threading.current_thread() is threading.main_thread():  # where Python runs handlers
                signal.signal(signal.SIGTERM, _terminate)
            with guarded_stdout():
                return func(*args, **kwargs)
        except CkptxformError as err:
            if os.environ.get("CKPTXFORM_DEBUG") == "1":
                raise
            # Rule-file problems already start with FILE:LINE:COL; others get a prefix.
            fields = {name: getattr(err, name) for name in ("path", "line", "col", "source", "key")
                      if getattr(err, name) is not None}
            _fail(str(err).splitlines(), "" if isinstance(err, RuleError) else "error: ", err.exit_code,
                  type(err).__name__, as_json=bool(kwargs.get("as_json")), **fields)
        except KeyboardInterrupt:
            _fail(["interrupted"], "", 130, "KeyboardInterrupt", as_json=bool(kwargs.get("as_json")), now=True)
        except _Terminated:
            _fail(["terminated (SIGTERM)"], "", 128 + signal.SIGTERM, "Terminated", as_json=bool(kwargs.get("as_json")))
        except Exception as err:  # noqa: BLE001 - last resort: one line, never a traceback
            if os.environ.get("CKPTXFORM_DEBUG") == "1":
                raise
            _fail([f"internal error: {type(err).__name__}: {err} "
                   "(rerun with CKPTXFORM_DEBUG=1 and report the traceback)"], "", 1, "InternalError",
                  as_json=bool(kwargs.get("as_json")))

    return wrapper  # type: ignore[return-value]


def _fail(messages: list[str], prefix: str, code: int, error: str, *, as_json: bool, now: bool = False,
          **fields: Any) -> NoReturn:
    """One line per problem on stderr; with ``--json`` also one object on stdout that a
    script can branch on (error type, and which source, file, line, key); exit ``code``.
    Every line passes ``redact``: an internal error's text may quote a server's.
    ``now`` (Ctrl-C): the exit handlers run, then the process ends without tearing the
    interpreter down (0.6-1 s after a run on two cores; the user asked to stop)."""
    messages = [redact(line) for line in messages]
    for line in messages:
        click.echo(terminal_line(f"{prefix}{line}"), err=True)
    if as_json and error != "OutputStreamError":
        click.echo(_failure_json(messages, code, error, **fields))
    if now:
        import atexit

        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _failure_json(messages: list[str], code: int, error: str, **fields: Any) -> str:
    """The failure object (README, "Exit status and --json")."""
    return json.dumps({"status": "failed", "exit_code": code, "error": error, "messages": messages, **fields},
                      indent=2)
