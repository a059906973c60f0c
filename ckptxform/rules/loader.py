"""Load a rule file into a frozen RuleSet: read its ``extends`` chain (extends.py), check
every document against the JSON Schema (schema_check.py) and the merged rules for what
the schema cannot see (semantic_checks.py), then build the RuleSet's dataclasses.

Every problem of every file in the ``extends`` chain is collected and reported together,
each as ``FILE:LINE:COL: PATH: message``.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import replace
from decimal import Decimal
from pathlib import Path

from ..errors import RuleError, quote
from ..fileio import is_utf8
from ..ops import OPS
from ..ops.base import Step
from .extends import Merged, Node, inverse_config, merge_chain, read_chain
from .file_rules import build_file_rules, loader_file_rules
from .key_pattern import KeyPattern
from .library import locate_rules
from .model import (
    AddEntry,
    ConfigSpec,
    GgufSpec,
    LoadedPattern,
    MinRows,
    OutputSpec,
    Require,
    RuleSet,
    SourceSpec,
    TensorRule,
    VocabSpec,
)
from .constants import constant_templates
from .config_assertions import config_assertion_problems, parse_config_assertions
from .schema_check import schema_problems
from .semantic_checks import Problem, semantic_problems
from .template_rules import parse_template_rule

_SIZE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)$")
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


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
    chain = read_chain(Path(label), label, ())
    problems: list[Problem] = []
    for doc in chain:
        for (line, col), message in schema_problems(doc):
            problems.append(((doc.file, line, col), message))
    merged = merge_chain(chain)
    problems.extend(semantic_problems(merged))
    if not problems:  # only a schema-valid require.config has the shape its checks read
        problems.extend(config_assertion_problems(merged))
    if not problems and not merged.named["sources"] and merged.top is not None:
        # plan would refuse it; so does validate (a file otherwise valid, or this would
        # only add noise to the schema's own messages)
        where = merged.top.where()
        problems.append(((where.file, where.line, where.col),
                         f"{merged.top.at()} no 'sources': declare the checkpoints the rules read under "
                         "'sources', and name the one whose tensors they convert in 'convert'"))
    if problems:
        ordered = sorted(set(problems), key=lambda p: p[0])
        (file, line, col), _ = ordered[0]
        raise RuleError([message for _, message in ordered], path=file, line=line, col=col)
    digest = hashlib.sha256()
    for doc in chain:
        digest.update(doc.raw)
    return _build(merged, label, digest.hexdigest(), tuple(doc.file for doc in chain))


def _config_spec(node: Node | None) -> ConfigSpec | None:
    if node is None:
        return None
    c = node.value or {}
    return ConfigSpec(
        where=node.where(), from_source=c.get("from"), root=c.get("root"),
        root_where=node.where("root", key=True) if "root" in c else None,
        keep=tuple(c["keep"]) if "keep" in c else None,
        rename=tuple(c.get("rename", {}).items()), delete=tuple(c.get("delete", [])),
        set=tuple((k, val, node.where("set", k)) for k, val in c.get("set", {}).items()))


def parse_size(text: int | str) -> int:
    """``5GB`` -> 5_000_000_000 (the schema has checked the form)."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(text.strip())
    assert match is not None, text
    # Decimal: exact for 1.5GB, and no float overflow for absurdly long digit strings.
    return int(Decimal(match.group(1)) * _UNITS[match.group(2)])


