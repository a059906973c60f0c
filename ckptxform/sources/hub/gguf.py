"""A GGUF model in a Hub repo (one ``.gguf`` file or llama.cpp's split set
``NAME-00001-of-0000N.gguf``): its headers read by byte range, only as far as each header
goes, its tensors then read like a safetensors file's (``HubCheckpoint`` reads by range or
downloads, as its fetch policy says).

Which model: the file the location names (``ORG/NAME[@REV]/PATH.gguf``, a split set by
its first part), else the repo's only GGUF model; a repo of several (one per quant type,
as most GGUF repos are) is refused, listing them.
"""

from __future__ import annotations

import re
from typing import Any

from ckptxform.errors import EntryNotFoundError, SourceNotFoundError
from ckptxform.sources.gguf import (
    GgufTensor,
    first_parts,
    gguf_config,
    gguf_index,
    read_gguf_prefix,
    split_parts,
    tokenizer_notes,
)

#: a ``hub.checkpoint.HubCheckpoint`` (not imported: it imports this module)
HubCheckpoint = Any

#: ``ORG/NAME[@REV]/PATH.gguf``: a revision without a slash, a path inside the repo
_FILE_LOCATION = re.compile(r"(?P<repo>(?:hf://)?[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*"
                            r"(?:@[^/@\s]+)?)/(?P<file>[^@\s]+\.gguf)")


def split_gguf_file(location: str) -> tuple[str, str | None]:
    """``(ORG/NAME[@REV], PATH)`` for a Hub location naming a ``.gguf`` file in the repo,
    ``(location, None)`` otherwise.

    >>> split_gguf_file("org/model-GGUF@main/model-Q4_K_M.gguf")
    ('org/model-GGUF@main', 'model-Q4_K_M.gguf')
    >>> split_gguf_file("org/model@v1")
    ('org/model@v1', None)
    """
    match = _FILE_LOCATION.fullmatch(location)
    if match is None:
        return location, None
    return match["repo"], match["file"]


def gguf_models(files: tuple[str, ...]) -> list[str]:
    """The GGUF models of a repo's files: single files and first parts of split sets."""
    return [f for f in files if first_parts([f.rsplit("/", 1)[-1]])]


def choose_model(ckpt: HubCheckpoint, files: tuple[str, ...], wanted: str | None) -> list[str]:
    """The parts (repo paths) of the GGUF model to read: ``wanted``'s, else the only one."""
    if wanted is None:
        models = gguf_models(files)
        if len(models) != 1:
            shown = ", ".join(map(repr, models[:12])) + (" and more" if len(models) > 12 else "")
            raise SourceNotFoundError(f"{ckpt._who()}: holds {len(models)} GGUF models ({shown or 'none'}); name "
                                      f"one: {ckpt.repo_id}@{ckpt.commit}/FILE.gguf (a split set by its "
                                      "-00001-of- part)", source=ckpt.name)
        wanted = models[0]
    folder, _, name = wanted.rpartition("/")
    parts = [f"{folder}/{p}" if folder else p for p in split_parts(name)]
    if parts[0] != wanted:
        raise SourceNotFoundError(f"{ckpt._who()}: {wanted!r} is part of a split set; name its first part "
                                  f"{parts[0]!r}", source=ckpt.name)
    missing = [p for p in parts if p not in files]
    if missing:
        raise EntryNotFoundError(f"{ckpt._who()}: commit {ckpt.commit} has no {', '.join(map(repr, missing[:4]))}"
                                 f"{ckpt._listing()}", source=ckpt.name, path=missing[0])
    return parts


def index_gguf(ckpt: HubCheckpoint, parts: list[str]) -> tuple[dict[str, Any], dict[str, GgufTensor]]:
    """The metadata and tensors of the model in ``parts``, from their headers alone."""
    from ckptxform.sources.hub.ranges import Span

    read: list[tuple[str, dict[str, Any], list[GgufTensor]]] = []
    for file in parts:
        size = ckpt._size(file) or 0

        def fetch(start: int, stop: int, file: str = file) -> bytes:
            return ckpt._read_spans(file, [Span(start, stop)], headers=True)[0]

        read.append((file, *read_gguf_prefix(fetch, size, file, ckpt._label(file))))
    return gguf_index(read, ckpt._label("").rstrip("/"))


def open_gguf_model(ckpt: HubCheckpoint, wanted: str | None, files: tuple[str, ...] | None = None) -> None:
    """Make ``ckpt`` the GGUF model ``wanted`` (or the repo's only one): files, tensors,
    config, and the attributes a local GGUF checkpoint has (``ggml_types``, ...)."""
    parts = choose_model(ckpt, files if files is not None else ckpt.list_files(), wanted)
    metadata, tensors = index_gguf(ckpt, parts)
    ckpt.files = tuple(parts)
    ckpt.tensors = {k: t.info for k, t in tensors.items()}
    ckpt.ggml_types = {k: t.ggml_type for k, t in tensors.items()}
    ckpt.logical_shapes = {k: t.logical_shape for k, t in tensors.items()}
    ckpt.gguf_metadata = dict(metadata)
    ckpt._config = gguf_config(metadata, ckpt.ggml_types, ckpt.logical_shapes)
    ckpt.notes = tokenizer_notes(metadata)
