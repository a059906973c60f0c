"""Loading the objects installed packages register under an entry-point group (plug-in ops
and source formats): one place that names a plug-in in errors and reports one that fails
to import as the plug-in's error, not ckptxform's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .errors import PluginError


def loaded_entry_points(group: str, what: str) -> Iterator[tuple[str, str, Any]]:
    """``(name, where, object)`` of each entry point of ``group``, in name order; ``where``
    names it in messages (``plug-in WHAT 'name' ('module:attr' from package 'pkg')``)."""
    from importlib.metadata import entry_points

    for ep in sorted(entry_points(group=group), key=lambda e: e.name):
        dist = getattr(ep, "dist", None)
        where = f"plug-in {what} {ep.name!r} ({ep.value!r}" + (f" from package {dist.name!r})" if dist else ")")
        try:
            loaded = ep.load()
        except Exception as err:  # a plug-in's import error is the plug-in's, named as such
            raise PluginError(f"{where}: cannot be loaded: {type(err).__name__}: {err}; fix or uninstall "
                              "the package") from err
        yield ep.name, where, loaded
