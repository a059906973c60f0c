"""Which scheme each module of a checkpoint is stored in, read from its
``quantization_config`` per module, as compressed-tensors and ModelOpt read theirs.

- compressed-tensors (``quant_method: compressed-tensors``): each of ``config_groups``
  has ``targets``, ``weights`` args and a ``format`` (its own, else the config's). A
  module takes the first group whose targets name it, unless ``ignore`` does (targets and
  ignore entries as in schemes.py). Read here: ``float-quantized`` FP8 e4m3 per tensor,
  per channel or per block, and ``nvfp4-pack-quantized`` (e2m1 codes, an e4m3 scale per
  16, a float32 ``weight_global_scale`` stored as a reciprocal). A checkpoint may mix
  groups (FP8 attention, NVFP4 experts): each module is read by its own.
- ModelOpt (``quant_method: modelopt``, ``quant_algo: NVFP4`` or ``FP8``, as its HF export
  writes into config.json beside hf_quant_config.json): every ``Linear`` outside
  ``ignore`` (or ``exclude_modules``; ``*`` wildcards) is quantized; NVFP4 multiplies by
  ``weight_scale_2``.

A group this module cannot read is kept with the reason and refused only when a module
of the checkpoint belongs to it, naming the group; a malformed config is refused at once.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import QuantizationConfigError
from .schemes import Found, checked_names, is_class_name, names_module

__all__ = ["GroupSchemes", "SchemeGroup", "WeightScheme"]

#: the group-size of NVFP4 (both conventions)
NVFP4_GROUP = 16


@dataclass(frozen=True)
class WeightScheme:
    """How a module's weight is stored, as far as dequantizing needs it."""

    kind: Literal["fp8", "nvfp4"]
    #: fp8: ``tensor``, ``channel`` or ``block``; nvfp4: ``tensor_group``
    strategy: str
    convention: Literal["compressed-tensors", "modelopt"]
    #: fp8 ``block``: ``[rows, cols]`` per scale
    block: tuple[int, int] | None = None


@dataclass(frozen=True)
class SchemeGroup:
    """One group of the config: its name, dotted path, targets and scheme (or why it has none)."""

    name: str
    path: str
    targets: tuple[str, ...]
    scheme: WeightScheme | None
    problem: str | None = None

    def readable(self) -> WeightScheme:
        """The scheme, or a QuantizationConfigError naming this group."""
        if self.scheme is None:
            raise QuantizationConfigError(f"{self.path} cannot be read: {self.problem}")
        return self.scheme


@dataclass(frozen=True)
class GroupSchemes:
    """The groups of a compressed-tensors or ModelOpt ``quantization_config``."""

    path: str
    groups: tuple[SchemeGroup, ...]
    ignore: tuple[str, ...]
    modelopt: bool

    @classmethod
    def parse(cls, found: Found) -> GroupSchemes:
        q, path = found.value, found.path
        method = q.get("quant_method")
        if method == "modelopt":
            return cls(path, (_modelopt_group(q, path),), _strings(q.get("ignore", q.get("exclude_modules")),
                                                                     f"{path}.ignore"), True)
        if method != "compressed-tensors":
            raise QuantizationConfigError(f"{path}.quant_method is {method!r}, not 'compressed-tensors' or "
                                          "'modelopt'; this rule dequantizes FP8 (weight_scale) and NVFP4")
        groups_in = q.get("config_groups")
        if not isinstance(groups_in, dict) or not groups_in:
            raise QuantizationConfigError(f"{path}.config_groups is {groups_in!r}; it must name at least one group")
        groups = tuple(_compressed_group(f"{path}.config_groups.{name}", str(name), group, q.get("format"))
                       for name, group in groups_in.items())
        return cls(path, groups, checked_names(_strings(q.get("ignore"), f"{path}.ignore"), f"{path}.ignore"), False)

    def ignored(self, module: str) -> str | None:
        """The ``ignore`` entry naming ``module``, if one does."""
        return next((entry for entry in self.ignore if self._ignores(entry, module)), None)

    def group_for(self, module: str, *, stored_quantized: bool) -> SchemeGroup | None:
        """The first group whose targets take ``module`` (class targets take what is
        stored quantized), None when it is ignored or untargeted."""
        if self.ignored(module) is not None:
            return None
        return next((group for group in self.groups for target in group.targets
                     if names_module(target, module, f"{group.path}.targets") or (stored_quantized and is_class_name(target))), None)

    def _ignores(self, entry: str, module: str) -> bool:
        if not self.modelopt:
            return names_module(entry, module, f"{self.path}.ignore")
        # ModelOpt's exclude_modules: module names or fnmatch patterns, a parent excluding its children
        return module == entry or module.startswith(entry + ".") or fnmatch.fnmatchcase(module, entry)


