"""The written config.json against the tensors written, at plan time.

A rule that writes an HF config states the model's dimensions twice: once in the config,
once in the shapes of the tensors. When they disagree (one model-parallel shard taken for
the whole model, a field set from the wrong source) transformers refuses the output or,
worse, loads it wrongly. Each check reads one field and the tensors that must agree with
it, by the Hugging Face names those tensors have (with or without the ``model.`` prefix,
and an EAGLE-3 drafter's ``midlayer.``); a field the config does not hold, or a tensor the
output does not have, is not checked. Every layer ``num_hidden_layers`` counts is
written. MLA attention (``kv_lora_rank``) has other head shapes and is left out of the
head checks.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from ...errors import PlanError
from ...rules.model import RuleSet
from .plan_store import keys_in_order, shapes_in_order
from .recipes import OutputPlan

_LAYER = r"(?:model\.)?(?:layers\.[0-9]+\.|midlayer\.)"
_ORDINAL = ("rows", "columns")

#: (field, key pattern, dim): the tensors whose size in ``dim`` is ``field`` (a product of
#: fields when the field is a tuple)
_DIMENSIONS: tuple[tuple[str, str, int], ...] = (
    ("vocab_size", r"(?:model\.)?embed_tokens\.weight", 0),
    ("hidden_size", r"(?:model\.)?embed_tokens\.weight", 1),
    ("hidden_size", r"(?:model\.)?norm\.weight", 0),
    ("hidden_size", r"lm_head\.weight", 1),
    ("hidden_size", _LAYER + r"(?:input_layernorm|post_attention_layernorm)\.weight", 0),
    ("hidden_size", _LAYER + r"self_attn\.o_proj\.weight", 0),
    ("hidden_size", _LAYER + r"mlp\.down_proj\.weight", 0),
    ("intermediate_size", _LAYER + r"mlp\.(?:gate_proj|up_proj)\.weight", 0),
    ("intermediate_size", _LAYER + r"mlp\.down_proj\.weight", 1),
)
_HEADS = (
    ("num_attention_heads", _LAYER + r"self_attn\.q_proj\.weight", 0),
    ("num_attention_heads", _LAYER + r"self_attn\.o_proj\.weight", 1),
    ("num_key_value_heads", _LAYER + r"self_attn\.(?:k_proj|v_proj)\.weight", 0),
)
#: models whose q_proj also makes the attention output's gate: twice the rows (Qwen3-Next;
#: Qwen3.5 says so with attn_output_gate)
_GATED_ATTENTION = ("qwen3_next",)
_ROUTER = _LAYER + r"(?:mlp|block_sparse_moe)\.gate\.weight"
_FUSED_EXPERTS = _LAYER + r"mlp\.experts\.(?:gate_up_proj|down_proj)"
_EXPERT_KEY = re.compile(_LAYER + r"(?:mlp|block_sparse_moe)\.experts\.([0-9]+)\.")
_EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")
_LAYER_KEY = re.compile(r"(?:model\.)?layers\.([0-9]+)\.")


def check_config(config: Mapping[str, Any] | None, outputs: Mapping[str, OutputPlan], rules: RuleSet) -> None:
    """Raise PlanError naming the first field of the written ``config`` (None: the rules
    write none) that a written tensor contradicts."""
    problem = None if config is None else next(_problems(config, outputs), None)
    if problem is not None:
        assert rules.config is not None
        raise PlanError(f"config ({rules.config.where.short}): {problem}; the written config must describe the tensors "
                        "written: fix the rule's config section, or convert the whole checkpoint (one "
                        "model-parallel shard has a fraction of the model's dimensions)")


def config_problems(config: Mapping[str, Any], tensors: Mapping[str, Any]) -> list[str]:
    """Every disagreement between ``config`` and ``tensors`` (anything with a ``shape``:
    a checkpoint's headers as well as a plan's outputs), for ``ckptxform preflight``."""
    return list(_problems(config, tensors))


def _problems(config: Mapping[str, Any], outputs: Mapping[str, OutputPlan]) -> Iterator[str]:
    # a few passes, each streamed from a plan's store: the shapes' checks all in one (a
    # pass each was ~6 us a row)
    keys = keys_in_order(outputs)
    checks = [(name, _int(config, name), pattern, dim) for name, pattern, dim in _DIMENSIONS]
    if "lm_head.weight" in outputs:
        # an EAGLE-3 drafter's lm_head scores its draft vocabulary only
        name = "draft_vocab_size" if _int(config, "draft_vocab_size") is not None else "vocab_size"
        checks.append((name, _int(config, name), r"lm_head\.weight", 0))
    if _int(config, "kv_lora_rank") is None:
        checks += _head_checks(config)
    experts = _experts(config)
    if experts is not None:
        checks += [(*experts, _ROUTER, 0), (*experts, _FUSED_EXPERTS, 0)]
    found = _disagreements(checks, shapes_in_order(outputs))
    yield from (problem for problem in found if problem is not None)
    if experts is not None:
        yield from _expert_problems(*experts, keys)
    yield from _layer_problems(config, keys)
    yield from _tie_problems(config, outputs)
    yield from _bias_problems(config, keys)


#: (flag, the bias tensors it says are there): transformers drops a bias its config does
#: not declare ("unexpected keys") and initialises at random one it declares but is not given
_BIASES = (("attention_bias", re.compile(_LAYER + r"self_attn\.(?:q_proj|k_proj|v_proj|o_proj|qkv_proj)\.bias")),
           ("mlp_bias", re.compile(_LAYER + r"mlp\.(?:gate_proj|up_proj|down_proj|gate_up_proj)\.bias")))


def _bias_problems(config: Mapping[str, Any], keys: Iterable[str]) -> Iterator[str]:
    for flag, pattern in _BIASES:
        declared = config.get(flag)
        if not isinstance(declared, bool):
            continue
        present = next((key for key in keys if pattern.fullmatch(key)), None)
        if present is not None and not declared:
            yield f"{flag} is false but output {present!r} is written: transformers would drop it as unexpected"
        # only when the layers it biases are written: a partial checkpoint (experts only) has none to bias
        weights = re.compile(pattern.pattern.removesuffix(r"\.bias") + r"\.weight")
        if present is None and declared and any(weights.fullmatch(key) for key in keys):
            yield f"{flag} is true but no such bias is written: transformers would initialise them at random"


def _head_checks(config: Mapping[str, Any]) -> Iterator[tuple[str, int, str, int]]:
    heads, hidden = _int(config, "num_attention_heads"), _int(config, "hidden_size")
    head_dim = _int(config, "head_dim")
    if heads is None or heads <= 0:
        return
    if head_dim is None:
        if hidden is None:
            return
        head_dim = hidden // heads
    kv_heads = _int(config, "num_key_value_heads")
    counts = {"num_attention_heads": heads, "num_key_value_heads": heads if kv_heads is None else kv_heads}
    gated = config.get("attn_output_gate") is True or config.get("model_type") in _GATED_ATTENTION
    for name, pattern, dim in _HEADS:
        label = f"{name} x head_dim ({counts[name]} x {head_dim})"
        rows = counts[name] * head_dim
        if gated and pattern.endswith("q_proj\\.weight"):
            label, rows = f"2 x {label} (q_proj also gates the attention output)", 2 * rows
        yield label, rows, pattern, dim


def _experts(config: Mapping[str, Any]) -> tuple[str, int] | None:
    """The config's field counting the experts, and its count."""
    name = next((f for f in _EXPERT_FIELDS if _int(config, f) is not None), None)
    return None if name is None else (name, _int(config, name))  # type: ignore[return-value]


