"""Load a rule file: safe YAML, JSON Schema, ``extends``, semantic checks, a frozen RuleSet.

Every problem of every file in the ``extends`` chain is collected and reported together,
each as ``FILE:LINE:COL: PATH: message``.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import re
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from ..errors import RuleError, quote
from ..fileio import is_utf8
from .key_pattern import KeyPattern
from .model import (
    AddEntry,
    ConfigSpec,
    LoadedPattern,
    MinRows,
    MissingRows,
    OutputSpec,
    PermuteRows,
    Require,
    RuleSet,
    SourceSpec,
    TensorRule,
    VocabSpec,
)
from .expr import ExpressionError, Ref, is_expression, parse_expression
from .file_rules import build_file_rules, entry_problems
from .library import locate_rules, shipped_rule_path
from .schema_check import format_path, plain, schema_problems
from .template_rules import parse_template_rule
from .yaml_source import Where, YamlDocument, read_yaml

# Every escape of a rename template, so that an escaped backslash (``\\1``) is not read
# as a group reference; group(1) is a group number, group(2) a ``\g<...>`` name.
_GROUP_REF = re.compile(r"\\(?:(\d+)|g<([^>]*)>|.)", re.DOTALL)
_SIZE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)$")
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


@dataclass(frozen=True)
class _Node:
    """A value of the merged rule data and the document (file) it was written in."""

    doc: YamlDocument
    path: tuple[str | int, ...]
    value: Any

    def where(self, *sub: str | int, key: bool = False) -> Where:
        return self.doc.where(self.path + sub, key=key)

    def at(self, *sub: str | int, key: bool = False) -> str:
        """``FILE:LINE:COL: PATH:`` prefix for a message about ``sub``."""
        return f"{self.where(*sub, key=key)}: {format_path(self.path + sub)}:"


def load_rules(path: str | os.PathLike[str]) -> RuleSet:
    """Load and validate a rule file (a path, or a shipped rule's file stem or name: see
    ``library.locate_rules``); raise ``RuleError`` listing every problem.

    >>> rules = load_rules("aqmedai_k2_to_k25")
    >>> sorted(rules.sources)
    ['drafter', 'target_vocab', 'verifier']
    """
    label = os.fspath(path)
    if not is_utf8(label):
        raise RuleError([f"{quote(label)}: the path is not valid UTF-8; the audit log records it as text: "
                         "rename the rule file"], path=label)
    label = locate_rules(label)
    chain = _read_chain(Path(label), label, ())
    problems: list[tuple[tuple[str, int, int], str]] = []
    for doc in chain:
        for (line, col), message in schema_problems(doc):
            problems.append(((doc.file, line, col), message))
    merged = _merge(chain)
    problems.extend(_semantic_problems(merged))
    if not problems and not merged.named["sources"] and merged.top is not None:
        # plan would refuse it; so does validate (a file otherwise valid, or this would
        # only add noise to the schema's own messages)
        where = merged.top.where()
        problems.append(((where.file, where.line, where.col),
                         f"{merged.top.at()} no 'sources': declare the checkpoints the rules read under "
                         "'sources', and name the one whose tensors they convert in 'convert'"))
    if problems:
        ordered = sorted(set(problems), key=lambda p: p[0])
        raise RuleError([message for _, message in ordered], path=label)
    digest = hashlib.sha256()
    for doc in chain:
        digest.update(doc.raw)
    return _build(merged, label, digest.hexdigest(), tuple(doc.file for doc in chain))


def _read_chain(path: Path, label: str, seen: tuple[tuple[Path, str], ...]) -> list[YamlDocument]:
    """The documents of the extends chain, base first. ``seen``: (resolved, label) of the children."""
    resolved = path.resolve()
    doc = read_yaml(path, label)
    base = doc.data.get("extends") if isinstance(doc.data, dict) else None
    if not isinstance(base, str) or not base:
        return [doc]
    base_label = os.path.normpath(os.path.join(os.path.dirname(label), base))
    if not Path(base_label).is_file():  # a file beside this one wins over the library
        shipped = shipped_rule_path(base)
        base_label = str(shipped) if shipped is not None else base_label
    where = doc.where(("extends",))
    if not Path(base_label).is_file():
        raise RuleError([f"{where}: extends: {base!r} not found (looked for {plain(base_label)})"], path=label)
    chain = (*seen, (resolved, label))
    # Reported at the extends that closes the loop, with the loop spelled out.
    if Path(base_label).resolve() in [p for p, _ in chain]:
        cycle = " -> ".join([lbl for _, lbl in chain] + [base_label])
        raise RuleError([f"{where}: extends: {base!r} makes a cycle ({cycle}); remove one of the extends"],
                        path=label)
    return _read_chain(Path(base_label), base_label, chain) + [doc]


class _Merged:
    """The extends chain folded into one view; later (child) documents win."""

    def __init__(self) -> None:
        self.scalars: dict[str, _Node] = {}
        self.named: dict[str, dict[str, _Node]] = {"sources": {}, "vocab": {}, "add": {}}
        self.tensors: list[_Node] = []
        self.files: list[_Node] = []
        self.require: dict[str, _Node] = {}
        self.min_rows: dict[str, _Node] = {}
        self.config: _Node | None = None
        #: the whole ``inverse`` section: a child's replaces the base's, like ``config``
        self.inverse: _Node | None = None
        self.output: dict[str, _Node] = {}
        self.top: _Node | None = None


def _merge(chain: list[YamlDocument]) -> _Merged:
    merged = _Merged()
    for doc in chain:
        data = doc.data if isinstance(doc.data, dict) else {}
        merged.top = _Node(doc, (), data)
        for key in ("name", "description", "convert"):
            if key in data:
                merged.scalars[key] = _Node(doc, (key,), data[key])
        for section, table in merged.named.items():
            if isinstance(data.get(section), dict):
                for name, value in data[section].items():
                    table[name] = _Node(doc, (section, name), value)
        if isinstance(data.get("tensors"), list):
            # The child's rules are tried first: first match wins, so they override.
            mine = [_Node(doc, ("tensors", i), v) for i, v in enumerate(data["tensors"])]
            merged.tensors = mine + merged.tensors
        if isinstance(data.get("files"), list):  # like tensors: the child's entries first
            merged.files = [_Node(doc, ("files", i), v) for i, v in enumerate(data["files"])] + merged.files
        require = data.get("require")
        if isinstance(require, dict):
            for key, value in require.items():
                if key == "min_rows_from_source" and isinstance(value, dict):
                    for out_key, fraction in value.items():
                        merged.min_rows[out_key] = _Node(doc, ("require", key, out_key), fraction)
                else:
                    merged.require[key] = _Node(doc, ("require", key), value)
        if "config" in data:
            merged.config = _Node(doc, ("config",), data["config"])
        if "inverse" in data:
            merged.inverse = _Node(doc, ("inverse",), data["inverse"])
        if isinstance(data.get("output"), dict):
            for key, value in data["output"].items():
                merged.output[key] = _Node(doc, ("output", key), value)
    return merged


def _did_you_mean(name: str, defined: list[str]) -> str:
    close = difflib.get_close_matches(name, defined, n=1)
    listing = ", ".join(plain(name) for name in sorted(defined)) or "none"
    return f" (defined: {listing})" + (f"; did you mean {close[0]!r}?" if close else "")


def _semantic_problems(m: _Merged) -> list[tuple[tuple[str, int, int], str]]:
    """Problems the schema cannot see: regexes, references, group numbers, collisions."""
    out: list[tuple[tuple[str, int, int], str]] = []

    def report(node: _Node, sub: tuple[str | int, ...], message: str, key: bool = False) -> None:
        where = node.where(*sub, key=key)
        out.append(((where.file, where.line, where.col), f"{node.at(*sub, key=key)} {message}"))

    sources = list(m.named["sources"])
    vocabs = list(m.named["vocab"])

    def check_ref(node: _Node, sub: tuple[str | int, ...], kind: str, defined: list[str]) -> None:
        value = node.value
        for part in sub:
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, str) and value not in defined:
            report(node, sub, f"unknown {kind} {value!r}{_did_you_mean(value, defined)}")

    if "convert" in m.scalars:
        check_ref(m.scalars["convert"], (), "source", sources)
    elif m.top is not None and len(sources) > 1:
        report(m.top, (), "missing 'convert': name the source whose tensors the rules convert")

    for node in m.named["vocab"].values():
        check_ref(node, ("source",), "source", sources)
        if isinstance(node.value, dict) and isinstance(node.value.get("vocab_size"), str) \
                and "source" not in node.value:
            report(node, ("vocab_size",), "a ${config.PATH} reference reads the source's config.json: "
                   "this map has no source; give the size as an integer")

    literal_outputs: dict[str, str] = {}
    earlier: list[KeyPattern] = []
    for node in m.tensors:
        rule = node.value if isinstance(node.value, dict) else {}
        if isinstance(rule.get("key"), str):
            parsed = parse_template_rule(rule, node.where)
            for sub, problem in parsed.problems:
                report(node, sub, problem)
            for sub, value in _op_expressions(rule):
                for at, message in _reference_problems(value, sub, sources, vocabs):
                    report(node, at, message)
            if parsed.key is not None and not parsed.problems:
                earlier.append(KeyPattern.compile(parsed.key.regex.pattern, label=node.at("key")))
                for i, tpl in enumerate(parsed.to):
                    literal = tpl.literal
                    if literal is None:
                        continue
                    if literal in literal_outputs:
                        report(node, ("to",), f"produces output key {literal!r}, already produced by "
                               f"{literal_outputs[literal]}; two tensors cannot be written to one key")
                    else:
                        literal_outputs[literal] = f"{format_path(node.path)} ({node.where().short})"
            continue
        pattern = _compile(rule.get("match"), node, ("match",), report)
        # A rule for one literal key that an earlier rule already takes never fires: that
        # is how a child file overrides a base rule, not two tensors for one output key.
        source_key = regex_literal(pattern.pattern) if pattern is not None else None
        shadowed = source_key is not None and any(p.fullmatch(source_key) for p in earlier)
        if pattern is not None:
            earlier.append(pattern)
        if isinstance(rule.get("permute_rows"), dict):
            check_ref(node, ("permute_rows", "from"), "vocabulary", vocabs)
            check_ref(node, ("permute_rows", "to"), "vocabulary", vocabs)
        if isinstance(rule.get("missing_rows"), dict):
            check_ref(node, ("missing_rows", "rows_of"), "source", sources)
        template = rule.get("rename")
        if pattern is not None and isinstance(template, str):
            bad_group = False
            for ref in _GROUP_REF.finditer(template):
                number, name = ref.group(1), ref.group(2)
                if number is not None and int(number) > pattern.groups:
                    bad_group = True
                    report(node, ("rename",), f"\\{number} refers to group {number} but 'match' has "
                           f"{pattern.groups} group{'s' if pattern.groups != 1 else ''}")
                if name is not None and not (name.isdigit() and int(name) <= pattern.groups) \
                        and name not in pattern.groupindex:
                    bad_group = True
                    report(node, ("rename",), f"\\g<{name}> names no group of 'match'")
            problem = None if bad_group else _template_problem(pattern, template)
            if problem:
                report(node, ("rename",), problem)
        literal = None if shadowed else _literal_output(rule, pattern)
        if literal is not None:
            if literal in literal_outputs:
                report(node, ("match",), f"produces output key {literal!r}, already produced by "
                       f"{literal_outputs[literal]}; two tensors cannot be written to one key")
            else:
                literal_outputs[literal] = f"{format_path(node.path)} ({node.where().short})"

    for key, node in m.named["add"].items():
        check_ref(node, ("vocab",), "vocabulary", vocabs)
        check_ref(node, ("source",), "source", sources)
        if key in literal_outputs:
            report(node, (), f"output key {key!r} is also produced by {literal_outputs[key]}; "
                   "remove one of them", key=True)

    for node in m.files:
        check_ref(node, ("from",), "source", sources)
        for sub, problem in entry_problems(node.value):
            report(node, sub, problem)
        if isinstance(node.value, dict) and "from" not in node.value and "convert" not in m.scalars \
                and len(sources) != 1:
            report(node, (), "no 'from', and no 'convert' source to copy from by default; name the source")

    loaded = m.require.get("loaded")
    if loaded is not None and isinstance(loaded.value, list):
        for i, _ in enumerate(loaded.value):
            _compile(loaded.value[i], loaded, (i,), report)

    for config in (m.config, _inverse_config(m)):
        if config is not None and isinstance(config.value, dict):
            check_ref(config, ("from",), "source", sources)
            settings = config.value.get("set")
            if isinstance(settings, dict):
                for field_name, value in settings.items():
                    for sub, problem in _reference_problems(value, ("set", field_name), sources, vocabs):
                        report(config, sub, problem)
    return out


def _inverse_config(m: _Merged) -> _Node | None:
    """``inverse.config``: the config section ``invert`` writes into the inverse."""
    if m.inverse is None or not isinstance(m.inverse.value, dict) or "config" not in m.inverse.value:
        return None
    return _Node(m.inverse.doc, ("inverse", "config"), m.inverse.value["config"])


def _config_spec(node: _Node | None) -> ConfigSpec | None:
    if node is None:
        return None
    c = node.value or {}
    return ConfigSpec(
        where=node.where(), from_source=c.get("from"),
        keep=tuple(c["keep"]) if "keep" in c else None,
        rename=tuple(c.get("rename", {}).items()), delete=tuple(c.get("delete", [])),
        set=tuple((k, val, node.where("set", k)) for k, val in c.get("set", {}).items()))


def _compile(value: Any, node: _Node, sub: tuple[str | int, ...], report: Any) -> KeyPattern | None:
    if not isinstance(value, str):
        return None
    try:
        return KeyPattern.compile(value, label=node.at(*sub))
    except re.error as err:
        at = f" at position {err.pos}" if err.pos is not None else ""
        report(node, sub, f"invalid regular expression {value!r}: {err.msg}{at}")
    except OverflowError as err:  # a{99999999999}
        report(node, sub, f"invalid regular expression {value!r}: {err}")
    except RecursionError:  # thousands of nested groups overflow the parser's stack
        report(node, sub, f"invalid regular expression {value!r}: nested too deeply")
    return None


def _template_problem(pattern: KeyPattern, template: str) -> str | None:
    """Why ``template`` cannot be expanded for a match of ``pattern`` (bad escapes like ``\\q``)."""
    # "\n|" gives a pattern with the same groups that matches "" (the newline also ends
    # a trailing comment of a verbose pattern), so expansion can be tried without a key.
    try:
        probe = re.compile(pattern.pattern + "\n|", pattern.flags).match("")
    except (re.error, RecursionError):
        return None
    if probe is None:
        return None
    try:
        expanded = probe.expand(template)
    except (re.error, IndexError) as err:
        return f"invalid rename template {template!r}: {err}"
    if "\\" in expanded:
        # re keeps unknown escapes like "\." as they are: the key would hold a backslash.
        return (f"rename template {template!r} puts a backslash into the output key; "
                "a rename is not a regular expression: write '.' rather than '\\.'")
    return None


def _literal_output(rule: dict[str, Any], pattern: KeyPattern | None) -> str | None:
    """The one output key a rule can produce, when that is provable from its text."""
    if pattern is None or "skip" in rule:
        return None
    template = rule.get("rename")
    if isinstance(template, str):
        return None if "\\" in template else template
    return regex_literal(pattern.pattern)


def regex_literal(pattern: str) -> str | None:
    """The one string ``pattern`` matches when it has no regex operators (``fc\\.weight``)."""
    out = []
    chars = iter(pattern)
    for ch in chars:
        if ch == "\\":
            nxt = next(chars, "")
            if not nxt or nxt.isalnum():
                return None
            out.append(nxt)
        elif ch in ".^$*+?{}[]|()":
            return None
        else:
            out.append(ch)
    return "".join(out)


def _reference_problems(
    value: Any, sub: tuple[str | int, ...], sources: list[str], vocabs: list[str]
) -> list[tuple[tuple[str | int, ...], str]]:
    """Each bad ``${...}`` reference inside a config value, with its path."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _reference_problems(v, sub + (k,), sources, vocabs)]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _reference_problems(v, sub + (i,), sources, vocabs)]
    problem = _reference_problem(value, sources, vocabs)
    return [(sub, problem)] if problem else []


