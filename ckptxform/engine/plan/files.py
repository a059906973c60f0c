"""A rule's ``files`` and the loader files its output carries (``output.loader_files``),
planned from the sources' file listings (engine/output/copied_files.py copies them whole
into the output with their sha256, and ``verify`` checks them again).

The plan lists files (a Hub source lists its repo tree: no file is fetched); ``apply``
fetches and copies only the files the plan copies. Weight files, their index and
``config.json`` are never candidates: tensors and the ``config`` section make those. Nor
is a file that defines what a directory is (a DCP ``.metadata``, Megatron's
``metadata.json``, ``common.pt`` and ``latest_checkpointed_iteration.txt``, a PEFT
``adapter_config.json``): a glob passes over them, and naming one is refused with the reason.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import PlanError, quote_keys
from ...filenames import AUDIT_FILE, defining_file_reason
from ...fileio import refuse_non_regular
from ...rules.file_rules import FileRule, path_problem
from ...rules.model import RuleSet
from ...sources.base import Checkpoint
from ...sources.local import LocalCheckpoint

CONFIG = "config.json"
_GLOB_SIGNS = re.compile(r"[*?\[]")


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


def _candidates(ckpt: Checkpoint) -> list[str]:
    weights = set(ckpt.files)
    return [f for f in ckpt.list_files()
            if f not in weights and f not in (CONFIG, AUDIT_FILE) and defining_file_reason(f) is None]


def _reserved(name: str, config_file: str) -> bool:
    """Names the output's own files take: weights, their index, its config, the audit."""
    return name.endswith(".safetensors") or name in (CONFIG, config_file, AUDIT_FILE)


def _refuse_defining(rule: FileRule, checkpoints: Mapping[str, Checkpoint]) -> None:
    """An entry naming a file that defines what a directory is (no glob sign in it) is refused,
    rather than said to match nothing: a glob only passes over such files."""
    reason = defining_file_reason(rule.glob)
    if rule.skip is None and not rule.carried and reason is not None and not _GLOB_SIGNS.search(rule.glob):
        raise PlanError(f"{rule.label}: {rule.glob!r} of source {rule.source!r} "
                        f"({checkpoints[rule.source].location}) is never copied: it is {reason}; remove the entry",
                        source=rule.source)


def plan_files(rules: RuleSet, checkpoints: Mapping[str, Checkpoint]) -> FilesPlan:
    """Which file of which source goes where; a non-optional entry that matches nothing, or
    two files meant for one output path, is a ``PlanError``."""
    file_rules = rules.all_file_rules
    if not file_rules:
        return FilesPlan()
    copies: dict[str, FileCopy] = {}
    skips: list[FileSkip] = []
    unmatched: list[tuple[str, int]] = []
    listed: dict[str, list[str]] = {}
    carried: list[tuple[FileCopy, FileRule]] = []
    for source in dict.fromkeys(r.source for r in file_rules):
        listed[source] = _candidates(checkpoints[source])
        entries = [r for r in file_rules if r.source == source]
        left = 0
        for path in listed[source]:
            rule = next((r for r in entries if r.matches(path)), None)
            if rule is None:
                left += 1
                continue
            if rule.skip is not None:
                skips.append(FileSkip(source, path, rule.where.short, rule.skip))
            elif rule.carried:
                carried.append((FileCopy(source, path, path, f"{rule.where.short}, output.loader_files"), rule))
            else:
                _add_copy(copies, FileCopy(source, path, rule.output_path(path), rule.where.short), rule,
                          rules.output.config_file)
        unmatched.append((source, left))
    for copy, rule in carried:
        # a loader file of the same name that a files entry copies (from another source) wins
        if copy.target not in copies:
            _add_copy(copies, copy, rule, rules.output.config_file)
    for rule in file_rules:
        _refuse_defining(rule, checkpoints)
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
    if problem is not None and rule.carried:
        raise PlanError(f"{rule.label}: source {copy.source!r} holds a loader file named {copy.path!r}, which "
                        f"{problem}; refused: remove or rename it in the source, or skip it with a files entry",
                        source=copy.source)
    if problem is not None:
        raise PlanError(f"{rule.label}: output path {copy.target!r} (for {copy.path!r}) {problem}; fix the rename",
                        source=copy.source)
    # the output's own files are at its top: a copy may not take their name, nor make it a folder
    top = copy.target.split("/", 1)[0]
    if (reason := defining_file_reason(copy.target)) is not None:
        raise PlanError(f"{rule.label}: would copy {copy.source}:{copy.path!r} to {copy.target!r}, which is {reason}; "
                        "rename it to another name", source=copy.source)
    if _reserved(top, config_file):
        under = "" if top == copy.target else f", under {top!r}"
        raise PlanError(f"{rule.label}: would copy {copy.source}:{copy.path!r} to {copy.target!r}{under}, a name "
                        "the output's weights, config.json or audit take; skip the file or rename it",
                        source=copy.source)
    earlier = copies.get(copy.target)
    if earlier is not None:
        raise PlanError(f"{rule.label}: {copy.source}:{copy.path!r} and {earlier.source}:{earlier.path!r} would "
                        f"both be copied to {copy.target!r}; rename one (rename: may use {{path}})",
                        source=copy.source)
    parts = copy.target.split("/")
    folders = ("/".join(parts[:i]) for i in range(1, len(parts)))
    clash = next((t for t in folders if t in copies), None) or \
        next((t for t in copies if t.startswith(copy.target + "/")), None)
    if clash is not None:
        other = copies[clash]
        raise PlanError(f"{rule.label}: {copy.source}:{copy.path!r} would be copied to {copy.target!r} and "
                        f"{other.source}:{other.path!r} to {clash!r}: one path cannot be a file and a folder; "
                        "rename one (rename: may use {path})", source=copy.source)
    copies[copy.target] = copy