def _expert_problems(name: str, count: int, keys: Iterable[str]) -> Iterator[str]:
    for key in keys:
        found = _EXPERT_KEY.match(key)
        if found and int(found.group(1)) >= count:
            yield f"{name} is {count} but output {key!r} is expert {found.group(1)}"


def _layer_problems(config: Mapping[str, Any], keys: Iterable[str]) -> Iterator[str]:
    """Every decoder layer the config counts is written (a missing one would be initialised
    at random), and none beyond them but DeepSeek's multi-token-prediction layers."""
    layers = _int(config, "num_hidden_layers")
    found: dict[int, str] = {}  # layer -> its first output key
    for key in keys:
        if (m := _LAYER_KEY.match(key)) is not None:
            found.setdefault(int(m.group(1)), key)
    if layers is None or not found:
        return
    extra = _int(config, "num_nextn_predict_layers") or 0
    beyond = [i for i in sorted(found) if i >= layers + extra]
    if beyond:
        yield f"num_hidden_layers is {layers} but output {found[beyond[0]]!r} is layer {beyond[0]}"
    missing = next((i for i in range(min(layers, len(found) + 1)) if i not in found), None)
    if missing is not None:
        yield (f"num_hidden_layers is {layers} but no output is of layer {missing} (the output has "
               f"{len(found)} layer{'s' if len(found) != 1 else ''})")


def _tie_problems(config: Mapping[str, Any], outputs: Mapping[str, OutputPlan]) -> Iterator[str]:
    tie = config.get("tie_word_embeddings")
    embed = next((k for k in ("model.embed_tokens.weight", "embed_tokens.weight") if k in outputs), None)
    if embed is None or not isinstance(tie, bool):
        return
    if tie and "lm_head.weight" in outputs:
        yield (f"tie_word_embeddings is true but output 'lm_head.weight' is written beside {embed!r}: "
               "transformers would replace it with the embedding")
    if not tie and "lm_head.weight" not in outputs:
        yield (f"tie_word_embeddings is false but no 'lm_head.weight' is written beside {embed!r}: "
               "transformers would initialise it at random")


def _disagreements(checks: list[tuple[str, int | None, str, int]],
                   shaped: Iterable[tuple[str, tuple[int, ...]]]) -> list[str | None]:
    """For each check (label, expected rows, key pattern, dim; expected None: unchecked), the
    first output in key order whose dim ``dim`` is not ``expected`` said, or None: one pass."""
    found: list[str | None] = [None] * len(checks)
    left = [(i, label, expected, re.compile(pattern), dim)
            for i, (label, expected, pattern, dim) in enumerate(checks) if expected is not None]
    for key, shape in shaped if left else ():
        for check in left:
            i, label, expected, compiled, dim = check
            if compiled.fullmatch(key) and len(shape) > dim and shape[dim] != expected:
                size = (f"{shape[0]} entries" if len(shape) == 1 else
                        f"{shape[dim]} {_ORDINAL[dim]}" if len(shape) == 2 else f"{shape[dim]} in dim {dim}")
                found[i] = f"{label} is {expected} but output {key!r} has {size} (shape {list(shape)})"
                left = [other for other in left if other is not check]
        if not left:
            break
    return found


def _int(config: Mapping[str, Any], name: str) -> int | None:
    value = config.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) else None
