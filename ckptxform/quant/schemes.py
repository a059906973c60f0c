"""What a checkpoint's ``quantization_config`` says, read the way its loaders read it.

- Where: ``quantization_config``, else ``text_config.quantization_config`` (multimodal
  wrappers such as Kimi-K2.5), else ``compression_config``: the cascade of vLLM and
  compressed-tensors.
- FP8 block (``quant_method: fp8``, DeepSeek-V3/R1, Kimi-K2): ``weight_block_size``
  ``[rows, cols]``; ``modules_to_not_convert`` (transformers' FineGrainedFP8Config) if any.
- compressed-tensors ``pack-quantized``: ``config_groups`` (each with ``targets`` and
  ``weights`` args) and ``ignore``. A target or ignore entry is ``re:REGEX`` (matched from
  the start of the module name), an exact module name, or a class name (``Linear``); a
  header shows no classes, so a class target stands for every module stored quantized.
  Per-module schemes of FP8 and NVFP4 groups (and ModelOpt's config): group_schemes.py.

Every problem is a ``QuantizationConfigError`` whose message names the config's path
and field; the op adds the rule and the tensor key.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import regex

from ..errors import QuantizationConfigError, quote

__all__ = ["CONFIG_PATHS", "CompressedConfig", "checked_names", "Fp8BlockConfig", "Int4Group", "dequant_op_for", "find_quantization_config",
           "scale_of"]

CONFIG_PATHS = ("quantization_config", "text_config.quantization_config", "compression_config")
#: the bound rule regexes have, for the ones a source's config brings (a hostile one must not hang a plan)
MATCH_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class Found:
    """A ``quantization_config`` and the dotted path it was found at."""

    path: str
    value: dict[str, Any]

    def require_method(self, method: str, what: str) -> tuple[dict[str, Any], str]:
        """(the config, its path) when its ``quant_method`` is ``method``."""
        if self.value.get("quant_method") != method:
            raise QuantizationConfigError(f"{self.path}.quant_method is {self.value.get('quant_method')!r}, "
                                          f"not {method!r}; this rule dequantizes {what}")
        return self.value, self.path


def find_quantization_config(config_at: Callable[[str], Any]) -> Found | None:
    """The first of ``CONFIG_PATHS`` present in a config (``config_at(path)`` gives the
    value at a dotted path, None when absent)."""
    for path in CONFIG_PATHS:
        value = config_at(path)
        if value is not None:
            if not isinstance(value, dict):
                raise QuantizationConfigError(f"{path} is {type(value).__name__} {value!r}, not an object")
            return Found(path, value)
    return None


@dataclass(frozen=True)
class Fp8BlockConfig:
    """``quant_method: fp8`` with ``weight_block_size``."""

    block: tuple[int, int]
    not_converted: tuple[str, ...]

    @classmethod
    def parse(cls, found: Found) -> Fp8BlockConfig:
        q, path = found.require_method("fp8", "FP8 block-scaled checkpoints")
        if q.get("fmt", "e4m3") != "e4m3":
            raise QuantizationConfigError(f"{path}.fmt is {q.get('fmt')!r}; only 'e4m3' weights are supported")
        block = q.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise QuantizationConfigError(f"{path}.weight_block_size is {block!r}; block-scaled FP8 needs "
                                          "[rows, cols] of positive integers (per-tensor FP8 is not this format)")
        not_converted = q.get("modules_to_not_convert") or []
        return cls((block[0], block[1]), tuple(str(m) for m in not_converted))

    def converts(self, module: str) -> bool:
        return not any(module == m or module.startswith(m + ".") or module.endswith("." + m)
                       for m in self.not_converted)


@dataclass(frozen=True)
class Int4Group:
    """One config group's weight args, as far as dequantizing needs them."""

    #: its key in ``config_groups`` (``group_0``)
    name: str
    #: module names, ``re:`` regexes or class names
    targets: tuple[str, ...]
    #: columns per scale; 0: one scale per row (strategy ``channel``)
    group_size: int
    #: False: modules carry a ``weight_zero_point``
    symmetric: bool


@dataclass(frozen=True)
class CompressedConfig:
    """compressed-tensors ``pack-quantized`` int4 groups and the ``ignore`` list."""

    path: str
    groups: tuple[Int4Group, ...]
    ignore: tuple[str, ...]

    @classmethod
    def parse(cls, found: Found) -> CompressedConfig:
        q, path = found.require_method("compressed-tensors", "pack-quantized int4")
        groups_in = q.get("config_groups")
        if not isinstance(groups_in, dict) or not groups_in:
            raise QuantizationConfigError(f"{path}.config_groups is {groups_in!r}; it must name at least one group")
        groups = tuple(_int4_group(f"{path}.config_groups.{name}", name, group, q.get("format"))
                       for name, group in groups_in.items())
        ignore = q.get("ignore") or []
        if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
            raise QuantizationConfigError(f"{path}.ignore is {ignore!r}, not a list of strings")
        return cls(path, groups, checked_names(tuple(ignore), f"{path}.ignore"))

    def ignored(self, module: str) -> str | None:
        """The ``ignore`` entry naming ``module``, if one does."""
        return next((entry for entry in self.ignore if names_module(entry, module, f"{self.path}.ignore")), None)

    def group_for(self, module: str, *, stored_quantized: bool) -> Int4Group | None:
        """The first group whose targets take ``module`` (class targets take what is
        stored quantized), None when it is ignored or untargeted."""
        if self.ignored(module) is not None:
            return None
        for group in self.groups:
            for target in group.targets:
                where = f"{self.path}.config_groups.{group.name}.targets"
                if names_module(target, module, where) or (stored_quantized and is_class_name(target)):
                    return group
        return None


