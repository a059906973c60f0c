"""Who loads a drafter, and how each reads the config fields they disagree on.

Facts, with where they were read (the public code named in /shared notes and in the
shipped rules' comments):

- EAGLE-3 verifier layers. speculators reads ``eagle_aux_hidden_state_layer_ids`` (top
  level); vLLM reads the top-level field and, in recent releases, SpecForge's
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` (``_get_eagle3_aux_layers_from_config``);
  SGLang reads only ``eagle_config.eagle_aux_hidden_state_layer_ids``. Absent, each uses
  EAGLE's default verifier layers 2, N/2, N-3 (N: the verifier's layer count).
- EAGLE-3 norm flags. speculators and vLLM read a missing ``norm_before_residual``,
  ``norm_before_fc``, ``fc_norm`` or ``norm_output`` as false; SpecForge, which trains the
  drafters SGLang serves, reads a missing ``norm_output`` as true.
- DFlash verifier layers. z-lab's ``dflash_config.target_layer_ids`` i reads the
  verifier's hidden_states[i + 1] (index 0 is the embedding output); speculators' and
  vLLM's ``aux_hidden_state_layer_ids`` are used as they are, so a z-lab id must be shifted
  by +1 on the way (an id shifted past the verifier's last layer is dropped).
- DFlash ``sample_from_anchor``: speculators' DFlash reads a missing one as false, its
  DSpark as true (DeepSpec's convention: the anchor slot drafts too). DeepSpec's DSpark
  ``target_layer_ids`` are z-lab's convention, with -1 the embedding output.
"""

from __future__ import annotations

from collections.abc import Iterable

from ...errors import UsageError

#: every consumer ``--for`` accepts, in report order
CONSUMERS: tuple[str, ...] = ("speculators", "vllm", "sglang", "llama.cpp", "transformers")

#: (family, layout) -> the consumers that load that layout, when ``--for`` is not given
DEFAULT_CONSUMERS: dict[tuple[str, str], tuple[str, ...]] = {
    ("eagle3", "speculators"): ("speculators", "vllm"),
    ("eagle3", "native"): ("sglang", "vllm"),
    ("dflash", "speculators"): ("speculators", "vllm"),
    ("dflash", "native"): ("sglang", "transformers"),
    ("mtp", "speculators"): ("speculators", "vllm"),
    ("dspark", "speculators"): ("speculators", "vllm"),
    ("dspark", "native"): ("sglang",),
}

#: where each consumer reads an EAGLE-3 drafter's verifier layers, first found wins
EAGLE3_AUX_FIELDS: dict[str, tuple[str, ...]] = {
    "speculators": ("eagle_aux_hidden_state_layer_ids",),
    "vllm": ("eagle_aux_hidden_state_layer_ids", "eagle_config.eagle_aux_hidden_state_layer_ids"),
    "sglang": ("eagle_config.eagle_aux_hidden_state_layer_ids",),
    "llama.cpp": ("eagle_aux_hidden_state_layer_ids",),
    "transformers": ("eagle_aux_hidden_state_layer_ids",),
}
EAGLE3_DEFAULT_AUX = "EAGLE's default verifier layers 2, N/2 and N-3"

#: EAGLE-3 flag -> consumer -> what a missing flag is read as (consumers not listed: false)
EAGLE3_FLAG_DEFAULTS: dict[str, dict[str, bool]] = {
    "norm_before_residual": {},
    "norm_before_fc": {},
    "fc_norm": {},
    "norm_output": {"sglang": True},
}

#: DFlash-family flag -> (family -> what speculators reads a missing one as)
DFLASH_FLAG_DEFAULTS: dict[str, dict[str, bool]] = {
    "sample_from_anchor": {"dflash": False, "dspark": True},
}


def flag_default(flag: str, consumer: str) -> bool:
    return EAGLE3_FLAG_DEFAULTS[flag].get(consumer, False)


def readers(flag: str) -> str:
    """Who reads a missing ``flag`` how, e.g. ``speculators, vllm read false; sglang reads true``."""
    by_value: dict[bool, list[str]] = {}
    for consumer in CONSUMERS[:3]:
        by_value.setdefault(flag_default(flag, consumer), []).append(consumer)
    return "; ".join(f"{', '.join(names)} read{'s' if len(names) == 1 else ''} {str(value).lower()}"
                     for value, names in by_value.items())


def parse_consumers(value: str | Iterable[str] | None) -> tuple[str, ...] | None:
    """``--for speculators,vllm`` as a tuple in report order (None: the layout's defaults)."""
    if value is None:
        return None
    names = [n.strip() for n in (value.split(",") if isinstance(value, str) else value) if n.strip()]
    unknown = [n for n in names if n not in CONSUMERS]
    if unknown or not names:
        raise UsageError(f"--for {','.join(names) or repr(value)}: unknown consumer {', '.join(unknown) or '(none)'}; "
                         f"fix: name one or more of {','.join(CONSUMERS)}")
    return tuple(c for c in CONSUMERS if c in names)
