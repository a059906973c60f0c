"""Turn a location (a rule file's source, ``--source NAME=LOC``, a CLI argument) into a Checkpoint.

An existing local path wins; ``hf://ORG/NAME[@REV]`` is always the Hub; ``ORG/NAME[@REV]``
that is not a local path is the Hub; a Hub location may end in ``?fetch=POLICY``. The
syntax of a Hub location has one definition, ``hub.parse_hub_location``; this module only
adds the local-path-wins rule, and ``open_sources`` opens several sources at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import PathEncodingError, SourceNotFoundError, UsageError, quote
from ..fileio import is_utf8
from ..rules.model import SourceSpec
from .base import Checkpoint


def hub_location(location: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``location`` names a Hub repo rather than a local path.

    >>> hub_location("hf://org/model@v1")
    ('org/model', 'v1')
    """
    if not location.startswith("hf://") and Path(location).exists():
        return None
    from .hub.checkpoint import parse_hub_location  # the Hub client's modules, only for the Hub

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
    where, option = _split_fetch_option(location)
    where, gguf_file = _split_gguf_file(where)
    hub = hub_location(where)
    if hub is not None:
        from .hub.checkpoint import open_hub

        return open_hub(hub[0], hub[1], name=name, policy=option or fetch, location=location,
                        require_pinned=require_pinned, gguf_file=gguf_file)
    if option is not None:
        raise UsageError(f"{location!r}: ?fetch= is for Hub locations (ORG/NAME@REVISION?fetch={option}); "
                         f"{where!r} is a local path", source=name)
    if not Path(location).exists():
        label = f"source {name!r}: " if name else ""
        raise SourceNotFoundError(
            f"{label}{location!r} does not exist; give a local directory or file, "
            "or a Hub repo ORG/NAME[@REVISION]",
            path=location,
            source=name,
        )
    return _open_path(location, name)


def open_source(spec: SourceSpec, *, require_pinned: bool = False) -> Checkpoint:
    """Open a rule file's source, honouring a ``--source`` override."""
    if spec.override is None and spec.repo is not None:
        from .hub.checkpoint import open_hub

        return open_hub(spec.repo, spec.revision, name=spec.name, policy=spec.fetch,
                        location=spec.location, require_pinned=require_pinned)
    if spec.override is None and spec.path is not None:
        if not Path(spec.path).exists():
            raise SourceNotFoundError(
                f"source {spec.name!r} ({spec.where.short}): path {spec.path!r} does not exist; "
                f"fix the path or pass --source {spec.name}=LOCATION",
                path=spec.path,
                source=spec.name,
            )
        return _open_path(spec.path, spec.name)
    return open_location(spec.location, name=spec.name, fetch=spec.fetch, require_pinned=require_pinned)


def open_sources(specs: Sequence[SourceSpec], *, require_pinned: bool = False) -> dict[str, Checkpoint]:
    """Open every source of ``specs`` at once (a Hub source waits on round trips, not on
    the CPU), by name; on a failure, close the others and raise the first spec's error."""
    if len(specs) <= 1:
        return {spec.name: open_source(spec, require_pinned=require_pinned) for spec in specs}
    with ThreadPoolExecutor(max_workers=len(specs), thread_name_prefix="ckptxform-open") as pool:
        jobs = [pool.submit(open_source, spec, require_pinned=require_pinned) for spec in specs]
        errors = [job.exception() for job in jobs]
    failed = next((e for e in errors if e is not None), None)
    opened = {spec.name: job.result() for spec, job, e in zip(specs, jobs, errors) if e is None}
    if failed is not None:
        for ckpt in opened.values():
            ckpt.close()
        raise failed
    return opened


def inspect_location(location: str) -> tuple[Any, Any]:
    """What ``ckptxform inspect`` lists, and the kind of a local checkpoint: a DCP or
    torch_dist directory from its ``.metadata`` alone (``DcpListing``), a Megatron-LM save
    directory through the iteration it points at, anything else opened from its headers."""
    from .kind import detect_kind, megatron_iteration

    if location.startswith("hf://") or not Path(location).exists():
        return open_location(location), None
    kind = detect_kind(Path(location))
    if kind.kind == "megatron":
        inner = detect_kind(megatron_iteration(Path(location)))
        kind = type(kind)(inner.kind, inner.path, f"{kind.detail}: {inner.path}" + (f", {inner.detail}" if inner.detail else ""))
    if kind.kind in ("dcp", "torch_dist"):
        from .dcp import list_dcp

        return list_dcp(kind.path), kind
    return open_location(kind.path), kind


#: the files a built-in format opens; a file named otherwise is offered to plug-ins first
_BUILTIN_FILE_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth",
                          ".gguf")


def _open_path(path: str, name: str | None) -> Checkpoint:
    """A local checkpoint: a DCP directory (``.metadata`` + ``*.distcp``), Megatron's torch_dist
    (an iteration directory, or a save directory pointing at one), or safetensors/.bin files."""
    from .kind import detect_kind

    kind = detect_kind(Path(path)).kind if Path(path).is_dir() else None
    if kind == "gguf" or (kind is None and path.endswith(".gguf")):
        from .gguf import open_gguf

        return open_gguf(path, name=name)
    if kind in ("unknown", "assets") or (kind is None and not path.endswith(_BUILTIN_FILE_SUFFIXES)):
        opened = _open_with_plugin(path, name)
        if opened is not None:
            return opened
    if kind == "peft_adapter":
        from .peft_adapter import open_peft_adapter

        return open_peft_adapter(path, name=name)
    if kind in ("torch_dist", "megatron"):
        from .torch_dist import open_torch_dist

        return open_torch_dist(path, name=name)
    if kind == "dcp":
        from .dcp import open_dcp

        return open_dcp(path, name=name)
    from .local import has_weights, open_assets, open_local

    if Path(path).is_dir() and not has_weights(Path(path)) and (Path(path) / "config.json").is_file():
        return open_assets(path, name=name)  # config.json + tokenizer files only (torchtitan's hf_assets)
    try:
        return open_local(path, name=name)
    except SourceNotFoundError:  # no weights a built-in format knows: a plug-in's, perhaps
        opened = _open_with_plugin(path, name)
        if opened is None:
            raise
        return opened


def _open_with_plugin(path: str, name: str | None) -> Checkpoint | None:
    """``path`` opened by the first installed plug-in format that claims it, or None."""
    from .plugins import open_with_plugin, plugin_format_for

    fmt = plugin_format_for(Path(path))
    return open_with_plugin(fmt, path, name) if fmt is not None else None


def _split_fetch_option(location: str) -> tuple[str, str | None]:
    if "?" not in location:  # a local path: the Hub client's modules are not needed
        return location, None
    from .hub.fetch import split_fetch_option

    return split_fetch_option(location)


def _split_gguf_file(location: str) -> tuple[str, str | None]:
    """``ORG/NAME[@REV]/PATH.gguf`` that is not a local path: the Hub repo and the file."""
    if not location.endswith(".gguf") or (not location.startswith("hf://") and Path(location).exists()):
        return location, None
    from .hub.gguf import split_gguf_file

    return split_gguf_file(location)
