"""``require.config``: decide the rule file's assertions about config fields at plan time,
before a weight byte is read: of the config.json the rule writes, or of a source's config
(``of``). One line per failed assertion, like ``require.loaded``'s:

    require.config.eagle_aux_hidden_state_layer_ids (rules/x.yaml:60): eagle_aux_hidden_state_layer_ids[2]
    of the written config.json is 40, not below 36 (${source.verifier.config.num_hidden_layers}); REASON

A bound or an ``equals`` may be ``${...}`` (rules/expr.py), resolved as in ``config.set``
except that ``${config.PATH}`` reads the config being checked.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from ...errors import PlanError, RequirementError
from ...rules.config_assertions import sources_read
from ...rules.model import ConfigAssertion, RuleSet
from ...sources.base import Checkpoint
from ...vocab.maps import VocabMap
from .references import MISSING, References, get_path

_BOUNDS = {"min": (lambda v, b: v >= b, "below the least allowed"),
           "max": (lambda v, b: v <= b, "above the greatest allowed"),
           "above": (lambda v, b: v > b, "not above"),
           "below": (lambda v, b: v < b, "not below")}


def config_sources(rules: RuleSet) -> set[str]:
    """The sources whose config ``require.config`` or ``config.set`` reads (to be opened)."""
    values = [value for _, value, _ in rules.config.set] if rules.config is not None else []
    return sources_read(rules.require.config, values)


def check_config_requirements(rules: RuleSet, written: Mapping[str, Any] | None,
                              ckpts: Mapping[str, Checkpoint], vocab: Mapping[str, VocabMap], *,
                              of_sources: bool = False) -> None:
    """Raise ``RequirementError`` with one line per failed assertion of ``require.config``;
    ``written`` is the config.json the plan will write (None when the rule writes none).
    ``of_sources``: only the assertions about a source's config (``of``), which need no
    output: the planner decides them first, so that a rule given a checkpoint it is not for
    (a dense rule, an MoE checkpoint) says so, not that the checkpoint's tensors match no rule."""
    problems: list[str] = []
    for item in rules.require.config:
        if of_sources and item.of is None:
            continue
        head = f"require.config.{item.path} ({item.where.short})"
        try:
            problem = _check(item, rules, written, ckpts, vocab, head)
        except PlanError as err:  # a bound's reference cannot be resolved: the message starts with head
            problem = str(err)
        if problem is not None:
            problems.append(problem + (f"; {item.reason}" if item.reason else ""))
    if problems:
        raise RequirementError("\n".join(problems))


def _check(item: ConfigAssertion, rules: RuleSet, written: Mapping[str, Any] | None,
           ckpts: Mapping[str, Checkpoint], vocab: Mapping[str, VocabMap], head: str) -> str | None:
    if item.of is None:
        config, label = written, f"the written {rules.output.config_file}"
        fix = "write it in the rule's config section (config.set), or give the config it starts from the field"
    else:
        spec, ckpt = rules.sources[item.of], ckpts[item.of]
        config = ckpt.config(spec.config_file)
        label = f"the {spec.config_file} of source {item.of!r} ({ckpt.location})"
        fix = "add it to that file, or point the source at the checkpoint it belongs to"
        if config is None:
            return (f"{head}: source {item.of!r} ({ckpt.location}) has no {spec.config_file}; add one, or point "
                    "the source at the checkpoint it belongs to")
    if config is None:  # validate refuses an assertion about a config the rule does not write
        return f"{head}: this rule writes no {rules.output.config_file}; add 'of: SOURCE' or a config section"
    value = get_path(dict(config), item.path)
    if value is MISSING or value is None:
        if item.optional:
            return None
        state = "has no field" if value is MISSING else "has null for"
        return f"{head}: {label} {state} {item.path!r}; {fix}"
    refs = References(rules, ckpts, vocab, dict(config), label)
    subject = f"{item.path!r} of {label}"
    # Elements first: "[2] is 40, not below 36" says more than the whole list's inequality.
    if item.each:
        if not isinstance(value, list):
            return f"{head}: {subject} is {_show(value)}, not a list"
        for i, element in enumerate(value):
            for check, expected in item.each:
                problem = _one(check, element, expected, refs, head, f"{item.path}[{i}] of {label}")
                if problem is not None:
                    return f"{head}: {problem}"
    for check, expected in item.checks:
        problem = _one(check, value, expected, refs, head, subject)
        if problem is not None:
            return f"{head}: {problem}"
    return None


def _evaluate(value: Any, refs: References, where: str) -> Any:
    """``value`` with every ``${...}`` in it evaluated (``equals: [2, '${...}']``)."""
    if isinstance(value, list):
        return [_evaluate(v, refs, where) for v in value]
    if isinstance(value, dict):
        return {k: _evaluate(v, refs, where) for k, v in value.items()}
    return refs.evaluate(value, where)


def _one(check: str, value: Any, expected: Any, refs: References, head: str, subject: str) -> str | None:
    """Why ``value`` fails ``check`` against ``expected`` (None when it passes)."""
    if check == "equals":
        want = _evaluate(expected, refs, head)
        return None if _same(value, want) else f"{subject} is {_show(value)}, not {_named(want, expected)}"
    if check == "one_of":
        options = _evaluate(expected, refs, head)
        if any(_same(value, option) for option in options):
            return None
        return f"{subject} is {_show(value)}, not one of {', '.join(map(_show, options))}"
    if check == "length":
        want = refs.integer(expected, head)
        if not isinstance(value, list):
            return f"{subject} is {_show(value)}, not a list"
        return None if len(value) == want else \
            f"{subject} has {len(value)} element{'s' if len(value) != 1 else ''}, not {_named(want, expected)}"
    holds, wording = _BOUNDS[check]
    bound = refs.evaluate(expected, head)
    if not _is_number(bound):
        return f"{check} {expected!r} is {_show(bound)}, not a number"
    if not _is_number(value):
        return f"{subject} is {_show(value)}, not a number"
    return None if holds(value, bound) else f"{subject} is {_show(value)}, {wording} {_named(bound, expected)}"


def _is_number(value: Any) -> bool:
    # an int of any size is a number (math.isfinite would convert it to a float and overflow)
    return isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and math.isfinite(value)


def _same(a: Any, b: Any) -> bool:
    """JSON equality: 1 == 1.0, but a boolean is not a number."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b) and (_is_number(a) == _is_number(b))


def _named(value: Any, written: Any) -> str:
    """The expected value, and the ``${...}`` it came from."""
    if _same(value, written):
        return _show(value)
    return f"{_show(value)} ({written})" if isinstance(written, str) else _show(value)


def _show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 80 else text[:77] + "..."
