"""What the schema cannot see in a merged rule file: regexes that do not compile, rename
groups that do not exist, unknown sources and vocabularies (with a did-you-mean), bad
``${...}`` references, and two rules that provably write one output key. Each problem
is reported at its YAML node as ``FILE:LINE:COL: PATH: message``.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from .constants import constant_problems
from .expr import ExpressionError, Ref, is_expression, parse_expression
from .extends import Merged, Node, inverse_config
from .file_rules import entry_problems
from .key_pattern import KeyPattern, regex_literal
from .schema_check import format_path, plain
from .template_rules import parse_template_rule
from .templates import is_index

# Every escape of a rename template, so that an escaped backslash (``\\1``) is not read
# as a group reference; group(1) is a group number, group(2) a ``\g<...>`` name.
_GROUP_REF = re.compile(r"\\(?:(\d+)|g<([^>]*)>|.)", re.DOTALL)

# ``$1`` / ``${1}``: the group syntax of sed, JavaScript and Perl, which re.expand writes
# literally: a rename names groups as ``\1`` or ``\g<1>``.
_DOLLAR_GROUP = re.compile(r"\$(?:(\d+)|\{(\d+)\})")

#: (file, line, col) and the message
Problem = tuple[tuple[str, int, int], str]


def _did_you_mean(name: str, defined: list[str]) -> str:
    close = difflib.get_close_matches(name, defined, n=1)
    listing = ", ".join(plain(name) for name in sorted(defined)) or "none"
    return f" (defined: {listing})" + (f"; did you mean {close[0]!r}?" if close else "")


def semantic_problems(m: Merged) -> list[Problem]:
    """Problems the schema cannot see: regexes, references, group numbers, collisions."""
    out: list[Problem] = []

    def report(node: Node, sub: tuple[str | int, ...], message: str, key: bool = False) -> None:
        where = node.where(*sub, key=key)
        out.append(((where.file, where.line, where.col), f"{node.at(*sub, key=key)} {message}"))

    sources = list(m.named["sources"])
    vocabs = list(m.named["vocab"])

    def check_ref(node: Node, sub: tuple[str | int, ...], kind: str, defined: list[str]) -> None:
        value = node.value
        for part in sub:
            if isinstance(value, list) and isinstance(part, int):
                value = value[part] if part < len(value) else None
            else:
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

    def claim(literal: str, node: Node, sub: tuple[str | int, ...]) -> None:
        """One output key per tensor rule: the second rule whose text proves it writes
        ``literal`` is reported (a ``key:`` rule's ``to``, a regex rule's ``match``)."""
        if literal in literal_outputs:
            report(node, sub, f"produces output key {literal!r}, already produced by "
                   f"{literal_outputs[literal]}; two tensors cannot be written to one key")
        else:
            literal_outputs[literal] = f"{format_path(node.path)} ({node.where().short})"

    earlier: list[KeyPattern] = []
    for node in m.tensors:
        rule = node.value if isinstance(node.value, dict) else {}
        check_ref(node, ("source",), "source", sources)
        if isinstance(rule.get("key"), str):
            parsed = parse_template_rule(rule, node.where)
            for sub, problem in parsed.problems:
                report(node, sub, problem)
            for sub, value in _op_expressions(rule):
                for at, message in _reference_problems(value, sub, sources, vocabs):
                    report(node, at, message)
                if sub[-1] == "permute_rows" and isinstance(value, dict):
                    _permutation_refs(node, sub[:-1], check_ref, sources, vocabs)
            if parsed.key is not None and not parsed.problems:
                earlier.append(KeyPattern.compile(parsed.key.regex.pattern, label=node.at("key")))
                for tpl in parsed.to:
                    if tpl.literal is not None:
                        claim(tpl.literal, node, ("to",))
            continue
        pattern = _compile(rule.get("match"), node, ("match",), report)
        # A rule for one literal key that an earlier rule already takes never fires: that
        # is how a child file overrides a base rule, not two tensors for one output key.
        source_key = regex_literal(pattern.pattern) if pattern is not None else None
        shadowed = source_key is not None and any(p.fullmatch(source_key) for p in earlier)
        if pattern is not None:
            earlier.append(pattern)
        _permutation_refs(node, (), check_ref, sources, vocabs)
        template = rule.get("rename")
        if pattern is not None and isinstance(template, str):
            bad_group = False
            for ref in _GROUP_REF.finditer(template):
                number, name = ref.group(1), ref.group(2)
                if number is not None and int(number) > pattern.groups:
                    bad_group = True
                    report(node, ("rename",), f"\\{number} refers to group {number} but 'match' has "
                           f"{pattern.groups} group{'s' if pattern.groups != 1 else ''}")
                if name is not None and not (is_index(name) and int(name) <= pattern.groups) \
                        and name not in pattern.groupindex:
                    bad_group = True
                    report(node, ("rename",), f"\\g<{name}> names no group of 'match'")
            dollar = _DOLLAR_GROUP.search(template)
            if dollar is not None:
                bad_group = True
                number = dollar.group(1) or dollar.group(2)
                report(node, ("rename",), f"{dollar.group(0)!r} is not a group reference in a rename (it would be "
                       f"written literally into the key); write '\\{number}' for group {number}, e.g. "
                       f"rename: '{_DOLLAR_GROUP.sub(lambda m: chr(92) + (m.group(1) or m.group(2)), template)}'")
            problem = None if bad_group else _template_problem(pattern, template)
            if problem:
                report(node, ("rename",), problem)
        literal = None if shadowed else _literal_output(rule, pattern)
        if literal is not None:
            claim(literal, node, ("match",))

    for key, node in m.named["add"].items():
        check_ref(node, ("vocab",), "vocabulary", vocabs)
        check_ref(node, ("source",), "source", sources)
        if isinstance(node.value, dict) and "fill" in node.value:  # a constant (rules/constants.py)
            for sub, problem in constant_problems(key, node.value):
                report(node, sub, problem, key=not sub)
            for name in ("fill", "shape", "dtype"):
                for sub, problem in _reference_problems(node.value.get(name), (name,), sources, vocabs):
                    report(node, sub, problem)
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

    carry = m.output.get("loader_files")
    if carry is not None and isinstance(carry.value, dict):
        check_ref(carry, ("from",), "source", sources)

    shards = m.output.get("shards")
    if shards is not None:
        check_ref(shards, ("like",), "source", sources)
        for other in ("max_shard_size", "file_name"):
            if other in m.output:
                report(shards, ("like",), f"the output's files are those of the source named here, so "
                       f"output.{other} has nothing to decide; remove one of the two")
    _output_format_problems(m, report)
    loaded = m.require.get("loaded")
    if loaded is not None and isinstance(loaded.value, list):
        for i, _ in enumerate(loaded.value):
            _compile(loaded.value[i], loaded, (i,), report)

    for config in (m.config, inverse_config(m)):
        if config is not None and isinstance(config.value, dict):
            check_ref(config, ("from",), "source", sources)
            settings = config.value.get("set")
            if isinstance(settings, dict):
                for field_name, value in settings.items():
                    for sub, problem in _reference_problems(value, ("set", field_name), sources, vocabs):
                        report(config, sub, problem)
    return out


def _output_format_problems(m: Merged, report: Any) -> None:
    """A GGUF output is one .gguf file with its metadata section and no config.json; a
    safetensors output has no metadata section and no .gguf name."""
    fmt = m.output.get("format")
    gguf = fmt is not None and fmt.value == "gguf"
    name = m.output.get("file_name")
    if gguf:
        if "gguf" not in m.output:
            report(fmt, (), "format: gguf needs output.gguf: {architecture: llama, file_type: Q8_0} (whose "
                   "metadata the file carries)")
        for other in ("max_shard_size", "shards", "config_file", "dtype"):
            if other in m.output:
                report(m.output[other], (), f"a gguf output is one .gguf file whose tensors gguf_quantize types, "
                       f"so output.{other} has nothing to decide; remove it")
        if m.config is not None:
            report(m.config, (), "a gguf output writes no config.json: its metadata is built from the source's "
                   "config as output.gguf says; remove the config section")
        if name is not None and not str(name.value).endswith(".gguf"):
            report(name, (), f"a gguf output's file_name ends in .gguf, e.g. model.gguf (not {name.value!r})")
    else:
        if "gguf" in m.output:
            report(m.output["gguf"], (), "output.gguf describes a GGUF file's metadata; add format: gguf to the "
                   "output (or remove output.gguf)")
        if name is not None and str(name.value).endswith(".gguf"):
            report(name, (), "a .gguf file_name needs format: gguf in the output section")


def _permutation_refs(node: Node, at: tuple[str | int, ...], check_ref: Any, sources: list[str],
                      vocabs: list[str]) -> None:
    """The vocabularies and the source a permute_rows (at rule level, ``at`` = (), or in
    ``ops``) names; its ``missing_rows`` stands beside it at rule level, inside it in ops."""
    check_ref(node, (*at, "permute_rows", "from"), "vocabulary", vocabs)
    check_ref(node, (*at, "permute_rows", "to"), "vocabulary", vocabs)
    check_ref(node, (*at, "permute_rows", "missing_rows", "rows_of") if at else ("missing_rows", "rows_of"),
              "source", sources)


def _compile(value: Any, node: Node, sub: tuple[str | int, ...], report: Any) -> KeyPattern | None:
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
