"""Structural ops ``diff --emit-rules`` infers from shapes and names (headers only).

- stack: E tensors of A that differ only in one numeric segment (0..E-1) and one tensor of
  B shaped ``[E, *their shape]`` (``experts.{E}.down_proj.weight`` -> ``experts.down_proj``);
- concat: tensors of A that differ only in one segment and one tensor of B, equal except
  there, whose dim 0 is the sum of theirs, ordered as B's segment names them
  (``{q,k,v}_proj`` -> ``qkv_proj``); split is the same read the other way;
- stack then concat: stacked runs of experts whose parts a fused B tensor spells, along
  dim 1 (``experts.{E}.{gate_proj,up_proj}.weight`` -> ``experts.gate_up_proj`` [E, 2I, H]);
- transpose: a 2-D tensor of A and one of B (the same key, or keys differing only in
  numbers) with the two dims swapped.

Numbers that A's and B's keys share in the same order become template variables (``{L}``),
so one rule covers every layer.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..sources.base import TensorInfo

_NUMBER = re.compile(r"^[0-9]+$")


@dataclass(frozen=True)
class StructuralRule:
    key: str
    to: str
    ops: tuple[str, ...]  # YAML flow text of each op
    a_keys: tuple[str, ...]
    b_keys: tuple[str, ...]


def infer_structure(a: dict[str, TensorInfo], b: dict[str, TensorInfo]) -> list[StructuralRule]:
    """Rules explaining keys only in A by keys only in B (and changed shapes), generalized."""
    found: list[StructuralRule] = []
    left_a, left_b = dict(a), dict(b)
    for finder in (_stack_concats, _stacks, _concats, _splits, _transposes):
        for rule in finder(left_a, left_b):
            if all(k in left_a for k in rule.a_keys) and all(k in left_b for k in rule.b_keys):
                found.append(rule)
                for k in rule.a_keys:
                    left_a.pop(k)
                for k in rule.b_keys:
                    left_b.pop(k)
    return _generalize(found)


def _groups(keys: dict[str, TensorInfo], numeric: bool) -> dict[tuple[str, int], dict[str, TensorInfo]]:
    """Keys equal but for one segment: (key with that segment as '{}', position) -> {segment: info}."""
    out: dict[tuple[str, int], dict[str, TensorInfo]] = {}
    for key, info in keys.items():
        parts = key.split(".")
        for i, part in enumerate(parts):
            if bool(_NUMBER.match(part)) == numeric:
                pattern = ".".join(parts[:i] + ["{}"] + parts[i + 1:])
                out.setdefault((pattern, i), {})[part] = info
    return out


def _stackable(a: dict[str, TensorInfo]) -> list[tuple[str, list[TensorInfo]]]:
    """(pattern with '{}' for the index, members 0..n-1) of tensors differing only in one
    numeric segment, all of one shape and dtype."""
    out = []
    for (pattern, _), members in _groups(a, numeric=True).items():
        infos = [members.get(str(i)) for i in range(len(members))]
        present = [x for x in infos if x is not None]
        if len(present) >= 2 and len(present) == len(infos) and \
                all((x.shape, x.dtype) == (present[0].shape, present[0].dtype) for x in present):
            out.append((pattern, present))
    return out


def _stacks(a: dict[str, TensorInfo], b: dict[str, TensorInfo]) -> list[StructuralRule]:
    out = []
    for pattern, infos in _stackable(a):
        n, first = len(infos), infos[0]
        stacked = pattern.replace(".{}", "").replace("{}.", "")
        candidates = [k for k, v in b.items() if (v.shape, v.dtype) == ((n, *first.shape), first.dtype)]
        target = _closest(stacked, candidates)
        if target is not None:
            out.append(StructuralRule(pattern.replace("{}", "{E}"), target, (f"{{stack: {{over: E, count: {n}}}}}",),
                                      tuple(x.key for x in infos), (target,)))
    return out


def _ordered(segment: str, names: list[str]) -> list[str] | None:
    """The ``names`` that ``segment`` spells, in its order (``qkv_proj``: q_proj, k_proj,
    v_proj; not o_proj), once a suffix they share (``_proj``) is set aside."""
    suffix = os.path.commonprefix([n[::-1] for n in (segment, *names)])[::-1]
    stem = segment[:len(segment) - len(suffix)]
    found = sorted((stem.find(n[:len(n) - len(suffix)]), n) for n in names
                   if n[:len(n) - len(suffix)] and n[:len(n) - len(suffix)] in stem)
    spelled = "".join(n[:len(n) - len(suffix)] for _, n in found)
    return [n for _, n in found] if len(found) >= 2 and spelled.replace("_", "") == stem.replace("_", "") else None


def _concats(a: dict[str, TensorInfo], b: dict[str, TensorInfo], dim: int = 0) -> list[StructuralRule]:
    out = []
    for (pattern, i), members in _groups(a, numeric=False).items():
        if len(members) < 2:
            continue
        for kb, vb in b.items():
            parts = kb.split(".")
            if len(parts) != pattern.count(".") + 1 or ".".join(parts[:i] + ["{}"] + parts[i + 1:]) != pattern:
                continue
            order = _ordered(parts[i], list(members))
            if order is None or not _fits(vb, [members[m] for m in order], dim):
                continue
            sizes = ", ".join(str(members[m].shape[dim]) for m in order)
            out.append(StructuralRule(pattern.replace("{}", "{P:" + ",".join(order) + "}"), kb,
                                      (f"{{concat: {{over: P, dim: {dim}, sizes: [{sizes}]}}}}",),
                                      tuple(members[m].key for m in order), (kb,)))
    return out


def _stack_concats(a: dict[str, TensorInfo], b: dict[str, TensorInfo]) -> list[StructuralRule]:
    """Experts stacked, then their parts concatenated along dim 1 (transformers' fused
    ``gate_up_proj`` [E, 2I, H] from ``experts.E.{gate_proj,up_proj}.weight``)."""
    stacked: dict[str, TensorInfo] = {}
    behind: dict[str, tuple[str, list[TensorInfo]]] = {}
    for pattern, infos in _stackable(a):
        name = pattern.replace(".{}", "")
        for spelled in {name, name.removesuffix(".weight")}:  # the fused key may drop '.weight'
            stacked[spelled] = TensorInfo(spelled, infos[0].dtype, (len(infos), *infos[0].shape), "", 0, 0)
            behind[spelled] = (pattern, infos)
    out = []
    for rule in _concats(stacked, b, dim=1):
        groups = [behind[name] for name in rule.a_keys]
        patterns = [pattern.split(".") for pattern, _ in groups]
        varying = next(i for i in range(len(patterns[0])) if len({p[i] for p in patterns}) > 1)
        key = list(patterns[0])
        key[varying] = "{P:" + ",".join(p[varying] for p in patterns) + "}"
        out.append(StructuralRule(".".join(key).replace("{}", "{E}"), rule.to,
                                  (f"{{stack: {{over: E, count: {len(groups[0][1])}}}}}", rule.ops[0]),
                                  tuple(x.key for _, infos in groups for x in infos), rule.b_keys))
    return out


def _splits(a: dict[str, TensorInfo], b: dict[str, TensorInfo]) -> list[StructuralRule]:
    out = []
    for rule in _concats(b, a):  # a split is a concat read the other way
        ops = (rule.ops[0].replace("concat: {over: P", "split: {into: P"),)
        out.append(StructuralRule(rule.to, rule.key, ops, rule.b_keys, rule.a_keys))
    return out


def _fits(whole: TensorInfo, parts: list[TensorInfo], dim: int = 0) -> bool:
    """``whole`` is ``parts`` concatenated along ``dim`` (shapes and dtype, nothing read)."""
    def others(shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape[:dim] + shape[dim + 1:]
    return (len(whole.shape) > dim and all(p.dtype == whole.dtype and len(p.shape) == len(whole.shape)
                                           and others(p.shape) == others(whole.shape) for p in parts)
            and sum(p.shape[dim] for p in parts) == whole.shape[dim])


def _transposes(a: dict[str, TensorInfo], b: dict[str, TensorInfo]) -> list[StructuralRule]:
    out = []
    for ka, va in a.items():
        if len(va.shape) != 2 or va.shape[0] == va.shape[1]:
            continue
        if ka in b and b[ka].shape == va.shape[::-1] and b[ka].dtype == va.dtype:
            out.append(StructuralRule(ka, ka, ("{transpose: [0, 1]}",), (ka,), (ka,)))
    return out


def _closest(name: str, candidates: list[str]) -> str | None:
    import difflib

    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return close[0] if close else None


def _generalize(rules: list[StructuralRule]) -> list[StructuralRule]:
    """One rule per shape of rule: numbers shared by key and to, in order, become variables."""
    merged: dict[tuple[str, str, tuple[str, ...]], StructuralRule] = {}
    for rule in rules:
        key, to = _template_numbers(rule.key, rule.to)
        slot = (key, to, rule.ops)
        old = merged.get(slot)
        merged[slot] = StructuralRule(key, to, rule.ops, (old.a_keys if old else ()) + rule.a_keys,
                                      (old.b_keys if old else ()) + rule.b_keys)
    return list(merged.values())


def _template_numbers(key: str, to: str) -> tuple[str, str]:
    names = iter("LMNQRS")
    key_parts, to_parts = key.split("."), to.split(".")
    key_numbers = [i for i, p in enumerate(key_parts) if _NUMBER.match(p)]
    to_numbers = [i for i, p in enumerate(to_parts) if _NUMBER.match(p)]
    if [key_parts[i] for i in key_numbers] != [to_parts[i] for i in to_numbers]:
        return key, to
    for ki, ti in zip(key_numbers, to_numbers):
        name = "{" + next(names) + "}"
        key_parts[ki] = to_parts[ti] = name
    return ".".join(key_parts), ".".join(to_parts)
