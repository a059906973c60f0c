"""A quantizing rule against the config it writes and the tensors it reads, at plan time.

What the quantize ops leave unquantized (their ``targets`` and ``ignore``) must be what the
output's ``quantization_config`` says, or vLLM and transformers look for scales that are
not there (or load FP8 codes as bf16). A rule that writes a config states both; a
difference is a plan error naming the two places. An ``ignore`` entry that is a module name naming no module of the
converted source is a warning (a typo quantizes what it meant to keep); a ``re:`` pattern
is not, since the shipped defaults (routers, MTP layers) match nothing in a dense model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ...errors import PlanError
from ...rules.model import RuleSet

#: the compressed-tensors format each quantize op writes
_FORMATS = {"quantize_fp8_block": "float-quantized", "quantize_fp8_channel": "float-quantized",
            "quantize_nvfp4": "nvfp4-pack-quantized", "quantize_w4a16": "pack-quantized"}


def check_quantize(rules: RuleSet, config: dict[str, Any] | None, source_keys: Iterable[str]) -> list[str]:
    """Raise where a quantize op and the written quantization_config disagree; the warnings."""
    steps = [(rule, i, step) for rule in rules.tensors for i, step in enumerate(rule.ops)
             if step.verb in _FORMATS]
    if not steps:
        return []
    modules = sorted({key.rpartition(".")[0] for key in source_keys})
    warnings: list[str] = []
    for rule, i, step in steps:
        label = f"{rule.label} ops[{i}] {step.verb} ({step.where.short})"
        _agrees(label, step.verb, step.args, config)
        for entry in step.args.get("ignore", []):
            if not entry.startswith("re:") and entry not in modules:
                warnings.append(f"{label}: ignore entry {entry!r} names no module of {rules.convert!r}; "
                                "check its spelling (a 're:' pattern matches by regex)")
    return warnings


def _agrees(label: str, verb: str, args: Any, config: dict[str, Any] | None) -> None:
    if config is None:  # the rule writes no config.json (its user supplies one)
        return
    written = config.get("quantization_config")
    fix = "write the same targets and ignore in both places"
    if not isinstance(written, dict):
        raise PlanError(f"{label}: the rule quantizes, but the config it writes has no quantization_config; "
                        "set one in the config section (compressed-tensors' format, as the shipped "
                        "bf16_to_* rules do), or vLLM and transformers read the output as unquantized")
    if written.get("quant_method") != "compressed-tensors" or written.get("format") != _FORMATS[verb]:
        raise PlanError(f"{label} writes compressed-tensors {_FORMATS[verb]!r}, but the config's "
                        f"quantization_config says quant_method {written.get('quant_method')!r}, format "
                        f"{written.get('format')!r}; make them agree")
    ignore = list(written.get("ignore") or [])
    if ignore != list(args.get("ignore", [])):
        raise PlanError(f"{label} ignores {args.get('ignore', [])}, but the config's quantization_config.ignore "
                        f"is {ignore}; {fix}")
    groups = written.get("config_groups")
    targets = [t for g in groups.values() if isinstance(g, dict) for t in g.get("targets") or []] \
        if isinstance(groups, dict) else []
    want = list(args.get("targets", ["Linear"]))
    if sorted(targets) != sorted(want) and not ({"Linear"} <= set(targets) and {"Linear"} <= set(want)):
        raise PlanError(f"{label} targets {want}, but the config's quantization_config.config_groups target "
                        f"{targets}; {fix}")
    if verb == "quantize_w4a16" and isinstance(groups, dict):
        _int4_groups_agree(label, args, groups)


def _int4_groups_agree(label: str, args: Any, groups: dict[str, Any]) -> None:
    """The group size and symmetry of an int4 quantize are what its config groups' weights say."""
    channel = args.get("strategy", "group") == "channel"
    want = {"strategy": "channel" if channel else "group", "group_size": None if channel else args.get("group_size", 128),
            "symmetric": args.get("symmetric", True)}
    for name, group in sorted(groups.items()):
        weights = group.get("weights") if isinstance(group, dict) else None
        said = {k: weights.get(k) for k in want} if isinstance(weights, dict) else None
        if said != want:
            raise PlanError(f"{label} writes int4 with {want}, but quantization_config.config_groups.{name}.weights "
                            f"says {said}; make them agree")

