"""``require.config``: read a rule file's config assertions into ``ConfigAssertion``s, and
find what the schema cannot see in them (an unknown ``of`` source, a bad ``${...}``
reference, an assertion about a written config the rule does not write).

The assertions themselves are decided at plan time (engine/plan/config_requirements.py).
"""

from __future__ import annotations

from typing import Any

from .expr import is_expression, parse_expression
from .extends import Merged
from .model import ConfigAssertion
from .semantic_checks import Problem, _did_you_mean, _reference_problems

#: the checks of one value, in the order messages list them
CHECKS = ("equals", "one_of", "min", "max", "above", "below")


def parse_config_assertions(m: Merged) -> tuple[ConfigAssertion, ...]:
    """The ``require.config`` entries of a valid merged rule file, in file order."""
    node = m.require.get("config")
    if node is None:
        return ()
    out = []
    for path, spec in node.value.items():
        each = spec.get("each") or {}
        out.append(ConfigAssertion(
            path=path, where=node.where(path, key=True), of=spec.get("of"), optional=spec.get("optional", False),
            checks=tuple((c, spec[c]) for c in (*CHECKS, "length") if c in spec),
            each=tuple((c, each[c]) for c in CHECKS if c in each), reason=spec.get("reason")))
    return tuple(out)


def config_assertion_problems(m: Merged) -> list[Problem]:
    """Unknown sources and bad references of ``require.config``, each at its YAML node."""
    node = m.require.get("config")
    if node is None or not isinstance(node.value, dict):
        return []
    sources, vocabs = list(m.named["sources"]), list(m.named["vocab"])
    out: list[Problem] = []

    def report(sub: tuple[str | int, ...], message: str, key: bool = False) -> None:
        where = node.where(*sub, key=key)
        out.append(((where.file, where.line, where.col), f"{node.at(*sub, key=key)} {message}"))

    for path, spec in node.value.items():
        if not isinstance(spec, dict):
            continue
        of = spec.get("of")
        if isinstance(of, str) and of not in sources:
            report((path, "of"), f"unknown source {of!r}{_did_you_mean(of, sources)}")
        if of is None and m.config is None:
            report((path,), "asserts a field of the written config.json, but this rule writes none (no "
                   "'config' section); add 'of: SOURCE' to check a source's config, or a 'config' section",
                   key=True)
        for sub, problem in _reference_problems(_expressions(spec), (path,), sources, vocabs):
            report(sub, problem)
    return out


def _expressions(spec: dict[str, Any]) -> dict[str, Any]:
    """The values of an assertion that may hold ``${...}`` (``each`` nested)."""
    found: dict[str, Any] = {c: spec[c] for c in (*CHECKS, "length") if c in spec}
    if isinstance(spec.get("each"), dict):
        found["each"] = {c: v for c, v in spec["each"].items() if c in CHECKS}
    return found


def sources_read(assertions: tuple[ConfigAssertion, ...], values: list[Any]) -> set[str]:
    """The sources whose config the assertions (``of`` and ``${source.NAME.config...}``) or
    the ``values`` (config.set) read, so that the planner opens them."""
    names = {a.of for a in assertions if a.of is not None}
    pending = [v for a in assertions for _, v in (*a.checks, *a.each)] + list(values)
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
        elif is_expression(value):
            names.update(r.path[0] for r in parse_expression(value).refs()
                         if r.kind == "source" and len(r.path) >= 2 and r.path[1] == "config")
    return names
