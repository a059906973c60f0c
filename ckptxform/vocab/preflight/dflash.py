"""DFlash (and DSpark) drafters: the verifier layers under the two conventions (z-lab's
``dflash_config.target_layer_ids`` read hidden_states[i + 1]; speculators' and vLLM's
``aux_hidden_state_layer_ids`` are those ids + 1), fc's width, and the flags whose
default depends on the model (see ``consumers``)."""

from __future__ import annotations

from .consumers import DFLASH_FLAG_DEFAULTS
from .context import Context
from .findings import Finding, for_each
from .layers import fc_width_findings, ids_or_none, range_findings

_SPECULATORS_READERS = ("speculators", "vllm", "llama.cpp")
_FIELD = "aux_hidden_state_layer_ids"
_ZLAB = "dflash_config.target_layer_ids"


def dflash_findings(ctx: Context) -> list[Finding]:
    if ctx.layout == "native":
        return _native(ctx)
    out: list[Finding] = []
    ids = ids_or_none(ctx.drafter.get(_FIELD))
    zlab = ids_or_none(ctx.drafter.get(_ZLAB)) or ids_or_none(ctx.drafter.get("transformer_layer_config." + _ZLAB))
    for consumer in ctx.consumers:
        if ids is None:
            out.append(Finding(consumer, "aux-ids-missing", _FIELD,
                               f"{consumer} reads no verifier layer ids ({_FIELD}); vLLM then falls back to EAGLE-3's "
                               "3 default layers and fc gets the wrong input",
                               f"write {_FIELD}: the drafter's target_layer_ids + 1", "dflash_to_speculators"))
            continue
        out += _unshifted(consumer, ids, zlab)
        out += range_findings(ctx, consumer, _FIELD, ids)
        out += fc_width_findings(ctx, consumer, len(ids))
    out += _flags(ctx)
    return out


def _unshifted(consumer: str, ids: list[int], zlab: list[int] | None) -> list[Finding]:
    if zlab is not None and ids == zlab:
        why = (f"they equal the z-lab target_layer_ids {zlab} beside them, which read hidden_states[i + 1]: "
               f"{consumer} feeds the state one layer earlier than the drafter was trained on")
    elif 0 in ids:
        why = (f"id 0 is the verifier's embedding output for {consumer}, which no z-lab DFlash drafter reads "
               "(its target_layer_id 0 is the first layer's output, id 1 here): the ids look unshifted")
    else:
        return []
    return [Finding(consumer, "aux-ids-unshifted", _FIELD, f"{ids}: {why}",
                    f"write target_layer_ids + 1 ({[i + 1 for i in (zlab or ids)]}), dropping an id past the "
                    "verifier's last layer", "dflash_to_speculators")]


def _native(ctx: Context) -> list[Finding]:
    out: list[Finding] = []
    ids = ids_or_none(ctx.drafter.get(_ZLAB))
    for consumer in ctx.consumers:
        if consumer in ("speculators", "vllm"):
            out.append(Finding(consumer, "layout", "speculators_model_type",
                               f"a z-lab DFlash config (dflash_config, no speculators_model_type): {consumer} reads "
                               f"its verifier layers from {_FIELD}, which this config does not have",
                               "convert it to the speculators layout", "dflash_to_speculators"))
            continue
        if ids is None:
            out.append(Finding(consumer, "aux-ids-missing", _ZLAB,
                               "the drafter names no verifier layers: the consumer cannot know which hidden states "
                               "fc was trained on", "write dflash_config.target_layer_ids as trained"))
            continue
        # z-lab id i reads hidden_states[i + 1]: the last valid id is the verifier's N - 1
        out += range_findings(ctx, consumer, _ZLAB, ids)
        out += fc_width_findings(ctx, consumer, len(ids))
    return out


def _flags(ctx: Context) -> list[Finding]:
    out: list[Finding] = []
    for flag, defaults in DFLASH_FLAG_DEFAULTS.items():
        if ctx.drafter.has(flag):
            continue
        shown = "; ".join(f"{family} reads {str(v).lower()}" for family, v in defaults.items())
        out += for_each([c for c in ctx.consumers if c in _SPECULATORS_READERS], "flag-missing", flag,
                        f"absent, and its default depends on the model class ({shown}): this {ctx.family} drafter "
                        f"is read as {str(defaults.get(ctx.family, False)).lower()}",
                        f"write {flag} explicitly, as the drafter was trained")
    return out