def _int4_group(path: str, name: str, group: Any, top_format: Any) -> Int4Group:
    if not isinstance(group, dict):
        raise QuantizationConfigError(f"{path} is {group!r}, not an object")
    fmt = group.get("format") or top_format
    if fmt != "pack-quantized":
        raise QuantizationConfigError(f"{path}: format {fmt!r} is not 'pack-quantized'")
    w = group.get("weights")
    if not isinstance(w, dict):
        raise QuantizationConfigError(f"{path}.weights is {w!r}; pack-quantized groups quantize weights")
    wanted = {"num_bits": 4, "type": "int"}
    for field, value in wanted.items():
        if w.get(field) != value:
            raise QuantizationConfigError(f"{path}.weights.{field} is {w.get(field)!r}; only {field} "
                                          f"{value!r} is supported (int4, per group or channel)")
    if w.get("strategy") not in ("group", "channel"):
        raise QuantizationConfigError(f"{path}.weights.strategy is {w.get('strategy')!r}; only strategy 'group' "
                                      "or 'channel' is supported (int4, per group or channel)")
    size = w.get("group_size")
    if w["strategy"] == "channel":
        size = 0  # one scale per row: the row's width is the packed tensor's
    elif not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise QuantizationConfigError(f"{path}.weights.group_size is {size!r}, not a positive integer")
    targets = group.get("targets")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise QuantizationConfigError(f"{path}.targets is {targets!r}, not a list of module names or classes")
    return Int4Group(name, checked_names(tuple(targets), f"{path}.targets"), size, bool(w.get("symmetric", True)))


@functools.lru_cache(maxsize=4096)
def _compiled(text: str) -> Any:
    return regex.compile(text, flags=regex.VERSION0)  # re's syntax, with a time bound on matching


def checked_names(entries: tuple[str, ...], where: str) -> tuple[str, ...]:
    """``entries`` (targets or ignore), each ``re:`` pattern compiled once now: one that does
    not compile is an error naming it and ``where`` it is, not a traceback at the first match."""
    for i, entry in enumerate(entries):
        if entry.startswith("re:"):
            try:
                _compiled(entry[3:])
            except (regex.error, RecursionError, OverflowError, MemoryError) as err:
                raise QuantizationConfigError(
                    f"{where}[{i}] {quote(entry)} is not a regular expression ({err}); fix the pattern in the "
                    "source's config.json") from None
    return entries


def names_module(entry: str, module: str, where: str) -> bool:
    """Whether a target or ignore entry (``re:REGEX``, from the start, or an exact name) names
    ``module``; ``where``: the config field it is from, for the error of a runaway pattern."""
    if not entry.startswith("re:"):
        return entry == module
    try:
        return _compiled(entry[3:]).match(module, timeout=MATCH_TIMEOUT_S) is not None
    except TimeoutError:
        shown = module if len(module) <= 60 else module[:57] + "..."
        raise QuantizationConfigError(
            f"{where}: {quote(entry)} was stopped after {MATCH_TIMEOUT_S:g} s on the {len(module):,}-character "
            f"module {quote(shown)}: it "
            "backtracks catastrophically; rewrite it without nested or overlapping repetition such as '(a+)+'") from None


def is_class_name(entry: str) -> bool:
    """Whether a target is a class name (``Linear``), which a header cannot check."""
    return not entry.startswith("re:") and "." not in entry and entry[:1].isupper()


def scale_of(key: str, tensors: Mapping[str, Any]) -> str | None:
    """The key of the scale a quantized weight ``key`` is stored with, if ``tensors`` has
    one: ``W_scale_inv`` (FP8 block), ``M.weight_scale`` (compressed-tensors, per-tensor
    FP8), ``W_scale``, or ``P_scales`` beside ``P_blocks`` (MXFP4)."""
    module = key.rsplit(".", 1)[0] if key.endswith((".weight", ".weight_packed")) else None
    candidates = [f"{key}_scale_inv", f"{key}_scale"]
    if key.endswith("_blocks"):  # MXFP4 (gpt-oss)
        candidates.append(key.removesuffix("_blocks") + "_scales")
    if module is not None:
        candidates += [f"{module}.weight_scale", f"{module}.weight_scale_inv"]
    return next((c for c in candidates if c in tensors), None)


def dequant_op_for(found: Found, dtype: str, scale: str) -> str | None:
    """The op that dequantizes a ``dtype`` weight scaled by ``scale`` under ``found``, if
    ckptxform has one (dequant_fp8_block, dequant_int4, dequant_mxfp4, dequant_scaled)."""
    method = found.value.get("quant_method")
    if method == "fp8" and dtype == "F8_E4M3" and scale.endswith("_scale_inv"):
        return "dequant_fp8_block"
    if method == "modelopt" and dtype in ("F8_E4M3", "U8") and scale.endswith(".weight_scale"):
        return "dequant_scaled"
    if method == "compressed-tensors" and scale.endswith(".weight_scale"):
        if dtype == "F8_E4M3" or (dtype == "U8" and "nvfp4-pack-quantized" in repr(found.value)):
            return "dequant_scaled"
        if dtype in ("I32", "U8"):
            return "dequant_int4"
    if method == "mxfp4" and dtype == "U8" and scale.endswith("_scales"):
        return "dequant_mxfp4"
    return None
