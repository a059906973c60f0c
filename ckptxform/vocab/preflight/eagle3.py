"""EAGLE-3 drafters (speculators ``layers.0.*`` and native ``midlayer.*`` layouts): the
verifier layers each consumer feeds fc, fc's width, and the norm flags consumers default
differently (see ``consumers``)."""

from __future__ import annotations

from .consumers import EAGLE3_AUX_FIELDS, EAGLE3_DEFAULT_AUX, EAGLE3_FLAG_DEFAULTS, disagree, flag_default, readers
from .context import Context
from .findings import Finding, for_each
from .layers import fc_width_findings, ids_or_none, range_findings

_DEFAULT_COUNT = 3


def eagle3_findings(ctx: Context) -> list[Finding]:
    out: list[Finding] = []
    for consumer in ctx.consumers:
        fields = EAGLE3_AUX_FIELDS[consumer]
        found = next(((f, ids_or_none(ctx.drafter.get(f))) for f in fields if ids_or_none(ctx.drafter.get(f))), None)
        if found is None:
            out.append(Finding(consumer, "aux-ids-missing", fields[0],
                               f"{consumer} reads no verifier layer ids ({' or '.join(fields)}) and uses "
                               f"{EAGLE3_DEFAULT_AUX}{_defaults(ctx)}: a drafter trained on other layers drafts from "
                               "the wrong hidden states (acceptance collapses, no error)",
                               f"write the layer ids the drafter was trained on at {fields[0]}",
                               "eagle3_to_speculators" if ctx.layout == "native" and consumer != "sglang" else None))
            count = _DEFAULT_COUNT
        else:
            field, ids = found
            out += range_findings(ctx, consumer, field, ids)
            count = len(ids)
        out += fc_width_findings(ctx, consumer, count)
    out += _conflicts(ctx)
    out += _flag_findings(ctx)
    return out


def _defaults(ctx: Context) -> str:
    n = ctx.verifier_layers
    return "" if n is None else f" (= {[2, n // 2, n - 3]} for this verifier's {n} layers)"


def _conflicts(ctx: Context) -> list[Finding]:
    top = ids_or_none(ctx.drafter.get("eagle_aux_hidden_state_layer_ids"))
    nested = ids_or_none(ctx.drafter.get("eagle_config.eagle_aux_hidden_state_layer_ids"))
    if top is None or nested is None or top == nested:
        return []
    return for_each([c for c in ctx.consumers if c in ("vllm", "sglang")], "aux-ids-conflict",
                    "eagle_aux_hidden_state_layer_ids",
                    f"the top-level ids {top} and eagle_config's {nested} differ: vLLM feeds {top}, SGLang {nested}",
                    "keep one list, the layers the drafter was trained on, in both places")


def _flag_findings(ctx: Context) -> list[Finding]:
    out: list[Finding] = []
    for flag in EAGLE3_FLAG_DEFAULTS:
        if ctx.drafter.has(flag) or not disagree(flag, ctx.layout):  # every consumer reads a missing one alike
            continue
        for consumer in ctx.consumers:
            value = str(flag_default(flag, consumer, ctx.layout)).lower()
            out.append(Finding(consumer, "flag-missing", flag,
                               f"absent, and consumers disagree on its default in a {ctx.layout} config "
                               f"({readers(flag, ctx.layout)}): {consumer} reads {value}; a drafter trained with the "
                               "other value drafts from wrongly normalised states",
                               f"write {flag} explicitly, as the drafter was trained"))
    return out


def eagle3_notes(ctx: Context) -> list[str]:
    """``norm_output: true`` in a native config: EAGLE-3.1 (post-norm feedback) for every
    consumer, but SpecForge wrote it for classic EAGLE-3 before its pull request #879."""
    if ctx.family != "eagle3" or ctx.layout != "native":
        return []
    notes = []
    if ctx.drafter.get("norm_output") is True:
        notes.append("norm_output is true: SGLang, vLLM and speculators feed the post-norm hidden state to the next "
                     "draft step (EAGLE-3.1); SpecForge before its pull request #879 (September 2026) wrote true for "
                     "classic EAGLE-3 drafters, which want false: check how this drafter was trained")
    if "vllm" in ctx.consumers and ids_or_none(ctx.drafter.get("eagle_aux_hidden_state_layer_ids")) is None \
            and ids_or_none(ctx.drafter.get("eagle_config.eagle_aux_hidden_state_layer_ids")) is not None:
        notes.append("the verifier layers are only in eagle_config: vLLM releases that read only the top-level "
                     "eagle_aux_hidden_state_layer_ids feed EAGLE's default layers; write the same list there too")
    return notes
