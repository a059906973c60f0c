"""An ``add`` entry that is a constant: an output tensor no source has, every element one
value (a bias a target layout expects, a norm of ones)::

    add:
      model.layers.{L}.self_attn.o_proj.bias:
        fill: 0                              # a number or ${...}
        shape: ['${config.hidden_size}']     # integers or ${...}
        for_each: model.layers.{L}.self_attn.o_proj.weight
        # dtype: bfloat16                    # or ${...}; default: the matched output's

A key with template variables is written once per output key of the tensor rules that
``for_each`` matches, bound as that match binds them: one entry covers every layer the
source has, and no more. Here: what the loader reads of such an entry and what it refuses
(the planner evaluates it: engine/plan/constants.py).
"""

from __future__ import annotations

from typing import Any

from .templates import Template, TemplateError, parse_template

#: (path under the entry, message)
Problem = tuple[tuple[str, ...], str]


def constant_templates(key: str, entry: dict[str, Any]) -> tuple[Template | None, Template | None]:
    """The entry's key template (None for a literal key) and its ``for_each`` (the loader
    calls this after ``constant_problems`` found none)."""
    for_each = entry.get("for_each")
    if for_each is None:
        return None, None
    return parse_template(key), parse_template(for_each)


def constant_problems(key: str, entry: dict[str, Any]) -> list[Problem]:
    """What is wrong with a constant entry's key, ``for_each`` and ``dtype`` (expressions
    are checked by semantic_checks.py with every other ``${...}``)."""
    try:
        template = parse_template(key)
    except TemplateError as err:
        return [((), f"the key: {err}")]
    for_each_text = entry.get("for_each")
    if not isinstance(for_each_text, str):
        if template.variables:
            names = ", ".join("{" + name + "}" for name in template.variables)
            return [((), f"the key names {names}, which nothing binds: add for_each, the output key template "
                         "whose matches bind them (model.layers.{L}.self_attn.o_proj.weight)")]
        if "dtype" not in entry:
            return [((), "no dtype: give the constant's dtype (bfloat16, float32, ... or ${...})")]
        return []
    try:
        for_each = parse_template(for_each_text)
    except TemplateError as err:
        return [(("for_each",), str(err))]
    problems: list[Problem] = []
    unbound = [name for name in template.variables if name not in for_each.variables]
    if unbound:
        problems.append(((), f"the key names {', '.join('{' + n + '}' for n in unbound)}, which for_each "
                             f"{for_each.text!r} does not bind; bind it there or remove it from the key"))
    unused = [name for name in for_each.variables if name not in template.variables]
    if unused:
        problems.append((("for_each",), f"binds {', '.join('{' + n + '}' for n in unused)}, which the key does "
                                        "not use: every match would write the same key; use it in the key"))
    for name, var in template.variables.items():
        mine = for_each.variables.get(name)
        if var.values is not None and mine is not None and (mine.values is None or len(mine.values) != len(var.values)):
            problems.append(((), f"{var.spelled()} must list as many names as for_each's "
                                 f"{mine.spelled()}: they pair up by position"))
    return problems
