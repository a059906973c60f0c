"""DFlash (and DSpark) drafters: the verifier layers under the two conventions (z-lab's
``dflash_config.target_layer_ids`` read hidden_states[i + 1]; speculators' and vLLM's
``aux_hidden_state_layer_ids`` are those ids + 1), fc's width, and the flags whose
default depends on the model (see ``consumers``)."""

from __future__ import annotations

from .consumers import DFLASH_BLOCK_DEFAULTS, DFLASH_FLAG_DEFAULTS
from .context import Context
from .findings import Finding, for_each
from .layers import fc_width_findings, ids_or_none, range_findings

_SPECULATORS_READERS = ("speculators", "vllm", "llama.cpp")
_FIELD = "aux_hidden_state_layer_ids"
_ZLAB = "dflash_config.target_layer_ids"


def dflash_findings(ctx: Context) -> list[Finding]:
    if ctx.layout == "native":
        return _native(ctx) + _block_size(ctx)
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
    out += _flags(ctx) + _block_size(ctx)
    return out


def _unshifted(consumer: str, ids: list[int], zlab: list[int] | None) -> list[Finding]:
    """Ids equal to the z-lab ids kept beside them were copied without the shift."""
    if zlab is None or ids != zlab:
        return []
    return [Finding(consumer, "aux-ids-unshifted", _FIELD,
                    f"{ids}: they equal the z-lab target_layer_ids {zlab} beside them, which read hidden_states[i + 1]: "
                    f"{consumer} feeds the state one layer earlier than the drafter was trained on",
                    f"write target_layer_ids + 1 ({[i + 1 for i in zlab]}), dropping an id past the verifier's last "
                    "layer", "dflash_to_speculators")]


def _native(ctx: Context) -> list[Finding]:
    """z-lab DFlash (``dflash_config.target_layer_ids``) or DeepSpec DSpark (``target_layer_ids``,
    -1 the embedding output): the trainer's own layout, read as it is."""
    field, low = (_ZLAB, 0) if ctx.family == "dflash" else ("target_layer_ids", -1)
    out: list[Finding] = []
    ids = ids_or_none(ctx.drafter.get(field))
    for consumer in ctx.consumers:
        if consumer == "speculators":
            rule = "dflash_to_speculators" if ctx.family == "dflash" else "dspark_to_speculators"
            out.append(Finding(consumer, "layout", "speculators_model_type",
                               f"a {'z-lab DFlash' if ctx.family == 'dflash' else 'DeepSpec DSpark'} config (no "
                               f"speculators_model_type): {consumer} reads its verifier layers from {_FIELD}, which "
                               "this config does not have", "convert it to the speculators layout", rule))
            continue
        if ids is None:
            out.append(Finding(consumer, "aux-ids-missing", field,
                               "the drafter names no verifier layers: the consumer cannot know which hidden states "
                               f"fc was trained on", f"write {field} as trained"))
            continue
        out += range_findings(ctx, consumer, field, ids, low=low)
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


def _block_size(ctx: Context) -> list[Finding]:
    """A DFlash drafter's block size, absent where its readers' defaults differ."""
    if ctx.family != "dflash" or ctx.drafter.get("block_size") is not None \
            or ctx.drafter.get("dflash_config.block_size") is not None:
        return []
    return [Finding(c, "block-size-missing", "block_size",
                    f"absent: {DFLASH_BLOCK_DEFAULTS[(ctx.layout, c)]}; a block other than the one the drafter was "
                    "trained with drafts at the wrong positions", "write block_size, as the drafter was trained")
            for c in ctx.consumers if (ctx.layout, c) in DFLASH_BLOCK_DEFAULTS]


def dflash_notes(ctx: Context) -> list[str]:
    """vLLM reads a native DFlash or DSpark config's layer ids + 1, but not every release did."""
    if ctx.layout != "native" or ctx.family not in ("dflash", "dspark") or "vllm" not in ctx.consumers:
        return []
    field = _ZLAB if ctx.family == "dflash" else "target_layer_ids"
    return [f"vllm reads {field} + 1 (vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py, "
            "get_eagle3_aux_layers_from_config); releases before its pull request #40727 read the ids as they are, "
            "one layer early: serve this layout with a release that has it, or convert to the speculators layout"]
