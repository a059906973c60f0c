"""A rule's ``files``: planned from the sources' file listings, copied whole into the output
with their sha256, checked again by ``verify``.

The plan lists files (a Hub source lists its repo tree: no file is fetched); ``apply``
fetches and copies only the files the plan copies. Weight files, their index and
``config.json`` are never candidates: tensors and the ``config`` section make those.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import NotAFileError, PlanError, SourceNotFoundError, quote_keys
from ..fileio import open_regular, refuse_non_regular
from ..rules.file_rules import FileRule, path_problem
from ..rules.model import RuleSet
from ..sources.base import Checkpoint
from ..sources.local import LocalCheckpoint
from ..sources.pins import check_unchanged, pin_fd
from .audit import AUDIT_FILE
from .outdir import io_error

CONFIG = "config.json"
_WEIGHT_INDEX = re.compile(r".*\.(safetensors|bin)\.index\.json")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileCopy:
    """Source file ``path`` of ``source`` is copied to ``target`` in the output."""

    source: str
    path: str
    target: str
    rule: str

    def to_event(self) -> dict[str, Any]:
        """The plan's record (the audit's adds ``bytes`` and ``sha256``)."""
        return {"event": "file", "action": "copied", "source": self.source, "path": self.path, "file": self.target,
                "rule": self.rule}


@dataclass(frozen=True)
class FileSkip:
    source: str
    path: str
    rule: str
    reason: str

    def to_event(self) -> dict[str, Any]:
        return {"event": "file", "action": "skipped", "source": self.source, "path": self.path,
                "rule": self.rule, "reason": self.reason}


@dataclass(frozen=True)
class FilesPlan:
    copies: tuple[FileCopy, ...] = ()
    skips: tuple[FileSkip, ...] = ()
    #: candidate files that no entry matched, per source (not copied)
    unmatched: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class CopiedFile:
    copy: FileCopy
    nbytes: int
    sha256: str

    def to_event(self) -> dict[str, Any]:
        return {**self.copy.to_event(), "bytes": self.nbytes, "sha256": self.sha256}


def _candidates(ckpt: Checkpoint) -> list[str]:
    weights = set(ckpt.files)
    return [f for f in ckpt.list_files()
            if f not in weights and f not in (CONFIG, AUDIT_FILE) and not _WEIGHT_INDEX.fullmatch(f)]


def _reserved(target: str, config_file: str) -> bool:
    """Names the output's own files take: weights, their index, its config, the audit."""
    return "/" not in target and (target.endswith(".safetensors") or target in (CONFIG, config_file, AUDIT_FILE)
                                  or _WEIGHT_INDEX.fullmatch(target) is not None)


def plan_files(rules: RuleSet, checkpoints: Mapping[str, Checkpoint]) -> FilesPlan:
    """Which file of which source goes where; a non-optional entry that matches nothing, or
    two files meant for one output path, is a ``PlanError``."""
    if not rules.file_rules:
        return FilesPlan()
    copies: dict[str, FileCopy] = {}
    skips: list[FileSkip] = []
    unmatched: list[tuple[str, int]] = []
    listed: dict[str, list[str]] = {}
    for source in dict.fromkeys(r.source for r in rules.file_rules):
        listed[source] = _candidates(checkpoints[source])
        entries = [r for r in rules.file_rules if r.source == source]
        left = 0
        for path in listed[source]:
            rule = next((r for r in entries if r.matches(path)), None)
            if rule is None:
                left += 1
                continue
            if rule.skip is not None:
                skips.append(FileSkip(source, path, rule.where.short, rule.skip))
            else:
                _add_copy(copies, FileCopy(source, path, rule.output_path(path), rule.where.short), rule,
                          rules.output.config_file)
        unmatched.append((source, left))
    for rule in rules.file_rules:
        # an entry shadowed by earlier ones (a child's, under extends) is not an error
        if not rule.optional and rule.skip is None and not any(map(rule.matches, listed[rule.source])):
            ckpt = checkpoints[rule.source]
            raise PlanError(
                f"{rule.label}: glob {rule.glob!r} matches no file of source {rule.source!r} ({ckpt.location}), "
                f"which holds {quote_keys(listed[rule.source])} besides its weights; fix the glob, or add "
                "optional: true if the file may be absent", source=rule.source)
    for copy in copies.values():
        ckpt = checkpoints[copy.source]
        if isinstance(ckpt, LocalCheckpoint):
            # known before a byte is read, so the plan says it: a link out of the source
            # (file_path refuses it), a FIFO or device in a file's place
            refuse_non_regular(ckpt.file_path(copy.path))
    return FilesPlan(tuple(copies[t] for t in sorted(copies)), tuple(skips), tuple(unmatched))


def _add_copy(copies: dict[str, FileCopy], copy: FileCopy, rule: FileRule, config_file: str) -> None:
    problem = path_problem(copy.target)
    if problem is not None:
        raise PlanError(f"{rule.label}: output path {copy.target!r} (for {copy.path!r}) {problem}; fix the rename",
                        source=copy.source)
    if _reserved(copy.target, config_file):
        raise PlanError(f"{rule.label}: would copy {copy.source}:{copy.path!r} to {copy.target!r}, a name the "
                        "output's weights, config.json or audit take; skip the file or rename it",
                        source=copy.source)
    earlier = copies.get(copy.target)
    if earlier is not None:
        raise PlanError(f"{rule.label}: {copy.source}:{copy.path!r} and {earlier.source}:{earlier.path!r} would "
                        f"both be copied to {copy.target!r}; rename one (rename: may use {{path}})",
                        source=copy.source)
    copies[copy.target] = copy


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
