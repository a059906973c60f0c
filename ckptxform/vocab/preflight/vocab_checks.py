"""The draft-vocabulary map against itself, lm_head and the verifier: ``d2t`` offsets
inside the verifier's vocabulary and each target once, ``t2d`` exactly their mask,
``draft_vocab_size`` = lm_head rows = ``d2t`` length, special tokens in the draft
vocabulary. Reads only ``d2t``/``t2d`` (already in memory) and headers."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

from .context import Context
from .findings import Finding, for_each

_INT_TYPECODES = {"I64": "q", "I32": "i"}
#: who reads t2d: speculators (its Eagle3 model's buffer, used in training); vLLM and
#: SGLang read d2t only
_T2D_READERS = ("speculators",)
_FIRST = 3


def vocab_findings(ctx: Context) -> list[Finding]:
    d = ctx.drafter
    lm_rows = (d.shape("lm_head.weight") or (None,))[0]
    declared = ctx.int_config("draft_vocab_size")
    out: list[Finding] = []
    if declared is not None and lm_rows is not None and declared != lm_rows:
        out += for_each(ctx.consumers, "draft-vocab-size", "draft_vocab_size",
                        f"the config says {declared} draft tokens but lm_head.weight has {lm_rows} rows: the model is "
                        "built with the config's size and the checkpoint's lm_head does not fit it",
                        "set draft_vocab_size to lm_head.weight's rows (and check d2t has as many entries)")
    if "d2t" not in d.tensors:
        if lm_rows is not None and ctx.vocab_size is not None and lm_rows < ctx.vocab_size:
            out += for_each(ctx.consumers, "d2t-missing", "d2t",
                            f"lm_head.weight scores {lm_rows} draft tokens of a {ctx.vocab_size}-token vocabulary "
                            "but there is no d2t: draft index i is taken as token i",
                            "add the d2t (and t2d) the drafter was trained with", "prune_draft_vocab")
        return out
    values = _ints(d.small.get("d2t", b""), d.tensors["d2t"].dtype)
    if values is None:
        return out + for_each(ctx.consumers, "d2t-dtype", "d2t",
                              f"d2t has dtype {d.tensors['d2t'].dtype}: consumers read it as integer offsets",
                              "store d2t as int64 offsets (target = index + d2t[index])")
    if lm_rows is not None and len(values) != lm_rows:
        out += for_each(ctx.consumers, "d2t-length", "d2t",
                        f"d2t has {len(values)} entries but lm_head.weight has {lm_rows} rows: draft indices past "
                        f"{min(len(values), lm_rows)} map to no token or score nothing",
                        "take d2t and lm_head from the same drafter")
    targets = [i + v for i, v in enumerate(values)]
    vocab = ctx.vocab_size
    out += _range_findings(ctx, values, targets, vocab)
    out += _t2d_findings(ctx, targets, vocab)
    return out


def _range_findings(ctx: Context, values: Sequence[int], targets: Sequence[int], vocab: int | None) -> list[Finding]:
    upper = sys.maxsize if vocab is None else vocab
    bad = next((i for i, t in enumerate(targets) if not 0 <= t < upper), None)
    if bad is not None:
        absolute = vocab is not None and all(0 <= v < vocab for v in values) and len(set(values)) == len(values)
        fix = ("d2t holds absolute token ids: store offsets, d2t[i] = target id - i" if absolute else
               "take d2t from the drafter trained for this verifier, or give the verifier whose vocabulary it "
               "indexes (--verifier)")
        where = "outside [0, " + (f"{vocab})" if vocab is not None else "...)")
        return for_each(ctx.consumers, "d2t-range", "d2t",
                        f"draft index {bad} maps to token id {targets[bad]} (d2t[{bad}] = {values[bad]}, "
                        f"target = index + d2t[index]), {where} of the verifier's vocabulary: the drafter proposes "
                        "a token the verifier does not have", fix)
    seen: dict[int, int] = {}
    for i, t in enumerate(targets):
        if t in seen:
            return for_each(ctx.consumers, "d2t-duplicate", "d2t",
                            f"draft indices {seen[t]} and {i} both map to token id {t}: two lm_head rows score "
                            "one token and some token of the draft vocabulary is never proposed",
                            "rebuild d2t from the drafter's sorted draft vocabulary")
        seen[t] = i
    return []


def _t2d_findings(ctx: Context, targets: Sequence[int], vocab: int | None) -> list[Finding]:
    readers = [c for c in ctx.consumers if c in _T2D_READERS]
    d = ctx.drafter
    if "t2d" not in d.tensors:
        if ctx.layout == "speculators" and readers:
            return for_each(readers, "t2d-missing", "t2d",
                            "there is no t2d: transformers leaves speculators' t2d buffer uninitialised, without "
                            "a warning", "add t2d, True at each target id of d2t", "eagle3_to_speculators")
        return []
    info = d.tensors["t2d"]
    flags = d.small.get("t2d", b"")
    if info.dtype not in ("BOOL", "U8") or len(info.shape) != 1:
        return for_each(readers, "t2d-dtype", "t2d", f"t2d is {info.dtype} {list(info.shape)}, not one bool per "
                        "verifier token", "rebuild t2d from d2t: bool, shape [verifier vocabulary]")
    if vocab is not None and len(flags) != vocab:
        return for_each(readers, "t2d-size", "t2d", f"t2d has {len(flags)} entries but the verifier's vocabulary "
                        f"has {vocab} tokens", "rebuild t2d from d2t with the verifier's vocabulary size")
    mapped = set(targets)
    marked = {t for t, flag in enumerate(flags) if flag}
    extra = sorted(marked - mapped)
    unmarked = sorted(t for t in mapped if t not in marked)
    if not extra and not unmarked:
        return []
    parts = []
    if extra:
        parts.append(f"it marks {len(extra)} token ids d2t does not map to (first: "
                     f"{', '.join(map(str, extra[:_FIRST]))})")
    if unmarked:
        parts.append(f"it leaves {len(unmarked)} of d2t's targets unmarked (first: "
                     f"{', '.join(map(str, unmarked[:_FIRST]))})")
    return for_each(readers, "t2d-mask", "t2d",
                    f"t2d is not the mask of d2t's targets: {' and '.join(parts)}; speculators trains and "
                    "scores with the wrong draft tokens", "rebuild t2d from d2t (True at index + d2t[index])")


def special_notes(ctx: Context) -> list[str]:
    """The end-of-sequence token(s) when the draft vocabulary lacks them: the drafter never
    proposes them, so each costs acceptance where the verifier emits one (nothing loads
    wrong; bos is never drafted, so it is not asked)."""
    values = _ints(ctx.drafter.small.get("d2t", b""), ctx.drafter.tensors["d2t"].dtype) \
        if "d2t" in ctx.drafter.tensors else None
    if values is None:
        return []
    mapped = {i + v for i, v in enumerate(values)}
    notes = []
    for name in ("eos_token_id",):
        value = ctx.special(name)
        ids = value if isinstance(value, list) else [value]
        missing = [t for t in ids if isinstance(t, int) and not isinstance(t, bool) and t not in mapped]
        if missing:
            notes.append(f"{name} {', '.join(map(str, missing))} is not in the draft vocabulary: the drafter never "
                         "proposes it, and drafts at that position are rejected")
    return notes


def _ints(raw: bytes, dtype: str) -> list[int] | None:
    code = _INT_TYPECODES.get(dtype)
    if code is None or len(raw) % array(code).itemsize:
        return None
    values = array(code)
    values.frombytes(raw)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()
