"""The package's logger: loguru's, imported on first use, silent unless asked.

As a library ckptxform follows loguru's convention for libraries: its messages are
disabled (``logger.disable("ckptxform")``) until the caller enables them with
``logger.enable("ckptxform")``; the CLI enables them (``configure_stderr``).

Importing loguru costs about 0.1 s (it brings asyncio), a tenth of copying a 2 GB
checkpoint; a run that logs nothing should not pay it. ``logger`` forwards everything to
loguru's logger. Until loguru is loaded, messages that loguru would drop (below the
CLI's level, or all of them while disabled) are dropped right here.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

_LEVELS = {"TRACE": 5, "DEBUG": 10, "INFO": 20, "SUCCESS": 25, "WARNING": 30, "ERROR": 40, "CRITICAL": 50}
_FORMAT = "<level>{level: <7}</level> {message}"
_PACKAGE = "ckptxform"
_SILENT = 1 << 30
_threshold = _SILENT
_pending_level: str | None = None
_loaded = False


def configure_stderr(level: str) -> None:
    """Log messages at ``level`` and above to stderr, and nothing else (the CLI's setting)."""
    global _threshold, _pending_level
    _threshold = _LEVELS[level]
    if _loaded:
        _apply(level)
    else:
        _pending_level = level


def _apply(level: str) -> None:
    from loguru import logger as real

    from .errors import terminal_line

    real.remove()
    # messages embed paths and names from inputs: their control characters are shown as
    # escapes, as on the CLI's error lines
    real.configure(patcher=lambda record: record.update(message=terminal_line(record["message"])))
    real.add(_Stderr(), level=level, format=_FORMAT, colorize=None)
    real.enable(_PACKAGE)


class _Stderr:
    """stderr, above a progress bar when one is drawn there (tqdm clears the bar's line,
    writes the message and draws the bar again), so a message never splices into a bar."""

    def write(self, message: str) -> None:
        bars = sys.modules.get("tqdm")
        if bars is not None:
            bars.tqdm.write(message, file=sys.stderr, end="")
        else:
            sys.stderr.write(message)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


def _user_chose(real: Any) -> bool:
    """Whether the caller already enabled or disabled ckptxform's messages in loguru (they
    may have imported loguru after ckptxform and called ``logger.enable`` before our first
    message). loguru has no public query for this; without the attribute, assume not."""
    activations = getattr(getattr(real, "_core", None), "activation_list", ())
    return any(name == _PACKAGE + "." for name, _ in activations)


_redacting: Any = None
_loading = threading.Lock()


def _loguru() -> Any:
    """loguru's logger, every message passing ``errors.redact`` (whatever sink gets it)."""
    global _pending_level, _loaded, _redacting
    already_imported = "loguru" in sys.modules
    from loguru import logger as real

    from .errors import redact

    with _loading:  # threads logging at once: none may log before the first one set loguru up
        if not _loaded:
            if _pending_level is not None:
                level, _pending_level = _pending_level, None
                _apply(level)
            elif not (already_imported and _user_chose(real)):
                real.disable(_PACKAGE)
            _loaded = True
    if _redacting is None:
        _redacting = real.patch(lambda record: record.update(message=redact(record["message"])))
    return _redacting


def _drop(*_args: Any, **_kwargs: Any) -> None:
    return None


class _LazyLogger:
    def __getattr__(self, name: str) -> Any:
        level = _LEVELS.get(name.upper())
        # Once loguru is imported (by us or by the caller), it decides.
        if level is not None and level < _threshold and "loguru" not in sys.modules:
            return _drop
        return getattr(_loguru(), name)


logger: Any = _LazyLogger()
