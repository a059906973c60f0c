"""The shipped rule library: rule files found by file stem or by their ``name:``.

Wherever a command or ``extends:`` takes a rule file, a shipped rule can be named
instead: ``aqmedai_k2_to_k25`` (its file stem) or ``aqmedai-k2-to-k25`` (its ``name:``).
A local file always wins, so a user's own file of that name is never shadowed (a
directory of that name does not: it cannot be a rule file).

>>> locate_rules("aqmedai-k2-to-k25").endswith("aqmedai_k2_to_k25.yaml")
True
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path

from .._data import data_dir
from ..errors import RuleError
from .yaml_source import read_yaml

_SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True)
class ShippedRule:
    """A rule file of the library, as ``ckptxform rules`` lists it."""

    stem: str
    name: str
    description: str
    path: Path
    #: source name -> its default location (a Hub repo ``ORG/NAME@REV`` or a path)
    sources: dict[str, str]
    extends: str | None

    def to_dict(self) -> dict[str, object]:
        return {"stem": self.stem, "name": self.name, "description": self.description, "path": str(self.path),
                "sources": self.sources, "extends": self.extends}


def _library_files() -> list[Path]:
    return sorted(p for p in data_dir("rules").iterdir() if p.suffix in _SUFFIXES and p.is_file())


def _declared_name(path: Path) -> str | None:
    data = read_yaml(path, str(path)).data
    name = data.get("name") if isinstance(data, dict) else None
    return name if isinstance(name, str) else None


def shipped_rule_path(name: str) -> Path | None:
    """The library file whose stem or ``name:`` is ``name``, or None."""
    files = _library_files()
    for path in files:
        if path.stem == name or path.name == name:
            return path
    for path in files:
        if _declared_name(path) == name:
            return path
    return None


def _looks_like_a_path(text: str) -> bool:
    return os.sep in text or "/" in text or text.endswith(_SUFFIXES)


def locate_rules(rules: str | os.PathLike[str]) -> str:
    """The rule file to read for ``rules``: a local file when one exists, else the shipped
    rule of that stem or name. A bare name that is neither is a ``RuleError`` listing the
    library; a missing path is left to the loader, which says "file not found"."""
    text = os.fspath(rules)
    # a directory is never a rule file: an output named after the rule (`--out
    # aqmedai_k2_to_k25`) must not hide the rule from the next run
    if os.path.exists(text) and not os.path.isdir(text):
        return text
    shipped = shipped_rule_path(text)
    if shipped is not None:
        return str(shipped)
    if _looks_like_a_path(text) or os.path.exists(text):
        return text
    stems = [p.stem for p in _library_files()]
    close = difflib.get_close_matches(text.replace("-", "_"), stems, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise RuleError([f"{text!r}: no such rule file, and no shipped rule has that file stem or name "
                     f"(shipped: {', '.join(stems)}; `ckptxform rules` describes them){hint}"], path=text)