def _reference_problem(value: Any, sources: list[str], vocabs: list[str]) -> str | None:
    if not is_expression(value):
        return None
    try:
        expression = parse_expression(value)
    except ExpressionError as err:
        return str(err)
    for ref in expression.refs():
        problem = _named_problem(ref, sources, vocabs)
        if problem:
            return problem
    return None


def _named_problem(ref: Ref, sources: list[str], vocabs: list[str]) -> str | None:
    """An unknown vocabulary or source named by a reference."""
    if ref.kind == "vocab" and ref.path[0] not in vocabs:
        return f"unknown vocabulary {ref.path[0]!r}{_did_you_mean(ref.path[0], vocabs)}"
    if ref.kind == "source" and ref.path[0] not in sources:
        return f"unknown source {ref.path[0]!r}{_did_you_mean(ref.path[0], sources)}"
    return None


def _op_expressions(rule: dict[str, Any]) -> list[tuple[tuple[str | int, ...], Any]]:
    """Each argument of each op of ``rule``, with its path (for reference checks)."""
    out: list[tuple[tuple[str | int, ...], Any]] = []
    for i, item in enumerate(rule.get("ops") or []):
        if isinstance(item, dict):
            for verb, args in item.items():
                out.append((("ops", i, verb), args))
    return out


