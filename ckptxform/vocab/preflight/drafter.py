"""What ``preflight`` reads of a checkpoint: its config, its tensor headers and the small
vocabulary tensors (never a weight), and which drafter family and layout it is."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...sources.base import Checkpoint, TensorInfo
from ...sources.resolve import open_location

#: tensors read whole: the draft-vocabulary maps (a few hundred kB at most)
_SMALL = ("d2t", "t2d")


@dataclass(frozen=True)
class Opened:
    """A checkpoint as preflight sees it."""

    location: str
    config: dict[str, Any]
    tensors: Mapping[str, TensorInfo]
    small: dict[str, bytes] = field(default_factory=dict)

    def get(self, path: str) -> Any:
        """The config value at a dotted ``path`` (None when absent)."""
        value: Any = self.config
        for part in path.split("."):
            if not isinstance(value, dict) or part not in value:
                return None
            value = value[part]
        return value

    def has(self, path: str) -> bool:
        head, _, last = path.rpartition(".")
        parent = self.get(head) if head else self.config
        return isinstance(parent, dict) and last in parent

    def shape(self, key: str) -> tuple[int, ...] | None:
        info = self.tensors.get(key)
        return None if info is None else info.shape


def open_checkpoint(location: str, *, name: str, small: bool = True) -> Opened:
    """Headers and config of ``location`` (local or Hub), and the vocabulary tensors."""
    with open_location(location, name=name) as ckpt:
        return _snapshot(ckpt, location, small)


def _snapshot(ckpt: Checkpoint, location: str, small: bool) -> Opened:
    config = ckpt.config() or {}
    tensors = dict(ckpt.tensors)
    data = {key: ckpt.read(tensors[key]) for key in _SMALL if small and key in tensors}
    return Opened(location, config if isinstance(config, dict) else {}, tensors, data)


def family_and_layout(d: Opened) -> tuple[str, str]:
    """``(family, layout)``: family ``eagle3``, ``dflash``, ``dspark``, ``mtp`` or ``model``
    (any other checkpoint); layout ``speculators`` (a speculators config) or ``native``."""
    kind = d.config.get("speculators_model_type")
    if isinstance(kind, str):
        return kind, "speculators"
    architectures = d.config.get("architectures") or []
    if "LlamaForCausalLMEagle3" in architectures or any(k.startswith("midlayer.") for k in d.tensors):
        return "eagle3", "native"
    if "dflash_config" in d.config:
        return "dflash", "native"
    if "Qwen3DSparkModel" in architectures:  # DeepSpec's DSpark: its fields flat in the config
        return "dspark", "native"
    return "model", "native"


@dataclass(frozen=True)
class Verifier:
    """The verifier's facts preflight compares against (its text config for a VLM wrapper)."""

    location: str
    config: dict[str, Any]
    tensors: Mapping[str, TensorInfo]

    @property
    def text(self) -> dict[str, Any]:
        inner = self.config.get("text_config")
        return inner if isinstance(inner, dict) else self.config

    def int_field(self, name: str) -> int | None:
        value = self.text.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def embed_rows(self) -> tuple[str, int] | None:
        """The verifier's input embedding: its key and vocabulary rows."""
        for key, info in self.tensors.items():
            if key.endswith("embed_tokens.weight") and len(info.shape) == 2:
                return key, info.shape[0]
        return None


def open_verifier(location: str) -> Verifier:
    opened = open_checkpoint(location, name="verifier", small=False)
    return Verifier(location, opened.config, opened.tensors)