def _compressed_group(path: str, name: str, group: Any, top_format: Any) -> SchemeGroup:
    if not isinstance(group, dict):
        raise QuantizationConfigError(f"{path} is {group!r}, not an object")
    targets = checked_names(_strings(group.get("targets"), f"{path}.targets"), f"{path}.targets")
    if not targets:
        raise QuantizationConfigError(f"{path}.targets is {group.get('targets')!r}, not a list of module names or "
                                      "classes")
    fmt, w = group.get("format") or top_format, group.get("weights")
    if not isinstance(w, dict):
        return SchemeGroup(name, path, targets, None, f"weights is {w!r}: the group quantizes no weights")
    kind = (w.get("num_bits"), w.get("type"))
    strategy = w.get("strategy")
    what = f"format {fmt!r} with {w.get('num_bits')}-bit {w.get('type')} weights, strategy {strategy!r}"
    if kind == (8, "float") and fmt in ("float-quantized", "naive-quantized"):
        return _fp8_group(path, name, targets, w, what)
    if kind == (4, "float") and fmt == "nvfp4-pack-quantized":
        if strategy != "tensor_group" or w.get("group_size") != NVFP4_GROUP:
            return SchemeGroup(name, path, targets, None, f"{what}, group_size {w.get('group_size')!r}: NVFP4 is "
                                                          f"strategy 'tensor_group' with group_size {NVFP4_GROUP}")
        return SchemeGroup(name, path, targets, WeightScheme("nvfp4", strategy, "compressed-tensors"))
    hint = " (pack-quantized int4: rules/compressed_int4_to_bf16.yaml)" if fmt == "pack-quantized" else ""
    return SchemeGroup(name, path, targets, None, f"{what} is neither FP8 float-quantized nor NVFP4{hint}")


def _fp8_group(path: str, name: str, targets: tuple[str, ...], w: dict[str, Any], what: str) -> SchemeGroup:
    strategy = w.get("strategy")
    if w.get("symmetric", True) is not True or w.get("dynamic", False) is not False:
        return SchemeGroup(name, path, targets, None, f"{what}: only symmetric weights with a stored scale "
                                                      "(symmetric: true, dynamic: false) are read")
    if strategy in ("tensor", "channel"):
        return SchemeGroup(name, path, targets, WeightScheme("fp8", strategy, "compressed-tensors"))
    block = w.get("block_structure")
    if strategy == "block" and isinstance(block, list) and len(block) == 2 and all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
        return SchemeGroup(name, path, targets, WeightScheme("fp8", "block", "compressed-tensors", (block[0], block[1])))
    return SchemeGroup(name, path, targets, None, f"{what}, block_structure {block!r}: FP8 weights are read per "
                                                  "tensor, per channel or per block [rows, cols]")


def _modelopt_group(q: dict[str, Any], path: str) -> SchemeGroup:
    algo = q.get("quant_algo")
    groups = q.get("config_groups")
    targets: tuple[str, ...] = ("Linear",)
    if isinstance(groups, dict) and groups:
        targets = tuple(t for g in groups.values() if isinstance(g, dict)
                        for t in _strings(g.get("targets"), f"{path}.config_groups")) or targets
    where = f"{path}.quant_algo"
    if algo == "NVFP4":
        return SchemeGroup(str(algo), where, targets, WeightScheme("nvfp4", "tensor_group", "modelopt"))
    if algo == "FP8":
        return SchemeGroup(str(algo), where, targets, WeightScheme("fp8", "tensor", "modelopt"))
    return SchemeGroup(str(algo), where, targets, None, f"quant_algo {algo!r} is neither 'NVFP4' nor 'FP8'")


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise QuantizationConfigError(f"{where} is {value!r}, not a list of strings")
    return tuple(value)
