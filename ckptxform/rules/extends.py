"""``extends``: the chain of rule documents a file builds on, read base first (a base is a
path relative to the file, or a shipped rule's stem or name; cycles are refused), and
folded into one view in which the child wins: named entries replace the base's, its
``tensors`` and ``files`` are tried first, ``require`` and ``output`` merge field by field.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import RuleError
from ..fileio import special_kind
from .library import shipped_rule_path
from .schema_check import format_path, plain
from .yaml_source import Where, YamlDocument, read_yaml


@dataclass(frozen=True)
class Node:
    """A value of the merged rule data and the document (file) it was written in."""

    doc: YamlDocument
    path: tuple[str | int, ...]
    value: Any

    def where(self, *sub: str | int, key: bool = False) -> Where:
        return self.doc.where(self.path + sub, key=key)

    def at(self, *sub: str | int, key: bool = False) -> str:
        """``FILE:LINE:COL: PATH:`` prefix for a message about ``sub``."""
        return f"{self.where(*sub, key=key)}: {format_path(self.path + sub)}:"


#: the longest extends chain read (a variant of a variant of a shipped rule is three)
MAX_EXTENDS = 32


def read_chain(path: Path, label: str, seen: tuple[tuple[Path, str], ...]) -> list[YamlDocument]:
    """The documents of the extends chain, base first. ``seen``: (resolved, label) of the children.
    Read in a loop, not recursively, and refused past MAX_EXTENDS files."""
    docs: list[YamlDocument] = []
    chain = list(seen)
    while True:
        doc = read_yaml(path, label)
        docs.append(doc)
        base = doc.data.get("extends") if isinstance(doc.data, dict) else None
        if not isinstance(base, str) or not base:
            return docs[::-1]
        where = doc.where(("extends",))
        chain.append((path.resolve(), label))
        if len(chain) >= MAX_EXTENDS:
            raise RuleError([f"{where}: extends: {base!r}: the extends chain is longer than {MAX_EXTENDS} files "
                             f"(from {plain(chain[0][1])}); fold some of its files into one"], path=label)
        path, label = _base_path(base, label, where, chain)


def _base_path(base: str, label: str, where: Where, chain: list[tuple[Path, str]]) -> tuple[Path, str]:
    """The file ``extends: base`` in ``label`` names: beside it, else a shipped rule."""
    base_label = os.path.normpath(os.path.join(os.path.dirname(label), base))
    if not Path(base_label).is_file():  # a file beside this one wins over the library
        shipped = shipped_rule_path(base)
        base_label = str(shipped) if shipped is not None else base_label
    if (kind := special_kind(base_label)) is not None:  # worded as for the top-level rule path
        raise RuleError([f"{where}: extends: {base!r} is {kind}, not a regular file ({plain(base_label)}); "
                         "give the path of a YAML file"], path=label)
    if not Path(base_label).is_file():
        raise RuleError([f"{where}: extends: {base!r} not found (looked for {plain(base_label)})"], path=label)
    # Reported at the extends that closes the loop, with the loop spelled out.
    if Path(base_label).resolve() in [p for p, _ in chain]:
        cycle = " -> ".join([lbl for _, lbl in chain] + [base_label])
        raise RuleError([f"{where}: extends: {base!r} makes a cycle ({cycle}); remove one of the extends"],
                        path=label)
    return Path(base_label), base_label


class Merged:
    """The extends chain folded into one view; later (child) documents win."""

    def __init__(self) -> None:
        self.scalars: dict[str, Node] = {}
        self.named: dict[str, dict[str, Node]] = {"sources": {}, "vocab": {}, "add": {}}
        self.tensors: list[Node] = []
        self.files: list[Node] = []
        self.require: dict[str, Node] = {}
        self.min_rows: dict[str, Node] = {}
        self.config: Node | None = None
        #: the whole ``inverse`` section: a child's replaces the base's, like ``config``
        self.inverse: Node | None = None
        self.output: dict[str, Node] = {}
        self.top: Node | None = None


def merge_chain(chain: list[YamlDocument]) -> Merged:
    merged = Merged()
    for doc in chain:
        data = doc.data if isinstance(doc.data, dict) else {}
        merged.top = Node(doc, (), data)
        for key in ("name", "description", "convert"):
            if key in data:
                merged.scalars[key] = Node(doc, (key,), data[key])
        for section, table in merged.named.items():
            if isinstance(data.get(section), dict):
                for name, value in data[section].items():
                    table[name] = Node(doc, (section, name), value)
        if isinstance(data.get("tensors"), list):
            # The child's rules are tried first: first match wins, so they override.
            mine = [Node(doc, ("tensors", i), v) for i, v in enumerate(data["tensors"])]
            merged.tensors = mine + merged.tensors
        if isinstance(data.get("files"), list):  # like tensors: the child's entries first
            merged.files = [Node(doc, ("files", i), v) for i, v in enumerate(data["files"])] + merged.files
        require = data.get("require")
        if isinstance(require, dict):
            for key, value in require.items():
                if key == "min_rows_from_source" and isinstance(value, dict):
                    for out_key, fraction in value.items():
                        merged.min_rows[out_key] = Node(doc, ("require", key, out_key), fraction)
                else:
                    merged.require[key] = Node(doc, ("require", key), value)
        if "config" in data:
            merged.config = Node(doc, ("config",), data["config"])
        if "inverse" in data:
            merged.inverse = Node(doc, ("inverse",), data["inverse"])
        if isinstance(data.get("output"), dict):
            for key, value in data["output"].items():
                merged.output[key] = Node(doc, ("output", key), value)
    return merged


def inverse_config(m: Merged) -> Node | None:
    """``inverse.config``: the config section ``invert`` writes into the inverse."""
    if m.inverse is None or not isinstance(m.inverse.value, dict) or "config" not in m.inverse.value:
        return None
    return Node(m.inverse.doc, ("inverse", "config"), m.inverse.value["config"])
