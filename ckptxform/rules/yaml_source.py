"""Safe YAML reading that remembers where every node came from.

PyYAML's ``safe_load`` forgets positions, silently keeps the last of two duplicate keys
and expands aliases without bound. We compose the node tree ourselves, build plain
data from it with a node budget, refuse anything but the JSON-compatible core tags, and
record the position of every value and every mapping key by its path.
"""

from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .._data import data_dir
from ..errors import FileTooLargeError, NotAFileError, RuleError
from ..fileio import read_small_file
from ..where import Where

MAX_FILE_BYTES = 1 << 20  # a rule file is a page of text; 1 MiB is generous
MAX_NODES = 100_000  # bounds alias expansion ("billion laughs")
# A rule file nests about 8 levels; the bound keeps PyYAML's recursive composer, our
# builder (aliases can stack subtrees, or even point into themselves) and jsonschema far
# from Python's recursion limit.
MAX_DEPTH = 64

_SCALAR_TAGS = {
    "tag:yaml.org,2002:str",
    "tag:yaml.org,2002:int",
    "tag:yaml.org,2002:float",
    "tag:yaml.org,2002:bool",
    "tag:yaml.org,2002:null",
}
_MAP_TAG = "tag:yaml.org,2002:map"
_SEQ_TAG = "tag:yaml.org,2002:seq"

Path_ = tuple[str | int, ...]

__all__ = ["Where", "YamlDocument", "read_yaml"]


@dataclass(frozen=True)
class YamlDocument:
    """The data of a rule file plus where each value (and each mapping key) stands."""

    file: str
    data: Any
    values: dict[Path_, Where]
    keys: dict[Path_, Where]
    #: the bytes read (once: a piped rule file cannot be read twice)
    raw: bytes = field(default=b"", repr=False)

    def where(self, path: Path_, *, key: bool = False) -> Where:
        """Position of the value at ``path`` (or of its key), falling back to the parent."""
        table = self.keys if key else self.values
        probe = tuple(path)
        while probe:
            if probe in table:
                return table[probe]
            if probe in self.values:
                return self.values[probe]
            probe = probe[:-1]
        return self.values.get((), Where(self.file, 1, 1))


class _DepthLimitedLoader(yaml.SafeLoader):
    """SafeLoader whose composer refuses nesting deeper than ``MAX_DEPTH``."""

    _depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nested more than {MAX_DEPTH} levels deep", self.peek_event().start_mark
                )
            return super().compose_node(parent, index)  # type: ignore[no-any-return]
        finally:
            self._depth -= 1


def _yaml_problem(err: yaml.MarkedYAMLError) -> str:
    """PyYAML's context and problem as one phrase (it means to print marks between them)."""
    if err.context and err.problem:
        at = f" at line {err.context_mark.line + 1}" if err.context_mark else ""
        return f"{err.context}{at}: {err.problem}"
    return str(err.problem or err.context)


def _where(file: str, node: yaml.Node) -> Where:
    return Where(file, node.start_mark.line + 1, node.start_mark.column + 1)