def parse_size(text: int | str) -> int:
    """``5GB`` -> 5_000_000_000 (the schema has checked the form)."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(text.strip())
    assert match is not None, text
    # Decimal: exact for 1.5GB, and no float overflow for absurdly long digit strings.
    return int(Decimal(match.group(1)) * _UNITS[match.group(2)])


def _build(m: _Merged, label: str, sha256: str, files: tuple[str, ...]) -> RuleSet:
    sources = {}
    for name, node in m.named["sources"].items():
        v = node.value
        path = v.get("path")
        if path is not None and not os.path.isabs(path):
            path = os.path.normpath(os.path.join(os.path.dirname(node.doc.file), path))
        sources[name] = SourceSpec(name=name, where=node.where(), repo=v.get("repo"),
                                   revision=v.get("revision"), path=path, fetch=v.get("fetch", "auto"),
                                   config_file=v.get("config", "config.json"))
    vocab = {}
    for name, node in m.named["vocab"].items():
        v = node.value
        file = v.get("file")
        if file is not None and not os.path.isabs(file):
            file = os.path.normpath(os.path.join(os.path.dirname(node.doc.file), file))
        vocab[name] = VocabSpec(name=name, where=node.where(), source=v.get("source"),
                                d2t=v.get("d2t", "d2t"), t2d=v.get("t2d", "t2d"), file=file,
                                encoding=v.get("encoding"), vocab_size=v.get("vocab_size"),
                                identity_rows_of=v.get("identity_rows_of"),
                                t2d_optional=v.get("t2d_optional", False))
    tensors = []
    for index, node in enumerate(m.tensors):
        v = node.value
        if "key" in v:
            parsed = parse_template_rule(v, node.where)
            assert parsed.key is not None
            tensors.append(TensorRule(
                index=index, where=node.where(), match=v["key"], skip=v.get("skip"),
                pattern=KeyPattern.compile(parsed.key.regex.pattern, label=node.at("key")),
                cast=v.get("cast"), optional=v.get("optional", False), template=parsed.key, to=parsed.to,
                ops=parsed.steps, tie=v.get("tie")))
            continue
        permute = v.get("permute_rows")
        missing = v.get("missing_rows")
        tensors.append(TensorRule(
            index=index, where=node.where(), match=v["match"],
            pattern=KeyPattern.compile(v["match"], label=node.at("match")),
            rename=v.get("rename"), skip=v.get("skip"),
            permute_rows=PermuteRows(permute["from"], permute["to"], node.where("permute_rows"))
            if permute else None,
            missing_rows=_missing(missing, node.where("missing_rows")) if missing else None,
            cast=v.get("cast"), optional=v.get("optional", False), tie=v.get("tie")))
    add = {}
    for key, node in m.named["add"].items():
        v = node.value
        add[key] = AddEntry(key=key, where=node.where(key=True), vocab=v.get("vocab"), field=v.get("field"),
                            encoding=v.get("encoding", "offset"), source=v.get("source"),
                            tensor=v.get("tensor"), cast=v.get("cast"))
    loaded_node = m.require.get("loaded")
    loaded = tuple(LoadedPattern(KeyPattern.compile(p, label=loaded_node.at(i)), loaded_node.where(i))
                   for i, p in enumerate(loaded_node.value)) if loaded_node else ()
    min_rows = tuple(MinRows(k, float(n.value), n.where()) for k, n in m.min_rows.items())
    strict = m.require["strict"].value if "strict" in m.require else True
    out = {k: n.value for k, n in m.output.items()}
    output = OutputSpec(
        max_shard_size=parse_size(out["max_shard_size"]) if "max_shard_size" in out else None,
        dtype=out.get("dtype"), file_name=out.get("file_name", "model.safetensors"),
        config_file=out.get("config_file", "config.json"))
    convert = m.scalars["convert"].value if "convert" in m.scalars else (
        next(iter(sources)) if len(sources) == 1 else None)
    name = m.scalars["name"].value if "name" in m.scalars else Path(label).stem
    description = m.scalars["description"].value if "description" in m.scalars else ""
    return RuleSet(path=label, name=name, description=description, sources=sources, convert=convert,
                   vocab=vocab, tensors=tuple(tensors), add=add,
                   file_rules=build_file_rules([(n.value, n.where()) for n in m.files], convert),
                   require=Require(loaded=loaded, min_rows_from_source=min_rows, strict=strict),
                   config=_config_spec(m.config), inverse_config=_config_spec(_inverse_config(m)),
                   output=output, sha256=sha256, files=files)


def _missing(v: dict[str, Any], where: Where) -> MissingRows:
    if "rows_of" in v:
        return MissingRows(where=where, init="rows_of", rows_of=v["rows_of"], tensor=v["tensor"])
    return MissingRows(where=where, init=v["init"], std=float(v.get("std", 0.02)), seed=int(v.get("seed", 0)))
