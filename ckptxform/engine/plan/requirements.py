"""``require``: the rule file's assertions about what the plan carries over from the
converted source (``loaded``, ``min_rows_from_source``), decided over the planned outputs
before a weight byte is read, and, when one fails, which rule should have produced the
output and the closest keys the source has instead."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence

from ...errors import RequirementError
from ...rules.key_pattern import KeyPattern, regex_literal
from ...rules.model import RuleSet, TensorRule
from ...rules.templates import expand_from
from .recipes import OutputPlan


def check_requirements(rules: RuleSet, outputs: Mapping[str, OutputPlan], producer: Mapping[str, object],
                       source_keys: Sequence[str]) -> None:
    """Raise ``RequirementError`` with one line per failed assertion of ``rules.require``.
    ``producer`` names what writes each output key (its str()); ``source_keys`` are the converted
    source's tensors (for the closest-key hint)."""
    problems: list[str] = []
    not_loaded: set[str | None] = set()
    for item in rules.require.loaded:
        if any(o.loaded and item.pattern.fullmatch(o.key) for o in outputs.values()):
            continue
        problems.append(_explain_not_loaded(rules, outputs, producer, source_keys, item.pattern, item.where.short))
        not_loaded.add(regex_literal(item.pattern.pattern))
    for item in rules.require.min_rows_from_source:
        out = outputs.get(item.key)
        if out is None and item.key in not_loaded:
            continue  # its source tensor is missing: reported once, by require.loaded above
        account = out.recipe.row_account() if out is not None else None
        if account is None:
            problems.append(f"require.min_rows_from_source ({item.where.short}): {item.key!r} is not a "
                            "permuted output tensor; name the output key of a permute_rows rule")
            continue
        frac = account.from_source / max(1, account.total)
        if frac < item.fraction:
            problems.append(
                f"require.min_rows_from_source ({item.where.short}): only {account.from_source:,} "
                f"of {account.total:,} rows of {item.key!r} ({frac:.1%}) come from the source, "
                f"below {item.fraction:.0%}; the vocabulary maps are probably not the drafters' own")
    if problems:
        raise RequirementError("\n".join(problems))


def _explain_not_loaded(rules: RuleSet, outputs: Mapping[str, OutputPlan], producer: Mapping[str, object],
                        source_keys: Sequence[str], pattern: KeyPattern, where: str) -> str:
    source = rules.convert
    assert source is not None
    wanted = regex_literal(pattern.pattern)
    head = f"require.loaded ({where}): {wanted or pattern.pattern!r} was not loaded from source {source!r}"
    if wanted is not None and wanted in outputs:
        account = outputs[wanted].recipe.row_account()
        if account is not None:
            return (f"{head}: {producer[wanted]} takes none of its {account.total:,} rows from "
                    "the source (all are filled); the vocabulary maps are probably not the drafters' own")
        return f"{head}: it is produced by {producer[wanted]}, not loaded from the source"
    if wanted is None:
        return f"{head}: no output key matches; check the rule that should produce it"
    for rule in rules.tensors:
        expected = _source_key_for(rule, wanted)
        if expected is None:
            continue
        close = difflib.get_close_matches(expected, list(source_keys), n=3, cutoff=0.6)
        hint = f"; closest keys there: {', '.join(map(repr, close))}" if close else ""
        return (f"{head}: {rule.label} would produce it from {expected!r}, which {source!r} does not "
                f"have{hint}")
    close = difflib.get_close_matches(wanted, [k for k, o in outputs.items() if o.loaded], n=1, cutoff=0.6)
    if close:  # most often a typo in the require entry itself
        return (f"{head}: no rule produces it; did you mean {close[0]!r}, which is loaded? Correct the "
                "require.loaded entry, or add a rule whose output key it is")
    return f"{head}: no rule produces it; add a rule whose output key it is"


def _source_key_for(rule: TensorRule, output_key: str) -> str | None:
    """The source key from which ``rule`` would produce ``output_key``, when that can be told."""
    if rule.skip is not None:
        return None
    if rule.template is not None:  # a key template read backwards: one source key per output
        for target in rule.to:
            bound = target.match(output_key)
            if bound is not None and set(rule.template.variables) <= set(bound):
                return expand_from(rule.template, target, bound)
        return None
    if rule.rename is None:
        literal = regex_literal(rule.match)
        return output_key if (literal == output_key or rule.pattern.fullmatch(output_key)) else None
    parts = re.split(r"(\\\d+|\\g<[^>]*>)", rule.rename)
    regex = "".join("(.*)" if p.startswith("\\") and (p[1:].isdigit() or p.startswith("\\g<"))
                    else re.escape(p) for p in parts)
    m = re.fullmatch(regex, output_key)
    if m is None or len(m.groups()) != 1 or rule.pattern.groups != 1:
        return None
    source_regex = re.sub(r"\((?!\?)(?:[^()\\]|\\.)*\)", lambda _: re.escape(m.group(1)), rule.match, count=1)
    candidate = regex_literal(source_regex)
    return candidate if candidate is not None and rule.pattern.fullmatch(candidate) else None
