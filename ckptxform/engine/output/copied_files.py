"""A rule's planned ``files`` copied whole into the output, each hashed (sha256) as it is
written; a rerun's and ``verify``'s checks of them against the audit."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import NotAFileError, SourceNotFoundError, io_error
from ...filenames import AUDIT_FILE
from ...fileio import open_regular
from ...rules.file_rules import path_problem
from ...sources.base import Checkpoint
from ...sources.pins import check_unchanged, pin_fd
from ..plan.files import FileCopy, FilesPlan

_CHUNK = 1 << 20


@dataclass(frozen=True)
class CopiedFile:
    copy: FileCopy
    nbytes: int
    sha256: str

    def to_event(self) -> dict[str, Any]:
        return {**self.copy.to_event(), "bytes": self.nbytes, "sha256": self.sha256}


def copy_files(files: FilesPlan, checkpoints: Mapping[str, Checkpoint], dest: Path) -> tuple[CopiedFile, ...]:
    """Copy every planned file into ``dest`` (Hub sources fetch just these files), hashing
    the bytes as they are written."""
    out = []
    for copy in files.copies:
        source = checkpoints[copy.source].file_path(copy.path)
        target = dest / copy.target
        digest, size = hashlib.sha256(), 0
        try:
            reader = open_regular(source)
        except NotAFileError:
            raise
        except OSError as err:
            raise SourceNotFoundError(f"source {copy.source!r}: cannot read {copy.path!r} ({err.strerror or err}); "
                                      "it was listed when the plan was made", source=copy.source,
                                      path=str(source)) from None
        with reader:
            pin = pin_fd(source, reader.fileno())
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                with target.open("xb") as writer:
                    while chunk := reader.read(_CHUNK):
                        writer.write(chunk)
                        digest.update(chunk)
                        size += len(chunk)
            except OSError as err:
                raise io_error("writing", target, err) from None
        check_unchanged([pin])  # a file written to while it was copied would be copied mixed
        out.append(CopiedFile(copy, size, digest.hexdigest()))
    return tuple(out)


def copied_files_changed(files: FilesPlan, checkpoints: Mapping[str, Checkpoint],
                         events: list[dict[str, Any]]) -> list[str]:
    """For a rerun: what differs between the files this plan copies and those an earlier
    run's audit ``events`` record (a Hub source's commit, checked with the weights, pins
    its files; a local file is hashed again)."""
    recorded = {(e.get("source"), e.get("path"), e.get("file")): e.get("sha256") for e in events
                if e.get("event") == "file" and e.get("action") == "copied"}
    planned = {(c.source, c.path, c.target): c for c in files.copies}
    if set(recorded) != set(planned):
        return [f"other files: {len(recorded)} copied then, {len(planned)} to copy now (the rules' files "
                "section or the sources' files changed)"]
    changed = []
    for key, copy in sorted(planned.items()):
        ckpt = checkpoints[copy.source]
        if ckpt.commit is None and _sha256_of(ckpt.file_path(copy.path)) != recorded[key]:
            changed.append(f"another {copy.path!r} of source {copy.source!r} (its sha256 changed since)")
    return changed


def _sha256_of(path: Path) -> str | None:
    try:
        return _sha256(path)
    except OSError:
        return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open_regular(path) as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def check_copied_files(root: Path, events: list[dict[str, Any]]) -> list[str]:
    """``verify``: each file the audit says was copied is in ``root`` with the same sha256."""
    problems = []
    for event in events:
        if event.get("event") != "file" or event.get("action") != "copied":
            continue
        name, recorded = event.get("file"), event.get("sha256")
        if not isinstance(name, str) or path_problem(name) or not isinstance(recorded, str):
            problems.append(f"{root / AUDIT_FILE}: a copied-file event needs a relative 'file' and its 'sha256'; "
                            "the audit log is damaged")
            continue
        path = root / name
        try:
            digest = _sha256(path)
        except OSError as err:
            why = f"is {err.kind}, not a regular file" if isinstance(err, NotAFileError) else err.strerror or err
            problems.append(f"{path}: {why}; apply copied it from source "
                            f"{event.get('source')!r} ({event.get('path')!r})")
            continue
        if digest != recorded:
            problems.append(f"{path}: sha256 {digest[:12]}... differs from the audit's "
                            f"{recorded[:12]}...; the file was changed after apply")
    return problems
