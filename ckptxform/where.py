"""``Where``: a position in a rule file, shared by the rules (which read positions) and the
ops and plan (which name them in errors) without either importing the other."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class Where:
    """A position in a rule file, 1-based like editors show it."""

    file: str
    line: int
    col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"

    @cached_property
    def short(self) -> str:
        """``FILE:LINE``, the form used in the audit log (made once: a plan's records name
        their rule's position, two strings a tensor when it was made per call)."""
        return f"{self.file}:{self.line}"