def _build(m: Merged, label: str, sha256: str, files: tuple[str, ...]) -> RuleSet:
    sources = {}
    for name, node in m.named["sources"].items():
        v = node.value
        path = v.get("path")
        if path is not None and not os.path.isabs(path):
            path = os.path.normpath(os.path.join(os.path.dirname(node.doc.file), path))
        sources[name] = SourceSpec(name=name, where=node.where(), repo=v.get("repo"),
                                   revision=v.get("revision"), path=path, fetch=v.get("fetch", "auto"),
                                   config_file=v.get("config", "config.json"), example=v.get("example"),
                                   open=v.get("open", "when_needed"))
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
                ops=parsed.steps, tie=v.get("tie"), source=v.get("source"),
                consumed=v.get("consumed")))
            continue
        tensors.append(TensorRule(
            index=index, where=node.where(), match=v["match"],
            pattern=KeyPattern.compile(v["match"], label=node.at("match")),
            rename=v.get("rename"), skip=v.get("skip"), ops=_rule_level_ops(node),
            cast=v.get("cast"), optional=v.get("optional", False), tie=v.get("tie"), source=v.get("source"),
            consumed=v.get("consumed")))
    add = {}
    for key, node in m.named["add"].items():
        v = node.value
        template, for_each = constant_templates(key, v) if "fill" in v else (None, None)
        add[key] = AddEntry(key=key, where=node.where(key=True), vocab=v.get("vocab"), field=v.get("field"),
                            encoding=v.get("encoding", "offset"), source=v.get("source"),
                            tensor=v.get("tensor"), cast=v.get("cast"), fill=v.get("fill"),
                            shape=tuple(v.get("shape", ())), dtype=v.get("dtype"), template=template,
                            for_each=for_each)
    loaded_node = m.require.get("loaded")
    loaded = tuple(LoadedPattern(KeyPattern.compile(p, label=loaded_node.at(i)), loaded_node.where(i))
                   for i, p in enumerate(loaded_node.value)) if loaded_node else ()
    min_rows = tuple(MinRows(k, float(n.value), n.where()) for k, n in m.min_rows.items())
    strict = m.require["strict"].value if "strict" in m.require else True
    out = {k: n.value for k, n in m.output.items()}
    output = OutputSpec(
        max_shard_size=parse_size(out["max_shard_size"]) if "max_shard_size" in out else None,
        dtype=out.get("dtype"), file_name=out.get("file_name", "model.safetensors"),
        config_file=out.get("config_file", "config.json"), shards_like=(out.get("shards") or {}).get("like"),
        format=out.get("format", "safetensors"),
        gguf=GgufSpec(**out["gguf"]) if "gguf" in out else None,
        follows_source=not {"max_shard_size", "file_name", "shards"} & set(out))
    if output.format == "gguf" and "file_name" not in out:
        output = replace(output, file_name="model.gguf")
    convert = m.scalars["convert"].value if "convert" in m.scalars else (
        next(iter(sources)) if len(sources) == 1 else None)
    carry = _loader_files_source(out.get("loader_files"), output.format, convert)
    output = replace(output, loader_files=carry)
    file_rules = build_file_rules([(n.value, n.where()) for n in m.files], convert)
    at = m.output["loader_files"] if "loader_files" in m.output else m.top
    assert at is not None  # a chain holds at least one document
    carried = () if carry is None else loader_file_rules(carry, at.where(), len(file_rules))
    name = m.scalars["name"].value if "name" in m.scalars else Path(label).stem
    description = m.scalars["description"].value if "description" in m.scalars else ""
    return RuleSet(path=label, name=name, description=description, sources=sources, convert=convert,
                   vocab=vocab, tensors=tuple(tensors), add=add,
                   file_rules=file_rules, loader_file_rules=carried,
                   require=Require(loaded=loaded, min_rows_from_source=min_rows, strict=strict,
                                   config=parse_config_assertions(m)),
                   config=_config_spec(m.config), inverse_config=_config_spec(inverse_config(m)),
                   output=output, sha256=sha256, files=files)


def _loader_files_source(value: object, fmt: str, convert: str | None) -> str | None:
    """``output.loader_files`` as the source to carry from: ``carry`` (the default of a
    safetensors output; a gguf file holds its tokenizer) is the converted source."""
    if value is None:
        value = "carry" if fmt == "safetensors" else "none"
    if isinstance(value, dict):
        return value["from"]
    return convert if value == "carry" else None


def _rule_level_ops(node: Node) -> tuple[Step, ...]:
    """A regex rule's ``permute_rows`` (with ``missing_rows`` beside it) as the op it spells."""
    v = node.value
    if "permute_rows" not in v:
        return ()
    args = dict(v["permute_rows"])
    places = ()
    if "missing_rows" in v:
        args["missing_rows"] = v["missing_rows"]
        places = (("missing_rows", node.where("missing_rows")),)
    return (Step(OPS["permute_rows"], args, node.where("permute_rows"), rule_level=True, places=places),)
