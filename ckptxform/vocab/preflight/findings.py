"""What ``preflight`` reports: findings (one thing a consumer will get silently wrong, and
the fix) and the report that groups them by consumer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Finding:
    """One thing ``consumer`` will load wrong (or refuse) in the checked checkpoint.

    ``check`` is a stable name scripts can branch on (``t2d-mask``, ``aux-ids-range``...);
    ``subject`` the config field or tensor; ``effect`` what that consumer does with it;
    ``fix`` how to repair it; ``rule`` a shipped rule that would, when there is one."""

    consumer: str
    check: str
    subject: str
    effect: str
    fix: str
    rule: str | None = None

    def text(self) -> str:
        rule = f" (rule: {self.rule})" if self.rule else ""
        return f"{self.subject}: {self.effect}; fix: {self.fix}{rule}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PreflightReport:
    """Every finding for every consumer asked about, and what could not be checked."""

    location: str
    family: str
    layout: str
    consumers: tuple[str, ...]
    findings: tuple[Finding, ...]
    #: checks skipped for want of an input (e.g. no verifier given): never a finding
    unchecked: tuple[str, ...] = field(default=())
    verifier: str | None = None
    #: advisories that put no consumer at risk of loading wrong (a special token outside
    #: the draft vocabulary costs acceptance at that token only)
    notes: tuple[str, ...] = field(default=())

    @property
    def exit_code(self) -> int:
        """0 when no consumer is at risk, 1 when one is."""
        return 1 if self.findings else 0

    def for_consumer(self, consumer: str) -> list[Finding]:
        return [f for f in self.findings if f.consumer == consumer]

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": "at_risk" if self.findings else "ok",
            "location": self.location,
            "verifier": self.verifier,
            "family": self.family,
            "layout": self.layout,
            "consumers": {c: [f.to_dict() for f in self.for_consumer(c)] for c in self.consumers},
            "unchecked": list(self.unchecked),
            "notes": list(self.notes),
        }

    def text(self) -> str:
        what = "no drafter config (model checks only)" if self.family == "model" else f"{self.family} drafter"
        lines = [f"{self.location}: {what}, {self.layout} layout"
                 + (f", verifier {self.verifier}" if self.verifier else "")]
        for consumer in self.consumers:
            found = self.for_consumer(consumer)
            lines.append(f"{consumer}: " + (f"{len(found)} finding{'s' if len(found) != 1 else ''}" if found
                                              else "ok"))
            lines.extend(f"  - {f.text()}" for f in found)
        lines.extend(f"note: {n}" for n in self.notes)
        lines.extend(f"not checked: {u}" for u in self.unchecked)
        return "\n".join(lines)


def for_each(consumers: Sequence[str], check: str, subject: str, effect: str, fix: str,
             rule: str | None = None) -> list[Finding]:
    """The same finding for several consumers."""
    return [Finding(c, check, subject, effect, fix, rule) for c in consumers]
