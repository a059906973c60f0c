"""Where the shipped schema and rule library are, in a checkout or an installed wheel."""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
# In a wheel, pyproject's package-dir installs schemas/ and rules/ inside the package;
# in a checkout (and an editable install) they sit beside it.
_CANDIDATES = {
    "schemas": (_PACKAGE / "schemas", _PACKAGE.parent / "schemas"),
    "rules": (_PACKAGE / "rule_library", _PACKAGE.parent / "rules"),
}


def data_dir(kind: str) -> Path:
    """The folder of shipped ``schemas`` or ``rules``."""
    for candidate in _CANDIDATES[kind]:
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"ckptxform's {kind} folder is missing from this installation; reinstall ckptxform")
