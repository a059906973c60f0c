"""Checks shared by the drafters that fuse verifier hidden states (EAGLE-3, DFlash,
DSpark): the layer ids in the verifier's range, fc's input as wide as they say."""

from __future__ import annotations

from typing import Any

from .context import Context
from .findings import Finding


def ids_or_none(value: Any) -> list[int] | None:
    """A non-empty list of ints, else None (absent, null or malformed are all 'no ids')."""
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return value
    return None


def range_findings(ctx: Context, consumer: str, field: str, ids: list[int], *, low: int = 0) -> list[Finding]:
    n = ctx.verifier_layers
    if n is None:
        return []
    bad = [i for i in ids if not low <= i < n]
    if not bad:
        return []
    return [Finding(consumer, "aux-ids-range", field,
                    f"layer id{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} of {ids} "
                    f"{'are' if len(bad) > 1 else 'is'} outside [{low}, {n}) for this verifier's {n} layers: "
                    f"{consumer} fails to capture {'them' if len(bad) > 1 else 'it'} or feeds another layer's state",
                    "write the ids of the verifier the drafter was trained for, or check --verifier")]


def fc_width_findings(ctx: Context, consumer: str, count: int) -> list[Finding]:
    """fc's input is ``count`` verifier hidden states side by side."""
    fc = ctx.drafter.shape("fc.weight")
    width = ctx.verifier_hidden
    if fc is None or len(fc) != 2 or width is None or fc[1] == count * width:
        return []
    return [Finding(consumer, "fc-width", "fc.weight",
                    f"fc.weight takes {fc[1]} inputs but {consumer} feeds it {count} verifier layers x hidden "
                    f"{width} = {count * width}: it refuses the checkpoint or fails at the first draft",
                    "name as many verifier layers as fc was trained on (fc inputs / verifier hidden size), and "
                    "check the verifier")]


def width_findings(ctx: Context) -> list[Finding]:
    """The drafter's hidden size against the verifier's, and the embedding it uses."""
    out: list[Finding] = []
    v = ctx.verifier
    hidden = ctx.hidden_size
    if v is not None and hidden is not None and v.int_field("hidden_size") not in (None, hidden) \
            and ctx.int_config("target_hidden_size") is None:
        out += [Finding(c, "target-hidden-size", "target_hidden_size",
                        f"the drafter's hidden size is {hidden} and the verifier's {v.int_field('hidden_size')}, but "
                        f"target_hidden_size is not set: {c} sizes fc's input by the drafter's own width",
                        f"set target_hidden_size: {v.int_field('hidden_size')}") for c in ctx.consumers]
    embed = ctx.drafter.shape("embed_tokens.weight")
    vocab = ctx.vocab_size
    if embed is not None and vocab is not None and embed[0] != vocab:
        out += [Finding(c, "embed-vocab", "embed_tokens.weight",
                        f"embed_tokens.weight has {embed[0]} rows but the verifier's vocabulary has {vocab} tokens: "
                        "embed_tokens is indexed by verifier token ids", "drop embed_tokens (the consumers take the "
                        "verifier's) or copy the verifier's") for c in ctx.consumers]
    if embed is None and v is not None and v.embed_rows is not None:
        declared = ctx.layer_int("vocab_size")
        key, rows = v.embed_rows
        if declared is not None and declared != rows:
            out += [Finding(c, "embed-vocab", "vocab_size",
                            f"the drafter has no embed_tokens and takes the verifier's {key} ({rows} rows), but its "
                            f"config says vocab_size {declared}", f"set vocab_size to {rows}, the verifier's")
                    for c in ctx.consumers]
    return out
