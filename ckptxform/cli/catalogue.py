"""The rule library as a catalogue: each shipped rule with its sources, the families it
covers, the reference it is checked against and whether it inverts, for ``ckptxform rules
show NAME`` and the README's table (``python -m ckptxform.cli.catalogue`` prints the table;
tests/test_rule_standins.py checks that the README holds exactly that).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import RuleError, UsageError
from ..rules.catalogue import shipped_rules
from ..rules.library import ShippedRule, shipped_rule_path
from ..standins.for_rules import STANDINS, RuleStandin


@dataclass(frozen=True)
class RuleCard:
    """What the catalogue says of one shipped rule."""

    rule: ShippedRule
    standin: RuleStandin
    #: None when ``ckptxform invert`` gives the reverse, else why it does not
    no_inverse: str | None

    def to_dict(self) -> dict[str, object]:
        s = self.standin
        return {**self.rule.to_dict(), "from": s.source_layout, "to": s.target_layout, "families": s.families,
                "checked_against": s.checked_against, "inverts": self.no_inverse is None,
                "no_inverse": self.no_inverse, "demo": f"ckptxform demo {self.rule.stem}"}


def _no_inverse(rule: ShippedRule) -> str | None:
    from ..rules.invert import inverse_yaml
    from ..rules.loader import load_rules

    try:
        inverse_yaml(load_rules(rule.path))
    except RuleError as err:
        return "; ".join(err.problems)
    return None


def _card(rule: ShippedRule) -> RuleCard:
    standin = STANDINS.get(rule.stem)
    if standin is None:  # a shipped rule always has one (tests/test_rule_standins.py)
        raise UsageError(f"shipped rule {rule.stem!r} has no stand-in entry in ckptxform/standins/for_rules.py")
    return RuleCard(rule, standin, _no_inverse(rule))


def rule_card(name: str) -> RuleCard:
    """The card of the shipped rule of file stem or ``name:`` ``name``."""
    path = shipped_rule_path(name)
    found = [r for r in shipped_rules() if path is not None and r.path == path]
    if not found:
        stems = ", ".join(r.stem for r in shipped_rules())
        raise UsageError(f"rules show {name!r}: no shipped rule has that file stem or name (shipped: {stems})")
    return _card(found[0])


def rule_cards() -> list[RuleCard]:
    return [_card(rule) for rule in shipped_rules()]


def readme_table(cards: list[RuleCard] | None = None) -> str:
    """The README's table of the rule library, one row per shipped rule."""
    rows = ["| rule | from | to | real models | checked against | inverts |", "|---|---|---|---|---|---|"]
    for card in rule_cards() if cards is None else cards:
        s = card.standin
        rows.append(f"| `{card.rule.stem}` | {s.source_layout} | {s.target_layout} | {s.families} | "
                    f"{s.checked_against} | {'yes' if card.no_inverse is None else 'no'} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(readme_table(), end="")
