"""``ckptxform invert RULES``: the rule file that undoes RULES, derived rule by rule.

A ``key:`` rule turns around (``key`` <-> ``to``, its ops reversed, each replaced by its
inverse from the op registry); a regex rename turns around when its groups can be read
back; an untie (``to`` list) becomes a tie and a tie an untie. What cannot be undone is
refused, naming the rule and the op: a lossy cast, a vocabulary permutation, an op with no
inverse (dequant), a regex rename that cannot be read backwards. Tensors the forward
rules skip or add are named in comments / skipped, so the plan of the inverse stays strict.
The inverse's config is the forward's ``inverse.config`` (or the source's, when the
forward passes it through); its own ``inverse.config`` is the forward's config.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from collections.abc import Callable
from typing import Any

import yaml

from .._data import data_dir
from ..errors import RuleError
from ..ops.base import NoInverse
from .expr import Ref, is_expression, parse_expression
from .key_pattern import regex_literal
from .loader import load_rules
from .model import ConfigSpec, RuleSet, TensorRule
from .one_to_one import collisions, written_into
from .templates import Template, Var

# one group of a rename-able regex: (.+), (.*), ([^.]+), (\d+) and the like, no nesting
_GROUP = re.compile(r"\((?!\?)((?:[^()\\]|\\.)*)\)")
_REF = re.compile(r"\\(\d+)")


def invert_rules(rules: RuleSet, base_dir: str = ".") -> tuple[dict[str, Any], list[str]]:
    """(the inverse rule data, comment lines), source paths relative to ``base_dir`` (where
    the inverse is saved); ``RuleError`` lists every rule that has no inverse."""
    problems: list[str] = []
    entries: list[dict[str, Any]] = []
    front: list[dict[str, Any]] = []
    notes: list[str] = []
    config_fields = _config_fields(rules)
    for rule in rules.tensors:
        try:
            if rule.source is not None and rule.source != rules.convert:
                raise NoInverse(f"it takes the tensors of source {rule.source!r} beside the converted source's; "
                                "the output does not say which source each came from")
            if rule.skip is not None:
                notes.append(f"not restored: {rule.label} skips {rule.match!r} ({rule.skip})")
                continue
            if rule.consumed is not None:
                notes.append(f"not restored: {rule.label} consumes {rule.match!r} ({rule.consumed})")
                continue
            if rule.tie is not None:
                front.append(_untie(rule))
                continue
            entries.extend(_invert_key_rule(rule, config_fields) if rule.template is not None
                           else [_invert_match_rule(rule)])
        except NoInverse as why:
            problems.append(f"{rule.where.short}: tensors[{rule.index}] has no inverse: {why}")
    if rules.output.dtype:
        problems.append(f"{rules.path}: output.dtype {rules.output.dtype} casts every float tensor: a lossy cast "
                        "has no inverse")
    for key, entry in rules.add.items():
        front.append({"key": key, "skip": "added by the forward rules, not part of the original"})
    if problems:
        raise RuleError(problems, path=rules.path)
    data: dict[str, Any] = {"version": 1, "name": f"{rules.name}-inverse"}
    if rules.description:
        data["description"] = f"The inverse of {rules.name}: {rules.description}"
    data["sources"] = {name: _source(spec, base_dir) for name, spec in rules.sources.items()}
    if rules.convert:
        # The inverse converts what the forward wrote, which has no default location: the
        # forward's input there would have a run read the wrong model.
        data["sources"][rules.convert] = {"example": f"the OUT of `ckptxform apply {_spelled_rules(rules)}`"}
        data["convert"] = rules.convert
        # The inverse converts the forward's output: it reads the config file the forward
        # wrote, and writes the one the forward read (Meta's params.json <-> config.json).
        _set_config_file(data["sources"][rules.convert], rules.output.config_file)
        read = rules.sources[rules.convert].config_file
        if read != "config.json":
            data["output"] = {"config_file": read}
    data["tensors"] = front + entries
    if rules.inverse_config is not None:
        data["config"] = config_data(rules.inverse_config)
    elif rules.config is not None and _passes_config_through(rules):
        data["config"] = {"from": rules.convert}
    elif rules.config is not None:
        notes.append("config: the forward rules build the output config; write the inverse's config section "
                     "by hand (or give the forward rules an inverse.config)")
    if rules.config is not None and not _passes_config_through(rules) and not _reads_vocab(rules.config):
        # the inverse of the inverse is the forward: its config is the forward's
        data["inverse"] = {"config": config_data(rules.config)}
    if rules.file_rules:
        notes.append("files: the forward rules copy non-weight files; list the inverse's by hand")
    if rules.require.loaded:
        notes.append("require.loaded of the forward rules names their outputs; state the inverse's by hand")
    if rules.require.config:
        notes.append("require.config of the forward rules checks their configs; state the inverse's by hand")
    return data, notes


def proven_inverse_yaml(rules: RuleSet, saved_as: str | None = None, over: str | None = None) -> str:
    """``ckptxform invert``: the inverse, refused (RuleError naming each key) unless it
    gives every key back to the rule that wrote it, over every key the forward can write
    or, with ``over`` (the forward's output), over the keys it wrote there."""
    text = inverse_yaml(rules, saved_as)
    base_dir = os.path.dirname(os.path.abspath(saved_as if saved_as else rules.path))
    written = None if over is None else written_into(over, rules.convert)
    problems = collisions(rules, check_rule_text(text, base_dir), written)
    if problems:
        raise RuleError(problems, path=rules.path)
    return text


def inverse_yaml(rules: RuleSet, saved_as: str | None = None) -> str:
    """The inverse as YAML text, checked by the loader (not yet proven one-to-one:
    ``proven_inverse_yaml``); ``saved_as``: the file it will be written to (source paths
    and the ``$schema`` comment are made relative to it; None: printed, relative to
    RULES' directory)."""
    base_dir = os.path.dirname(os.path.abspath(saved_as if saved_as else rules.path))
    data, notes = invert_rules(rules, base_dir)
    head = [f"# yaml-language-server: $schema={schema_reference(base_dir)}",
            f"# Generated by `ckptxform invert {rules.path}`."]
    head += [f"# {note}" for note in notes]
    body = str(yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=100, allow_unicode=True))
    text = "\n".join(head) + "\n" + body
    check_rule_text(text, base_dir)
    return text


