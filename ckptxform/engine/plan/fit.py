"""Which shipped rules fit a checkpoint (``ckptxform rules --for SOURCE``): each rule is
planned with the checkpoint as its converted source, from headers only.

A rule that reads no other source is planned whole (config checks, requirements and all).
A rule that also reads other sources (a verifier, a tokenizer repo) is checked against the
checkpoint alone: its ``require.config`` about the converted source, and that every tensor
has a rule and every tensor rule a tensor; the others are not opened (no network, and the
user has not said which ones they would use).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from ...errors import CkptxformError, UnmatchedRuleError
from ...rules.config_assertions import sources_read
from ...rules.model import RuleSet
from ...sources.base import Checkpoint
from .config_requirements import check_config_requirements
from .planner import build_plan, needed_sources


@dataclass(frozen=True)
class Fit:
    name: str
    plans: bool
    #: why it does not plan (one line), or what was and was not checked when it does
    reason: str

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "plans": self.plans, "reason": self.reason}


def rule_fit(path: Path, location: str) -> Fit:
    """Plan the shipped rule at ``path`` with ``location`` as its converted source."""
    from ...rules.loader import load_rules
    from ...sources.resolve import open_location

    try:
        rules = load_rules(path)
        convert = rules.convert
        if convert is None:
            return Fit(path.stem, False, "the rule converts no source")
        rules = rules.with_sources({convert: location})
        ckpt = open_location(location, name=convert)
    except CkptxformError as err:
        return Fit(path.stem, False, _one_line(err))
    try:
        named = set(re.findall(r"\$\{source\.([^.}]+)\.", repr(rules)))  # config.set, op arguments
        others = [name for name in rules.sources if name != convert
                  and (name in named or name in needed_sources(rules))]
        if not others:
            try:
                build_plan(rules, {convert: ckpt}).close()
                return Fit(path.stem, True, "plans")
            except KeyError as err:  # a ${source.NAME...} read by a step the scan above missed
                others = [str(err.args[0])]
        _check_alone(rules, convert, ckpt)
        return Fit(path.stem, True, f"every tensor matches its rules (not opened: {', '.join(others)})")
    except CkptxformError as err:
        return Fit(path.stem, False, _one_line(err))
    finally:
        ckpt.close()


def _check_alone(rules: RuleSet, convert: str, ckpt: Checkpoint) -> None:
    """The checks of a plan that need only the converted source."""
    about_it = tuple(item for item in rules.require.config
                     if item.of == convert and sources_read((item,), []) == {convert})
    check_config_requirements(replace(rules, require=replace(rules.require, config=about_it)), None,
                              {convert: ckpt}, {}, of_sources=True)
    keys = ckpt.tensor_keys()
    ours = [r for r in rules.tensors if (r.source or convert) == convert]
    unmatched = [key for key in keys if not any(r.pattern.fullmatch(key) for r in ours)]
    if unmatched and rules.require.strict:
        raise UnmatchedRuleError(f"{len(unmatched)} tensor{'s' if len(unmatched) != 1 else ''} match no rule, "
                                 f"e.g. {unmatched[0]!r}")
    unfit = [r for r in ours if not r.optional and not any(map(r.pattern.fullmatch, keys))]
    if unfit:
        raise UnmatchedRuleError(f"{len(unfit)} tensor rule{'s match' if len(unfit) != 1 else ' matches'} no "
                                 f"tensor, e.g. match '{unfit[0].match}'")


def _one_line(err: CkptxformError) -> str:
    if isinstance(err, UnmatchedRuleError) and err.summary:
        return err.summary
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def fitting_rules(location: str) -> list[Fit]:
    """Every shipped rule planned against ``location``: those that plan first, in name order."""
    from ...rules.catalogue import shipped_rules

    fits = [rule_fit(rule.path, location) for rule in shipped_rules()]
    return sorted(fits, key=lambda f: (not f.plans, f.name))
