"""The package's logger: loguru's, imported on first use.

Importing loguru costs about 0.1 s (it brings asyncio), a tenth of copying a 2 GB
checkpoint; a run that logs nothing should not pay it. ``logger`` forwards everything to
loguru's logger. Until loguru is loaded, messages below the level the CLI asked for
(``configure_stderr``) are dropped right here, which is what loguru would do with them.
"""

from __future__ import annotations

import sys
from typing import Any

_LEVELS = {"TRACE": 5, "DEBUG": 10, "INFO": 20, "SUCCESS": 25, "WARNING": 30, "ERROR": 40, "CRITICAL": 50}
_FORMAT = "<level>{level: <7}</level> {message}"
_threshold = 0
_pending_level: str | None = None


def configure_stderr(level: str) -> None:
    """Log messages at ``level`` and above to stderr, and nothing else (the CLI's setting)."""
    global _threshold, _pending_level
    _threshold = _LEVELS[level]
    if "loguru" in sys.modules:
        _apply(level)
    else:
        _pending_level = level


def _apply(level: str) -> None:
    from loguru import logger as real

    real.remove()
    real.add(sys.stderr, level=level, format=_FORMAT, colorize=None)


def _loguru() -> Any:
    global _pending_level
    from loguru import logger as real

    if _pending_level is not None:
        level, _pending_level = _pending_level, None
        _apply(level)
    return real


def _drop(*_args: Any, **_kwargs: Any) -> None:
    return None


class _LazyLogger:
    def __getattr__(self, name: str) -> Any:
        level = _LEVELS.get(name.upper())
        if level is not None and level < _threshold and "loguru" not in sys.modules:
            return _drop
        return getattr(_loguru(), name)


logger: Any = _LazyLogger()
