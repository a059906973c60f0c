"""The audit log: ``OUT/ckptxform_audit.jsonl``, one JSON object per line (format fixed in design.md).

``run`` first, one ``tensor`` per tensor of every file the run opened, one ``written`` per
output tensor, ``summary`` last. No secret is ever written: locations are what the user
gave, and tokens never reach the plan.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from .. import __version__

if TYPE_CHECKING:  # the planner imports engine.files, which needs AUDIT_FILE from here
    from .planner import Plan

AUDIT_FILE = "ckptxform_audit.jsonl"


def run_event(plan: Plan, started: datetime) -> dict[str, Any]:
    rules = plan.rules
    return {
        "event": "run",
        "rules": rules.path,
        "rules_sha256": rules.sha256,
        "name": rules.name,
        "sources": {name: record.to_dict() for name, record in plan.sources.items()},
        "version": __version__,
        "started": started.isoformat(timespec="seconds"),
    }


class AuditLog:
    """Appends events to the audit file as the run goes, so its order is the run's order."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] = path.open("w", encoding="utf-8")

    def event(self, obj: dict[str, Any]) -> None:
        self._file.write(json.dumps(obj, ensure_ascii=False, separators=(", ", ": ")) + "\n")

    def close(self) -> None:
        self._file.close()


def started_now() -> datetime:
    return datetime.now(timezone.utc)