def schema_reference(base_dir: str) -> str:
    """The installed rules schema as a path relative to ``base_dir`` (where the rule file is
    saved), so that an editor beside the file finds it."""
    return os.path.relpath(os.fspath(data_dir("schemas") / "rules.schema.json"), base_dir)


def check_rule_text(text: str, base_dir: str) -> RuleSet:
    """Load generated rule text as a file in ``base_dir`` would be (a RuleError if it is not valid)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "generated.yaml"
        path.write_text(text, "utf-8")
        return load_rules(path)


def _source(spec: Any, base_dir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if spec.repo is not None:
        out["repo"] = spec.repo
        if spec.revision:
            out["revision"] = spec.revision
    elif spec.path is not None:
        out["path"] = spec.path if os.path.isabs(spec.path) else os.path.relpath(spec.path, base_dir)
    if spec.config_file != "config.json":
        out["config"] = spec.config_file
    return out


def _spelled_rules(rules: RuleSet) -> str:
    """RULES as a user names them: a shipped rule by its name, a file by its path."""
    path = Path(rules.path)
    shipped = data_dir("rules")
    return path.stem if path.parent == shipped else os.path.relpath(path)


def _set_config_file(source: dict[str, Any], name: str) -> None:
    source.pop("config", None)
    if name != "config.json":
        source["config"] = name


def config_data(spec: ConfigSpec) -> dict[str, Any]:
    """A config section as rule-file data, as it was written."""
    data: dict[str, Any] = {}
    if spec.from_source is not None:
        data["from"] = spec.from_source
    if spec.keep is not None:
        data["keep"] = list(spec.keep)
    if spec.rename:
        data["rename"] = dict(spec.rename)
    if spec.delete:
        data["delete"] = list(spec.delete)
    if spec.set:
        data["set"] = {path: value for path, value, _ in spec.set}
    return data


def _reads_vocab(spec: ConfigSpec) -> bool:
    """The config reads a vocabulary map, which the inverse does not declare."""
    return any(ref.kind == "vocab" for _, value, _ in spec.set for text in _expressions(value)
               for ref in parse_expression(text).refs())


def _passes_config_through(rules: RuleSet) -> bool:
    """The forward's config is the converted source's, unchanged: so is the inverse's."""
    spec = rules.config
    return (spec is not None and spec.from_source == rules.convert and spec.keep is None
            and not spec.rename and not spec.delete and not spec.set)


def _invert_key_rule(rule: TensorRule, config_fields: dict[str, str]) -> list[dict[str, Any]]:
    assert rule.template is not None
    if rule.cast is not None:
        raise NoInverse(f"cast: {rule.cast} is a lossy cast")
    if len(rule.to) > 1:
        return _invert_untie(rule)
    steps = []
    for i, step in enumerate(reversed(rule.ops)):
        index = len(rule.ops) - 1 - i
        try:
            undo = step.op.inverse(step.args)
            if undo is None:  # nothing to undo on the inverse's side (concat_shards: it writes one file)
                continue
            verb, args = undo
            for value in _expressions(args):
                if any(ref.kind == "shape" for ref in parse_expression(value).refs()):
                    raise NoInverse(f"{value} reads a shape of the forward source, which the inverse does not "
                                    "have; write the number or a ${config...} expression")
        except NoInverse as why:
            raise NoInverse(f"ops[{index}] {step.verb}: {why}") from None
        steps.append({verb: _through_config(args, config_fields)})
    key, to = _turned_around(rule.template, rule.to[0])
    entry: dict[str, Any] = {"key": key}
    if to != key:
        entry["to"] = to
    if steps:
        entry["ops"] = steps
    return [entry]


