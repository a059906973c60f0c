"""The parts of a ``key:`` rule (templates, ``to``, ``ops``) parsed and checked together.

What the schema cannot see is checked here, at validate time (exit 2, FILE:LINE:COL):
malformed templates and expressions, unknown ops, and the flow of template variables
through the chain: a variable of ``key`` that ``to`` lacks must be reduced by exactly one
op, and a variable of ``to`` that ``key`` lacks made by exactly one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..ops import OPS
from ..ops.base import Step
from .expr import ExpressionError, is_expression, parse_expression
from .templates import Template, TemplateError, parse_template

Problem = tuple[tuple[str | int, ...], str]


@dataclass
class ParsedTemplateRule:
    key: Template | None = None
    to: tuple[Template, ...] = ()
    steps: tuple[Step, ...] = ()
    problems: list[Problem] = field(default_factory=list)


def parse_template_rule(rule: dict[str, Any], where: Any) -> ParsedTemplateRule:
    """Parse ``rule``'s key/to/ops; ``where(*sub)`` gives the place of a part."""
    out = ParsedTemplateRule()
    try:
        out.key = parse_template(rule["key"])
    except TemplateError as err:
        out.problems.append((("key",), str(err)))
        return out
    to_values = rule.get("to", rule["key"])
    listed = isinstance(to_values, list)
    to: list[Template] = []
    for i, text in enumerate(to_values if listed else [to_values]):
        sub: tuple[str | int, ...] = ("to", i) if listed else ("to",)
        try:
            to.append(parse_template(text))
        except TemplateError as err:
            out.problems.append((sub, str(err)))
    out.to = tuple(to)
    steps = []
    for i, item in enumerate(rule.get("ops") or []):
        if not isinstance(item, dict) or len(item) != 1:
            continue  # the schema says so
        (verb, args), = item.items()
        op = OPS.get(verb)
        if op is None:
            continue
        places = tuple((name, where("ops", i, verb, name)) for name in args) if isinstance(args, dict) else ()
        steps.append(Step(op, args, where("ops", i), places=places))
        for sub, value in _expressions(args, ("ops", i, verb)):
            try:
                parse_expression(value)
            except ExpressionError as err:
                out.problems.append((sub, str(err)))
    out.steps = tuple(steps)
    if len(to) == len(to_values if listed else [to_values]) and len(steps) == len(rule.get("ops") or []):
        out.problems.extend(_flow_problems(out.key, out.to, out.steps, listed))
    return out


def _expressions(value: Any, sub: tuple[str | int, ...]) -> list[tuple[tuple[str | int, ...], str]]:
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _expressions(v, sub + (k,))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _expressions(v, sub + (i,))]
    return [(sub, value)] if is_expression(value) else []


def _flow_problems(key: Template, to: tuple[Template, ...], steps: tuple[Step, ...], listed: bool) -> list[Problem]:
    out: list[Problem] = []
    live = set(key.variables)
    for i, step in enumerate(steps):
        sub: tuple[str | int, ...] = ("ops", i, step.verb)
        var = step.variable
        if step.op.kind == "reduce":
            if var not in live:
                out.append((sub, f"{step.verb} over {var!r}: 'key' has no variable {{{var}}} left to reduce "
                            f"(variables: {', '.join(sorted(live)) or 'none'})"))
            live.discard(var or "")
        elif step.op.kind == "split":
            if var in live:
                out.append((sub, f"{step.verb} into {var!r}: {{{var}}} is already bound; name a new variable "
                            "of 'to'"))
            live.add(var or "")
    for j, tpl in enumerate(to):
        where: tuple[str | int, ...] = ("to", j) if listed else ("to",)
        want = set(tpl.variables)
        extra, missing = sorted(live - want), sorted(want - live)
        if extra:
            out.append((where, f"{', '.join('{' + v + '}' for v in extra)} of 'key' is not in 'to' and no op "
                        "reduces it; add stack/concat over it, or put it in 'to'"))
        if missing:
            out.append((where, f"{', '.join('{' + v + '}' for v in missing)} of 'to' is neither in 'key' nor made "
                        "by an op; add split/unstack into it, or put it in 'key'"))
        for name, part in tpl.variables.items():
            mine = key.variables.get(name)
            if mine is not None and part.values is not None and (
                    mine.values is None or len(mine.values) != len(part.values)):
                out.append((where, f"{part.spelled()} pairs with {mine.spelled()} of 'key': enumerate as many "
                            "names on both sides"))
    return out

