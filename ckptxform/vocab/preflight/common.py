"""Checks of any checkpoint preflight reads: the verifier the config names against the
one given, the weights' dtype against the config's, tied embeddings, and the plan-time
config-vs-tensors check (``engine.plan.config_checks``)."""

from __future__ import annotations

from collections import Counter
from pathlib import PurePosixPath

from ...dtypes import USER_DTYPES
from ...engine.plan.config_checks import config_problems
from .context import Context
from .findings import Finding, for_each

_FLOATS = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


def common_findings(ctx: Context) -> list[Finding]:
    if not ctx.drafter.config:
        return for_each(ctx.consumers, "config-missing", "config.json",
                        "the checkpoint has no config.json: no consumer can tell what model it is",
                        "add the config.json the checkpoint was saved with")
    return _verifier(ctx) + _dtype(ctx) + _tie(ctx) + _config_vs_tensors(ctx)


def _verifier(ctx: Context) -> list[Finding]:
    named = ctx.drafter.get("speculators_config.verifier")
    if ctx.verifier is None or not isinstance(named, dict):
        return []
    out: list[Finding] = []
    name = named.get("name_or_path")
    given = ctx.verifier.location
    if isinstance(name, str) and _last(name) != _last(given):
        out += for_each([c for c in ctx.consumers if c == "speculators"], "verifier-name",
                        "speculators_config.verifier.name_or_path",
                        f"names {name!r}, not the verifier given ({given}): speculators loads the named model's "
                        "embedding and lm_head", f"set it to the verifier the drafter was trained for ({given}?)")
    archs = named.get("architectures")
    theirs = ctx.verifier.config.get("architectures")
    if isinstance(archs, list) and archs and isinstance(theirs, list) and theirs and archs != theirs:
        out += for_each(ctx.consumers, "verifier-architectures", "speculators_config.verifier.architectures",
                        f"says {archs} but the verifier is {theirs}", f"set it to {theirs}")
    return out


def _last(location: str) -> str:
    return PurePosixPath(location.split("@")[0].rstrip("/")).name.lower()


def _dtype(ctx: Context) -> list[Finding]:
    declared = ctx.drafter.get("dtype") or ctx.drafter.get("torch_dtype") \
        or ctx.layer_config.get("dtype") or ctx.layer_config.get("torch_dtype")
    counts = Counter(i.dtype for i in ctx.drafter.tensors.values() if i.dtype in _FLOATS)
    if not counts or ctx.family == "model":  # models keep some tensors in f32 on purpose (router biases)
        return []
    out: list[Finding] = []
    if len(counts) > 1:
        odd = sorted((k for k in ctx.drafter.tensors if ctx.drafter.tensors[k].dtype != counts.most_common(1)[0][0]
                      and ctx.drafter.tensors[k].dtype in _FLOATS))
        out += for_each(ctx.consumers, "dtype-mixed", odd[0],
                        f"weights in {len(counts)} float dtypes ({', '.join(sorted(counts))}): transformers casts "
                        f"them to one without a word{'' if declared else ', and with no dtype in the config one f32 tensor makes the whole model f32'}",
                        "store every weight in the dtype the drafter was trained in")
    if isinstance(declared, str):
        want = USER_DTYPES.get(declared.removeprefix("torch."))
        main = counts.most_common(1)[0][0]
        if want is not None and want != main:
            out += for_each(ctx.consumers, "dtype-config", "dtype",
                            f"the config says {declared} but the weights are {main}: they are cast on load",
                            f"set dtype to the weights' ({main})")
    return out


def _tie(ctx: Context) -> list[Finding]:
    tie = ctx.layer_config.get("tie_word_embeddings", ctx.drafter.get("tie_word_embeddings"))
    if ctx.family == "model" or tie is not True or "lm_head.weight" not in ctx.drafter.tensors:
        return []
    return for_each(ctx.consumers, "tie", "tie_word_embeddings",
                    "true, so the drafter's lm_head is replaced by the (verifier's) embedding and the trained "
                    "lm_head.weight is ignored", "set tie_word_embeddings: false")


def _config_vs_tensors(ctx: Context) -> list[Finding]:
    config = dict(ctx.layer_config)
    if ctx.layout == "speculators":
        if ctx.family == "mtp":  # transformer_layer_config is the verifier's, not the drafter's
            return []
        if ctx.int_config("draft_vocab_size") is not None:
            config["draft_vocab_size"] = ctx.int_config("draft_vocab_size")
    problems = config_problems(config, ctx.drafter.tensors)
    return [f for p in problems for f in for_each(ctx.consumers, "config-tensors", "config.json",
                                                    f"{p}: the model built from the config does not hold the tensors",
                                                    "make the config describe the tensors (or the tensors the config)")]