def _turned_around(key: Template, to: Template) -> tuple[str, str]:
    """The inverse's (key, to): each variable's declaration (``{X*}``, ``{P:a,b}``) moves
    to the side that now matches source keys; the other side names it bare (anonymous
    enumerations keep their values on both sides, where they pair by position)."""
    declared = key.variables
    matched = {name for name in to.variables}

    def declare(var: Var) -> Var:
        known = declared.get(var.name, var)
        return Var(var.name, var.values if var.values is not None else known.values, var.multi or known.multi)

    def refer(var: Var) -> Var:
        return var if var.name.startswith("_") or var.name not in matched else Var(var.name)

    return _spelled(to, declare), _spelled(key, refer)


def _spelled(template: Template, respell: Callable[[Var], Var]) -> str:
    return "".join(p if isinstance(p, str) else respell(p).spelled() for p in template.parts)


def _config_fields(rules: RuleSet) -> dict[str, str]:
    """Forward source config field -> the output config field that holds its value, from
    ``config.set`` entries that are exactly ``${config.FIELD}`` (Meta's n_heads is written
    as num_attention_heads): the inverse's converted source is the forward's output."""
    if rules.config is None:
        return {}
    fields: dict[str, str] = {}
    for path, value, _ in rules.config.set:
        if isinstance(value, str) and is_expression(value):
            root = parse_expression(value).root
            if isinstance(root, Ref) and root.kind == "config":
                fields.setdefault(".".join(root.path), path)
    return fields


def _through_config(args: Any, fields: dict[str, str]) -> Any:
    """``args`` with every ``config.FIELD`` the forward output renames read under its new name."""
    if not fields:
        return args
    if isinstance(args, dict):
        return {k: _through_config(v, fields) for k, v in args.items()}
    if isinstance(args, list):
        return [_through_config(v, fields) for v in args]
    if isinstance(args, str) and is_expression(args):
        return re.sub(r"\bconfig\.([A-Za-z_][\w.]*)", lambda m: "config." + fields.get(m.group(1), m.group(1)), args)
    return args


def _invert_untie(rule: TensorRule) -> list[dict[str, Any]]:
    """``to: [a, b]`` writes a twice; undone: keep a (as the key), tie b to a."""
    assert rule.template is not None
    if rule.ops or any(t.literal is None for t in rule.to):
        raise NoInverse("an untie with templates or ops cannot be tied back; list literal keys")
    first = rule.to[0].text
    ties = [{"key": t.text, "tie": first} for t in rule.to[1:]]
    keep: dict[str, Any] = {"key": first}
    if rule.template.text != first:
        keep["to"] = rule.template.text
    return [*ties, keep]


def _untie(rule: TensorRule) -> dict[str, Any]:
    """A tie (the tensor was dropped as a copy of output KEY) is undone by writing KEY twice."""
    assert rule.tie is not None
    tied = rule.template.literal if rule.template is not None else regex_literal(rule.match)
    if tied is None:
        raise NoInverse(f"tie: {rule.match!r} is not one literal key, so the inverse cannot name the copy")
    return {"key": rule.tie, "to": [rule.tie, tied]}


def _invert_match_rule(rule: TensorRule) -> dict[str, Any]:
    for step in rule.ops:  # a match rule's ops are its rule-level permute_rows
        try:
            step.op.inverse(step.args)
        except NoInverse as why:
            raise NoInverse(f"{step.verb}: {why}") from None
    if rule.cast is not None:
        raise NoInverse(f"cast: {rule.cast} is a lossy cast")
    if rule.rename is None:
        return {"match": rule.match}
    return _reverse_rename(rule.match, rule.rename)


def _reverse_rename(match: str, rename: str) -> dict[str, Any]:
    """``midlayer\\.(.+)`` -> ``layers.0.\\1`` turned around: ``layers\\.0\\.(.+)`` -> ``midlayer.\\1``."""
    groups = list(_GROUP.finditer(match))
    pieces = _GROUP.split(match)  # literal, group body, literal, ...
    literals = pieces[0::2]
    spelled = [regex_literal(text) if text else "" for text in literals]
    refs = [int(m.group(1)) for m in _REF.finditer(rename)]
    if any(s is None for s in spelled) or sorted(refs) != list(range(1, len(groups) + 1)) or "\\g<" in rename:
        raise NoInverse(f"rename {rename!r} of match {match!r} cannot be read backwards; write the inverse rule "
                        "by hand (or use key: templates, which always invert)")
    new_match = []
    for part in re.split(r"(\\\d+)", rename):
        if re.fullmatch(r"\\\d+", part):
            new_match.append(f"({groups[int(part[1:]) - 1].group(1)})")
        else:
            new_match.append(re.escape(part))
    position = {number: i + 1 for i, number in enumerate(refs)}
    new_rename = "".join(str(s) + (f"\\{position[i + 1]}" if i < len(groups) else "") for i, s in enumerate(spelled))
    return {"match": "".join(new_match), "rename": new_rename}


def _expressions(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [e for v in value.values() for e in _expressions(v)]
    if isinstance(value, list):
        return [e for v in value for e in _expressions(v)]
    return [value] if is_expression(value) else []
