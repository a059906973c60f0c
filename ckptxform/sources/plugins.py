"""Source formats that installed packages add, through the entry-point group
``ckptxform.sources``: a local path no built-in format recognises is offered to them.

A plug-in format is an object (or a class made without arguments) with::

    name: str                                        # e.g. "npz"
    label: str                                       # what `ckptxform inspect` calls it
    def detect(self, path: pathlib.Path) -> bool     # file names and small files only
    def open(self, path: str, name: str | None) -> ckptxform.sources.base.Checkpoint

registered in its package's metadata (``[project.entry-points."ckptxform.sources"]``,
``npz = "my_package.npz_source:NpzFormat"``). What it opens is a ``Checkpoint`` like the
built-in ones (headers first, bytes by range), so the planner, the executor and the audit
treat it as they treat them. Plug-ins are looked up only for a path no built-in format
claims: a run on built-in formats never scans the installed packages' metadata.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from ..entry_points import loaded_entry_points
from ..errors import PluginError
from .base import Checkpoint

ENTRY_POINT_GROUP = "ckptxform.sources"


@lru_cache(maxsize=1)
def plugin_formats() -> tuple[Any, ...]:
    """The installed plug-in formats, loaded and checked, by name."""
    found = []
    for name, where, loaded in loaded_entry_points(ENTRY_POINT_GROUP, "source format"):
        fmt = loaded() if isinstance(loaded, type) else loaded
        missing = [a for a in ("name", "label", "detect", "open") if not hasattr(fmt, a)]
        if missing:
            raise PluginError(f"{where}: a source format needs {', '.join(missing)} (see ckptxform.sources.plugins)")
        if fmt.name != name:
            raise PluginError(f"{where}: the entry point's name must be the format's name, and it says {fmt.name!r}")
        found.append(fmt)
    return tuple(found)


def plugin_format_for(path: Path) -> Any | None:
    """The first plug-in format that claims ``path``, or None."""
    for fmt in plugin_formats():
        if fmt.detect(path):
            return fmt
    return None


def open_with_plugin(fmt: Any, path: str, name: str | None) -> Checkpoint:
    """``path`` opened by plug-in format ``fmt``, held to the ``Checkpoint`` contract."""
    opened = fmt.open(path, name)
    if not isinstance(opened, Checkpoint):
        raise PluginError(f"plug-in source format {fmt.name!r}: open() returned {type(opened).__name__}, "
                          "not a ckptxform.sources.base.Checkpoint")
    return opened
