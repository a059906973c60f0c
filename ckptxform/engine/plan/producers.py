"""What writes each output key, as the plan's messages name it: ``tensors[0] (rules.yaml:6)
(from model:x)``, ``add.x (rules.yaml:9)``.

An output a rule copies from one source tensor (a ``CopyTensor``) says its producer
itself: its ``rule`` is the rule's position, its recipe the tensor it reads. Those are
made when a message asks; only the others are held (a ``RuleRead`` and a dict entry an
output were ~95 bytes a tensor while planning 200,000 renames).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from ...errors import printable
from ...rules.model import TensorRule
from .recipes import CopyTensor, OutputPlan


@dataclass(frozen=True, slots=True)
class RuleRead:
    """A rule's output read from ``source``'s tensor ``key``, as messages name what writes it:
    made into text only for a message (as a str it was ~140 bytes an output while planning)."""

    rule: TensorRule
    source: str
    key: str

    def __str__(self) -> str:
        return f"{self.rule.label} (from {self.source}:{printable(self.key)})"


def rules_by_position(rules: Sequence[TensorRule]) -> dict[str, TensorRule]:
    """Each tensor rule by its position (``FILE:LINE``, what an ``OutputPlan`` names), for
    the positions no other rule shares (two rules on one line of a flow-style file do)."""
    seen = Counter(rule.where.short for rule in rules)
    return {rule.where.short: rule for rule in rules if seen[rule.where.short] == 1}


class Producers(Mapping[str, object]):
    """Output key -> what writes it (its str() is the message's wording), over the planner's
    ``outputs`` as they grow; ``add`` each output's producer once its output is in."""

    def __init__(self, outputs: Mapping[str, OutputPlan], rule_at: Mapping[str, TensorRule]) -> None:
        self._outputs = outputs
        self._rule_at = rule_at
        #: the producers an output does not say
        self._said: dict[str, object] = {}

    def add(self, out: OutputPlan, producer: object) -> object | None:
        """Hold ``producer`` unless ``out`` says it; it is (None when not held). Called before
        ``out`` is known to be the first of its key (outputs are checked for a key written
        twice a batch at a time): an earlier producer held stays."""
        recipe = out.recipe
        if (type(producer) is RuleRead and type(recipe) is CopyTensor and recipe.key == producer.key
                and recipe.source == producer.source and self._rule_at.get(out.rule) is producer.rule):
            return None
        self._said.setdefault(out.key, producer)
        return producer

    def of(self, out: OutputPlan, held: object | None) -> object:
        """What writes ``out``: ``held``, or when None (``add`` did not hold it) what ``out`` says."""
        return held if held is not None else self._said_by(out)

    def earlier(self, key: str, later: object) -> object:
        """What wrote ``key`` before ``later`` (``add``-ed too) wrote it again."""
        said = self._said.get(key)
        if said is not None and said is later:  # the first held: the earlier says itself
            del self._said[key]
            said = None
        return self[key] if said is None else said

    def __getitem__(self, key: str) -> object:
        said = self._said.get(key)
        if said is not None:
            return said
        return self._said_by(self._outputs[key])

    def _said_by(self, out: OutputPlan) -> RuleRead:
        recipe = out.recipe
        assert type(recipe) is CopyTensor
        return RuleRead(self._rule_at[out.rule], recipe.source, recipe.key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._outputs)

    def __len__(self) -> int:
        return len(self._outputs)
