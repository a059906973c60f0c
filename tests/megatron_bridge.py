"""Megatron-Bridge's own Megatron -> HF weight export, run on CPU for the reference tests.

Megatron-Bridge (PyPI ``megatron-bridge``, pinned in .ci/reference-nodeps.txt) maps a
megatron-core model to HF names with a bridge's ``mapping_registry()`` and exports it with
``MegatronModelBridge.stream_weights_megatron_to_hf`` (the TP all-gather, the q/k/v split by
query group, the gate/up split, the expert gather). Its package ``__init__`` files import
every model family and its PEFT layers, which need TransformerEngine (a CUDA build that does
not install here); the export path uses none of them. So:

- the ``megatron.bridge`` packages on the way are registered as bare packages (their
  ``__init__`` not run) and only the modules the export needs are imported;
- two PEFT modules on that import chain (peft/lora.py, peft/lora_layers.py) run
  ``import transformer_engine.pytorch as te`` and subclass ``te.Linear``: while they are
  imported, ``transformer_engine`` is a stand-in whose classes refuse to be instantiated, so
  any code path that touched TransformerEngine would fail loudly, and ``isinstance`` against
  them is False, which is the truth (the models here hold no TE module). The export is run
  with ``merge_adapter_weights=False``, the only switch that would reach those modules.
- 0.3.1's ``gather_from_ep_ranks`` reads the expert number off the end of the Megatron
  name (``...linear_fc1.weight3``, TEGroupedMLP's), which a SequentialMLP name
  (``...local_experts.3.linear_fc1.weight``) does not end in: ``int('')`` fails. Upstream
  has since added the fast path for one expert-parallel rank (nothing to gather: the tensor
  under its own HF name); the same fast path is installed here, for EP=1 only, and changes
  no value (0.3.1's gather over one rank returns the same tensor).
- megatron-core must never see the stand-in (it picks TE code paths when TE imports): every
  megatron-core module the bridge imports is imported first, and one the bridge would
  import during that window is refused (an ImportError, as when TE is absent).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
import types
from collections.abc import Iterable
from typing import Any

#: what .ci/reference-nodeps.txt installs
PIN = "megatron-bridge==0.3.1"

#: the bridge packages whose __init__ would import all of Megatron-Bridge
_PACKAGES = ("", "models", "models.conversion", "models.decorators", "models.hf_pretrained", "models.llama",
             "models.qwen", "peft", "utils")

#: megatron-core modules the bridge's export modules import (imported before the stand-in exists)
_CORE_FIRST = ("megatron.core.models.gpt.gpt_layer_specs", "megatron.core.models.gpt.moe_module_specs",
               "megatron.core.post_training.modelopt.gpt.model_specs",
               "megatron.core.transformer.custom_layers.transformer_engine",
               "megatron.core.transformer.heterogeneous.heterogeneous_config",
               "megatron.core.transformer.multi_latent_attention", "megatron.core.extensions.kitchen",
               "megatron.core.extensions.transformer_engine_spec_provider",
               "megatron.core.fusions.fused_mla_yarn_rope_apply", "megatron.core.fusions.fused_bias_dropout")

_TE = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.ops")


class _AbsentTE:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"{type(self).__name__}: TransformerEngine is not installed; the reference export "
                           "must not reach a TransformerEngine code path")


class _StandInTE(types.ModuleType):
    """A module whose every attribute is a class that cannot be instantiated."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        absent = type(name, (_AbsentTE,), {})
        setattr(self, name, absent)
        return absent


class _NoNewCore(importlib.abc.MetaPathFinder):
    """Refuses megatron-core modules not imported before the stand-in was installed."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname == "megatron.core" or fullname.startswith("megatron.core."):
            raise ImportError(f"{fullname}: not imported while transformer_engine is stood in")


def load(*modules: str) -> list[types.ModuleType]:
    """Import ``megatron.bridge.<module>`` for each of ``modules``; ImportError (with the
    reason) when Megatron-Bridge is not installed or its code no longer imports this way."""
    spec = importlib.util.find_spec("megatron.bridge")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"Megatron-Bridge is not installed (pip install --no-deps {PIN})")
    root = list(spec.submodule_search_locations)[0]
    for module in _CORE_FIRST:
        importlib.import_module(module)
    for package in _PACKAGES:
        name = "megatron.bridge" + (f".{package}" if package else "")
        if name not in sys.modules:
            bare = types.ModuleType(name)
            bare.__path__ = [os.path.join(root, *package.split("."))] if package else [root]
            sys.modules[name] = bare
    te = {name: _StandInTE(name) for name in _TE}
    te["transformer_engine"].pytorch = te["transformer_engine.pytorch"]  # type: ignore[attr-defined]
    te["transformer_engine.pytorch"].ops = te["transformer_engine.pytorch.ops"]  # type: ignore[attr-defined]
    guard = _NoNewCore()
    sys.modules.update(te)
    sys.meta_path.insert(0, guard)
    try:
        loaded = [importlib.import_module(f"megatron.bridge.{m}") for m in modules]
    finally:
        sys.meta_path.remove(guard)
        for name in _TE:
            sys.modules.pop(name, None)
    _one_ep_rank_fast_path(sys.modules["megatron.bridge.models.conversion.param_mapping"].MegatronParamMapping)
    return loaded


def _one_ep_rank_fast_path(mapping: Any) -> None:
    """Upstream's EP=1 path of ``gather_from_ep_ranks`` (see the module's docstring)."""
    gather = mapping.gather_from_ep_ranks
    if getattr(gather, "one_ep_rank", False):
        return

    def gather_from_ep_ranks(self: Any, megatron_weights: Any, megatron_module: Any, hf_param_name: Any) -> Any:
        if self.ep_size == 1:
            return {str(hf_param_name): megatron_weights}
        return gather(self, megatron_weights, megatron_module, hf_param_name)

    gather_from_ep_ranks.one_ep_rank = True  # type: ignore[attr-defined]
    mapping.gather_from_ep_ranks = gather_from_ep_ranks


class _AnyKey:
    """An HF key list that holds every name: the registry's mappings are all exported."""

    def __contains__(self, key: object) -> bool:
        return True


def export(bridge: Any, model: Any, hf_keys: Iterable[str] | None) -> dict[str, Any]:
    """``bridge.stream_weights_megatron_to_hf(model, ...)`` as a dict, on every rank of the
    model's groups (it all-gathers the TP shards). ``hf_keys``: the HF checkpoint's tensor
    names, which the bridge exports only mappings onto (``None``: every mapping)."""
    keys = _AnyKey() if hf_keys is None else list(hf_keys)
    source = types.SimpleNamespace(get_all_keys=lambda: keys)
    hf = types.SimpleNamespace(state=types.SimpleNamespace(source=source))
    return dict(bridge.stream_weights_megatron_to_hf(model, hf, cpu=True, show_progress=False,
                                                     merge_adapter_weights=False))
