"""Who loads a drafter, and how each reads the config fields they disagree on.

Facts, with where they were read (the public code named in /shared notes and in the
shipped rules' comments):

- EAGLE-3 verifier layers. speculators reads ``eagle_aux_hidden_state_layer_ids`` (top
  level); vLLM reads the top-level field and, in recent releases, SpecForge's
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` (``_get_eagle3_aux_layers_from_config``);
  SGLang reads only ``eagle_config.eagle_aux_hidden_state_layer_ids``. Absent, each uses
  EAGLE's default verifier layers 2, N/2, N-3 (N: the verifier's layer count).
- EAGLE-3 norm flags (read at speculators c05b95b, vLLM, SGLang and SpecForge a6b6b02).
  speculators reads a missing ``norm_before_residual``, ``norm_before_fc``, ``fc_norm`` or
  ``norm_output`` as false (src/speculators/models/eagle3/config.py L43-82). vLLM reads a
  *speculators* config through ``update_eagle3``
  (vllm/transformers_utils/configs/speculators/algos.py L32:
  ``config_dict.get("norm_before_residual", True)``): a missing ``norm_before_residual``
  is TRUE there, false in speculators. A native config vLLM reads with ``getattr(config,
  "norm_before_residual", False)`` (vllm/model_executor/models/llama_eagle3.py,
  LlamaDecoderLayer.__init__). ``norm_output: true`` means EAGLE-3.1 everywhere it is read
  at inference: the post-norm hidden state is fed to the next draft step (speculators
  config.py L76-82 and models/eagle3/core.py L302; vLLM pull request #42764; SGLang's
  llama_eagle3.py, default false, cited by SpecForge pull request #879); absent or false
  is classic EAGLE-3 (pre-norm feedback, normed lm_head input) for every consumer. SpecForge
  between July and September 2026 read it otherwise (specforge/modeling/draft/llama3_eagle.py
  L1690 and L1773 at a6b6b02: default true, meaning only "norm before lm_head", feedback
  always pre-norm), so its drafters of that time may say ``norm_output: true`` for classic
  EAGLE-3; its pull request #879 aligned it with the others.
- DFlash verifier layers. z-lab's ``dflash_config.target_layer_ids`` i reads the
  verifier's hidden_states[i + 1] (index 0 is the embedding output); speculators' and
  vLLM's ``aux_hidden_state_layer_ids`` are used as they are, so a z-lab id must be shifted
  by +1 on the way (an id shifted past the verifier's last layer is dropped). vLLM also
  reads a native config: ``dflash_config.target_layer_ids + 1`` (and DeepSpec's
  ``target_layer_ids + 1``) when there is no ``eagle_aux_hidden_state_layer_ids``
  (vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py, get_eagle3_aux_layers_from_config;
  before its pull request #40727 the ids went unshifted, one layer early).
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
    ("dflash", "native"): ("vllm", "sglang", "transformers"),
    ("mtp", "speculators"): ("speculators", "vllm"),
    ("dspark", "speculators"): ("speculators", "vllm"),
    ("dspark", "native"): ("vllm", "sglang"),
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

#: EAGLE-3 flag -> (layout, consumer) -> what a missing flag is read as (pairs not listed:
#: false); see the module docstring for where each was read
EAGLE3_FLAG_DEFAULTS: dict[str, dict[tuple[str, str], bool]] = {
    "norm_before_residual": {("speculators", "vllm"): True},
    "norm_before_fc": {},
    "fc_norm": {},
    "norm_output": {},
}

#: DFlash ``block_size`` where it is missing -> (layout, consumer) -> what that consumer
#: does: speculators' DFlashSpeculatorConfig defaults it to 8 (models/dflash/config.py);
#: z-lab's dflash package reads ``dflash_config.block_size``, then the top-level one, else 16
#: (dflash 0.1.0, dflash/model.py DFlashDraftModel.__init__), and speculators'
#: DFlashConverter refuses a z-lab config with neither (convert/dflash/converter.py)
DFLASH_BLOCK_DEFAULTS: dict[tuple[str, str], str] = {
    ("speculators", "speculators"): "reads 8 (DFlashSpeculatorConfig's default)",
    ("native", "transformers"): "z-lab's dflash package reads 16 (its default), speculators' DFlashConverter "
                                "refuses the checkpoint",
}

#: DFlash-family flag -> (family -> what speculators reads a missing one as)
DFLASH_FLAG_DEFAULTS: dict[str, dict[str, bool]] = {
    "sample_from_anchor": {"dflash": False, "dspark": True},
}


def flag_default(flag: str, consumer: str, layout: str) -> bool:
    return EAGLE3_FLAG_DEFAULTS[flag].get((layout, consumer), False)


def disagree(flag: str, layout: str) -> bool:
    """Whether consumers of ``layout`` read a missing ``flag`` differently."""
    return len({flag_default(flag, c, layout) for c in CONSUMERS[:3]}) > 1


def readers(flag: str, layout: str) -> str:
    """Who reads a missing ``flag`` how, e.g. ``speculators, sglang read false; vllm reads true``."""
    by_value: dict[bool, list[str]] = {}
    for consumer in CONSUMERS[:3]:
        by_value.setdefault(flag_default(flag, consumer, layout), []).append(consumer)
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
