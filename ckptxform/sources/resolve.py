"""Turn a location (a rule file's source, ``--source NAME=LOC``, a CLI argument) into a Checkpoint.

An existing local path wins; ``hf://ORG/NAME[@REV]`` is always the Hub; ``ORG/NAME[@REV]``
that is not a local path is the Hub. The syntax of a Hub location has one definition,
``hub.parse_hub_location``; this module only adds the local-path-wins rule.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import PathEncodingError, SourceNotFoundError, quote
from ..fileio import is_utf8
from ..rules.model import SourceSpec
from .base import Checkpoint
from .hub import parse_hub_location


def hub_location(location: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``location`` names a Hub repo rather than a local path.

    >>> hub_location("hf://org/model@v1")
    ('org/model', 'v1')
    """
    if not location.startswith("hf://") and Path(location).exists():
        return None
    return parse_hub_location(location)


def open_location(location: str, *, name: str | None = None, fetch: str = "auto",
                  require_pinned: bool = False) -> Checkpoint:
    """Open a local directory/file or a Hub repo, reading headers only.

    ``require_pinned`` refuses a Hub revision that is a branch or tag (it has no effect
    on local paths, which have no revision)."""
    if not is_utf8(location):
        label = f"source {name!r}: " if name else ""
        raise PathEncodingError(
            f"{label}path {quote(location)} is not valid UTF-8; the audit log records every source's "
            "location as text: rename it (or link it under a UTF-8 name)", path=location, source=name)
    hub = hub_location(location)
    if hub is not None:
        from .hub import open_hub

        return open_hub(hub[0], hub[1], name=name, policy=fetch, location=location,
                        require_pinned=require_pinned)
    if not Path(location).exists():
        label = f"source {name!r}: " if name else ""
        raise SourceNotFoundError(
            f"{label}{location!r} does not exist; give a local directory or file, "
            "or a Hub repo ORG/NAME[@REVISION]",
            path=location,
            source=name,
        )
    from .local import open_local

    return open_local(location, name=name)


def open_source(spec: SourceSpec, *, require_pinned: bool = False) -> Checkpoint:
    """Open a rule file's source, honouring a ``--source`` override."""
    if spec.override is None and spec.repo is not None:
        from .hub import open_hub

        return open_hub(spec.repo, spec.revision, name=spec.name, policy=spec.fetch,
                        location=spec.location, require_pinned=require_pinned)
    if spec.override is None and spec.path is not None:
        from .local import open_local

        if not Path(spec.path).exists():
            raise SourceNotFoundError(
                f"source {spec.name!r} ({spec.where.short}): path {spec.path!r} does not exist; "
                f"fix the path or pass --source {spec.name}=LOCATION",
                path=spec.path,
                source=spec.name,
            )
        return open_local(spec.path, name=spec.name)
    return open_location(spec.location, name=spec.name, fetch=spec.fetch, require_pinned=require_pinned)
