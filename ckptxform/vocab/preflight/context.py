"""One preflight run's inputs, and the facts every check derives from them the same way
(the verifier's vocabulary and width: from ``--verifier`` when given, else from what the
drafter's config says of it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .drafter import Opened, Verifier


@dataclass(frozen=True)
class Context:
    drafter: Opened
    verifier: Verifier | None
    family: str
    layout: str
    consumers: tuple[str, ...]

    @property
    def layer_config(self) -> dict[str, Any]:
        """The decoder layer's config: ``transformer_layer_config`` of a speculators config."""
        inner = self.drafter.config.get("transformer_layer_config")
        return inner if self.layout == "speculators" and isinstance(inner, dict) else self.drafter.config

    def int_config(self, path: str) -> int | None:
        return _int(self.drafter.get(path))

    def layer_int(self, name: str) -> int | None:
        return _int(self.layer_config.get(name))

    @property
    def vocab_size(self) -> int | None:
        """The verifier's vocabulary: its embedding rows or config, else the drafter's word."""
        if self.verifier is not None:
            embed = self.verifier.embed_rows
            if embed is not None:
                return embed[1]
            if self.verifier.int_field("vocab_size") is not None:
                return self.verifier.int_field("vocab_size")
        declared = self.layer_int("vocab_size")
        if declared is not None:
            return declared
        t2d = self.drafter.shape("t2d")
        return t2d[0] if t2d else None

    @property
    def hidden_size(self) -> int | None:
        return self.layer_int("hidden_size")

    @property
    def verifier_hidden(self) -> int | None:
        if self.verifier is not None and self.verifier.int_field("hidden_size") is not None:
            return self.verifier.int_field("hidden_size")
        return self.int_config("target_hidden_size") or self.hidden_size

    @property
    def verifier_layers(self) -> int | None:
        return None if self.verifier is None else self.verifier.int_field("num_hidden_layers")

    def special(self, name: str) -> Any:
        for config in (self.drafter.config, self.layer_config,
                       None if self.verifier is None else self.verifier.text):
            if config is not None and config.get(name) is not None:
                return config[name]
        return None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
