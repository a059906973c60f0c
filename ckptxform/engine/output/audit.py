"""The audit log: ``OUT/ckptxform_audit.jsonl``, one JSON object per line (format fixed in design.md).

``run`` first, one ``tensor`` per tensor of every file the run opened, one ``written`` per
output tensor, ``summary`` last. No secret is ever written: locations are what the user
gave, and tokens never reach the plan.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ..._version import __version__
from ...errors import quote_keys, redact
from ...filenames import AUDIT_FILE, CONFIG_FILE

if TYPE_CHECKING:
    from .digest import RunDigest
    from ..plan.planner import Plan

_SHARD = re.compile(r"(.+)-\d{5}-of-\d{5}\.safetensors")


def run_event(plan: Plan, started: datetime, digest: RunDigest) -> dict[str, Any]:
    rules = plan.rules
    return {
        "event": "run",
        "rules": rules.path,
        "rules_sha256": rules.sha256,
        "name": rules.name,
        "sources": {name: record.to_dict() for name, record in plan.sources.items()},
        "version": __version__,
        "started": started.isoformat(timespec="seconds"),
        **digest.record_fields(),
    }


def not_an_earlier_output(out: Path) -> str | None:
    """Why ``out`` is not purely an earlier output of ``ckptxform apply``, or None when it is:
    a directory whose audit log starts with a run record and ends with the ok summary of a
    completed run, holding nothing but the weight files that summary lists, their shard
    index, config.json, the files the audit says were copied, and the audit. Only such a
    directory may be replaced (``--force``). The reason follows "OUT already exists and"."""
    if not out.is_dir():
        return "is not a directory"
    path = out / AUDIT_FILE
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        return f"has no {AUDIT_FILE}, so ckptxform did not write it"
    except OSError as err:
        return f"has a {AUDIT_FILE} that cannot be read ({err.strerror or err})"
    first, last = (_event(lines[0]), _event(lines[-1])) if lines else (None, None)
    if first is None or first.get("event") != "run":
        return f"has a {AUDIT_FILE} that does not start with the run record of ckptxform apply"
    files = last.get("files") if last is not None and last.get("event") == "summary" else None
    if last is None or last.get("status") != "ok" or not isinstance(files, list):
        return f"has a {AUDIT_FILE} that does not end with the summary of a completed run"
    written = {AUDIT_FILE, str(last.get("config_file", CONFIG_FILE)), *map(str, files)}
    written |= {f"{m.group(1)}.safetensors.index.json" for f in written if (m := _SHARD.fullmatch(f))}
    written |= {str(e["file"]) for line in lines if b'"event": "file"' in line
                and (e := _event(line)) is not None and e.get("action") == "copied" and "file" in e}
    foreign = _not_written(out, written)
    if foreign:
        return f"holds {quote_keys(foreign, 3)}, which ckptxform did not write there"
    return None


def _not_written(out: Path, written: set[str]) -> list[str]:
    """Entries under ``out`` (relative paths) that are neither one of the ``written`` files
    nor a folder holding one; links count as foreign (replacing OUT would not remove
    their targets, but they are not ckptxform's)."""
    folders = {str(parent) for name in written for parent in Path(name).parents if str(parent) != "."}
    foreign = []
    for path in out.rglob("*"):
        name = str(path.relative_to(out))
        mine = (name in written and path.is_file()) or (name in folders and path.is_dir())
        if path.is_symlink() or not mine:
            foreign.append(name)
    return foreign


def _event(line: bytes) -> dict[str, Any] | None:
    try:
        event = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return event if isinstance(event, dict) else None


#: ``json.dumps(obj, ensure_ascii=False, separators=(", ", ": "))``, its encoder made once
#: (json.dumps with arguments builds one per call: per tensor)
_LINE = json.JSONEncoder(ensure_ascii=False, separators=(", ", ": "))


class AuditLog:
    """Appends events to the audit file as the run goes, so its order is the run's order."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # binary, encoded here: the byte offset of each line is known (``event``'s answer)
        self._file: IO[bytes] = path.open("wb")
        self._at = 0

    def event(self, obj: dict[str, Any]) -> int:
        """Append ``obj`` as a line; the byte offset in the file where that line starts."""
        # redacted as text: whatever field a server's words reached, no token is written
        line = (redact(_LINE.encode(obj)) + "\n").encode("utf-8")
        self._file.write(line)
        at, self._at = self._at, self._at + len(line)
        return at

    def close(self) -> None:
        self._file.close()


def started_now() -> datetime:
    return datetime.now(timezone.utc)