def read_yaml(path: Path, label: str) -> YamlDocument:
    """Read ``path`` as a rule document; every problem is a ``RuleError`` at a position."""
    try:
        # a pipe is fine (rules generated on the fly); a device or FIFO that never ends is not
        raw = read_small_file(path, MAX_FILE_BYTES, what="a rule file", pipes=True)
    except FileNotFoundError:
        raise RuleError([f"{label}: file not found; check the path"], path=label) from None
    except NotAFileError as err:
        raise RuleError([f"{label}: is {err.kind}, not a rule file; give the path of a YAML file"],
                        path=label) from None
    except FileTooLargeError:
        raise RuleError([f"{label}: larger than {MAX_FILE_BYTES:,} bytes, too large for a rule file"],
                        path=label) from None
    except OSError as err:
        raise RuleError([f"{label}: cannot read: {err.strerror}"], path=label) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        col = err.start - (raw.rfind(b"\n", 0, err.start) + 1) + 1
        raise RuleError(
            [f"{label}:{line}:{col}: not UTF-8 (byte 0x{raw[err.start]:02x}); save the file as UTF-8"],
            path=label,
        ) from None
    try:
        node = yaml.compose(text, Loader=_DepthLimitedLoader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{label}:{mark.line + 1}:{mark.column + 1}" if mark else label
        raise RuleError([f"{where}: invalid YAML: {_yaml_problem(err)}"], path=label,
                        line=mark.line + 1 if mark else None, col=mark.column + 1 if mark else None) from None
    except yaml.reader.ReaderError as err:  # a control character; it carries an offset, not a mark
        line = text.count("\n", 0, err.position) + 1
        col = err.position - (text.rfind("\n", 0, err.position) + 1) + 1
        raise RuleError(
            [f"{label}:{line}:{col}: invalid YAML: control character U+{err.character:04X} is not allowed; remove it"],
            path=label,
        ) from None
    except yaml.YAMLError as err:
        raise RuleError([f"{label}: invalid YAML: {' '.join(str(err).split())}"], path=label) from None
    if node is None and not raw and stat.S_ISFIFO(os.stat(path).st_mode):
        raise RuleError([_empty_fifo(path, label)], path=label)
    if node is None:
        raise RuleError([f"{label}:1:1: the file is empty; a rule file starts with 'version: 1'"], path=label)
    builder = _Builder(label)
    data = builder.build(node, ())
    if builder.problems:
        raise RuleError(builder.problems, path=label)
    return YamlDocument(label, data, builder.values, builder.keys, raw)


def _empty_fifo(path: Path, label: str) -> str:
    """A FIFO nothing was written to: say so, and name the shipped rule it may shadow."""
    shipped = data_dir("rules") / os.path.basename(path)
    hint = (f" (a shipped rule has that file name: {shipped.stem!r} names it; or remove the FIFO)"
            if shipped.is_file() else "")
    return f"{label}: is a FIFO (named pipe) and nothing was written to it; give the path of a YAML file{hint}"


class _Builder:
    def __init__(self, file: str) -> None:
        self.file = file
        self.values: dict[Path_, Where] = {}
        self.keys: dict[Path_, Where] = {}
        self.problems: list[str] = []
        self.nodes = 0
        self._constructor = yaml.constructor.SafeConstructor()

    def build(self, node: yaml.Node, path: Path_) -> Any:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise RuleError(
                [(f"{_where(self.file, node)}: more than {MAX_NODES:,} YAML nodes (an alias bomb?); "
                  "write the rules out without nested aliases")],
                path=self.file,
            )
        if len(path) >= MAX_DEPTH:
            raise RuleError(
                [(f"{_where(self.file, node)}: nested more than {MAX_DEPTH} levels deep (through aliases?); "
                  "write the rules out without nested aliases")],
                path=self.file,
            )
        self.values[path] = _where(self.file, node)
        if isinstance(node, yaml.MappingNode) and node.tag == _MAP_TAG:
            return self._mapping(node, path)
        if isinstance(node, yaml.SequenceNode) and node.tag == _SEQ_TAG:
            return [self.build(item, path + (i,)) for i, item in enumerate(node.value)]
        if isinstance(node, yaml.ScalarNode) and node.tag in _SCALAR_TAGS:
            return self._scalar(node)
        self.problems.append(
            f"{_where(self.file, node)}: YAML tag {node.tag!r} is not allowed in a rule file; "
            "use plain strings, numbers, booleans, lists and mappings"
        )
        return None

    def _scalar(self, node: yaml.ScalarNode) -> Any:
        kind = node.tag.rsplit(":", 1)[-1]
        try:
            value = self._constructor.construct_object(node)
        except (ValueError, KeyError, IndexError, TypeError, yaml.YAMLError):
            # An explicit tag on a value that is not of that type (`!!int abc`, a bare
            # `!!int`), or a form PyYAML resolves but cannot convert (`0b_`, 5,000 digits).
            self.problems.append(f"{_where(self.file, node)}: {node.value!r} is not a valid {kind}; "
                                 "quote it to make it a string")
            return None
        if isinstance(value, int) and value.bit_length() > 64:
            # hex/octal/binary forms have no digit limit, and Python refuses to print
            # such a number in decimal later (in a message, in JSON)
            shown = node.value if len(node.value) <= 24 else node.value[:21] + "..."
            self.problems.append(f"{_where(self.file, node)}: {shown!r} is a {value.bit_length()}-bit integer; "
                                 "rule files take integers of at most 64 bits")
            return None
        if isinstance(value, float) and not math.isfinite(value):
            # JSON has no inf/nan, and a fraction or size of nan passes every bound.
            self.problems.append(f"{_where(self.file, node)}: {node.value!r} is not a finite number")
            return None
        return value

    def _mapping(self, node: yaml.MappingNode, path: Path_) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            where = _where(self.file, key_node)
            if key_node.tag == "tag:yaml.org,2002:merge":
                self.problems.append(f"{where}: YAML merge keys ('<<') are not supported; use 'extends'")
                continue
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != "tag:yaml.org,2002:str":
                self.problems.append(f"{where}: mapping keys must be strings, got {key_node.tag!r}")
                continue
            key = key_node.value
            if key in out:
                first = self.keys[path + (key,)]
                self.problems.append(f"{where}: duplicate key {key!r} (first at line {first.line})")
                continue
            self.keys[path + (key,)] = where
            out[key] = self.build(value_node, path + (key,))
        return out
