"""A real consumer loads our speculators-layout output: the speculators package (0.9.0).

Its Eagle-3 draft model is built from the config.json we wrote and loads our weights with
no missing, unexpected or mis-shaped key, through the same transformers loader that
``Eagle3DraftModel.from_pretrained`` uses. Offline: the verifier named in
speculators_config (whose embedding and lm_head speculators loads) is pointed at a local
stand-in of it instead of the Hub repo.

speculators is an optional extra (it pulls transformers, datasets, ...; importing it
takes ~20 s here), so these tests are marked ``consumer`` and run in their own CI step.
They skip when speculators is not installed; an installed but broken speculators fails.
"""

from __future__ import annotations

import importlib.util
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, read_output, same_bits
from safetensors import safe_open

from ckptxform import api
from ckptxform.standins import (
    KIMI_K2_TINY,
    LLAMA31_8B_TINY,
    build_eagle3_drafter,
    build_headline_standins,
    build_llama_eagle3,
    build_llama_verifier,
    make_draft_vocab,
)

INSTALL = ("pip install 'speculators==0.9.0' 'torch==2.13.0' (the 'consumer' extra) && "
           "pip uninstall -y torchvision torchaudio   # see .ci/run")

pytestmark = [
    pytest.mark.consumer,
    pytest.mark.skipif(importlib.util.find_spec("speculators") is None,
                       reason=f"speculators is not installed; to run the consumer tests: {INSTALL}"),
]

RULES = REPO / "rules"
#: the demo's dimensions: what `ckptxform demo` writes must load in the real consumer
KIMI_DIMS = KIMI_K2_TINY
#: parameters speculators fills from the verifier, never from the drafter checkpoint
VERIFIER_OWNED = {"verifier_lm_head.weight", "verifier_norm.weight"}


@dataclass(frozen=True)
class Converted:
    out: Path
    verifier: Path
    embed_key: str  # the verifier's embedding, found by suffix as speculators does
    lm_head_key: str


@pytest.fixture(scope="module")
def spec() -> Any:
    """The speculators classes (imported here, not at collection: the import is slow)."""
    from speculators.model import SpeculatorModel
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    return SpeculatorModel, Eagle3DraftModel, Eagle3SpeculatorConfig


def _headline(root: Path) -> Converted:
    standins = build_headline_standins(root / "sources", dims=KIMI_DIMS, seed=5)
    result = api.apply(RULES / "aqmedai_k2_to_k25.yaml", out=root / "out",
                       sources=standins.sources, progress=False)
    return Converted(result.out, standins.verifier.path,
                     "language_model.model.embed_tokens.weight", "language_model.lm_head.weight")


def _llama_bin(root: Path) -> Converted:
    drafter = build_llama_eagle3(root / "EAGLE3-LLaMA3.1-Instruct-8B", seed=6)
    verifier = build_llama_verifier(root / "Llama-3.1-8B-Instruct", seed=7)
    result = api.apply(RULES / "eagle3_to_speculators.yaml", out=root / "out",
                       sources={"drafter": str(drafter.path)}, progress=False)
    return Converted(result.out, verifier.path, "model.embed_tokens.weight", "lm_head.weight")


def _llama_with_embed(root: Path) -> Converted:
    dims = LLAMA31_8B_TINY
    drafter = build_eagle3_drafter(root / "drafter", dims,
                                   make_draft_vocab(dims.vocab, dims.draft_vocab, seed=8),
                                   seed=8, include_embed=True)
    verifier = build_llama_verifier(root / "Llama-3.1-8B-Instruct", seed=9)
    result = api.apply(RULES / "eagle3_to_speculators.yaml", out=root / "out",
                       sources={"drafter": str(drafter.path)}, progress=False)
    return Converted(result.out, verifier.path, "model.embed_tokens.weight", "lm_head.weight")


CASES = {"aqmedai_k2_to_k25": _headline, "eagle3_to_speculators-llama-bin": _llama_bin,
         "eagle3_to_speculators-with-embed": _llama_with_embed}


@pytest.fixture(scope="module", params=sorted(CASES))
def converted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Converted:
    return CASES[request.param](tmp_path_factory.mktemp(request.param))


def _config(spec: Any, case: Converted) -> Any:
    """speculators' config from our config.json, its verifier pointed at the local stand-in."""
    _, _, config_class = spec
    config = config_class.from_pretrained(case.out)
    config.speculators_config.verifier.name_or_path = str(case.verifier)
    return config


def _verifier_tensor(case: Converted, key: str) -> torch.Tensor:
    index = case.verifier / "model.safetensors.index.json"
    file = (json.loads(index.read_text())["weight_map"][key] if index.exists()
            else "model.safetensors")
    with safe_open(str(case.verifier / file), framework="pt") as f:
        return f.get_tensor(key)


def test_config_is_read_as_an_eagle3_llama_drafter(spec: Any, converted: Converted) -> None:
    from transformers import LlamaConfig

    config = _config(spec, converted)
    ours = read_output(converted.out)
    assert config.speculators_model_type == "eagle3"
    assert type(config.transformer_layer_config) is LlamaConfig  # not the Qwen3 default
    assert config.draft_vocab_size == ours["d2t"].shape[0]
    assert config.target_vocab_size == ours["t2d"].shape[0]
    assert config.transformer_layer_config.num_hidden_layers == 1


def test_transformers_loader_reports_nothing_missing_unexpected_or_mismatched(
        spec: Any, converted: Converted) -> None:
    speculator_model, draft_model, _ = spec
    # The call Eagle3DraftModel.from_pretrained makes, asked for its loading report
    # (speculators' own wrapper cannot return it).
    _model, info = super(speculator_model, draft_model).from_pretrained(
        converted.out, config=_config(spec, converted), output_loading_info=True)
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(),
                    "error_msgs": []}


def test_state_dict_takes_every_tensor_and_misses_only_verifier_weights(
        spec: Any, converted: Converted) -> None:
    """transformers ignores missing d2t/t2d/embed_tokens (the model lists them as ignorable);
    loading the state dict directly does not."""
    _, draft_model, _ = spec
    model = draft_model(_config(spec, converted))
    ours = read_output(converted.out)
    result = model.load_state_dict(ours, strict=False)  # raises on any shape mismatch
    assert result.unexpected_keys == []
    expected_missing = VERIFIER_OWNED | ({"embed_tokens.weight"} - set(ours))
    assert set(result.missing_keys) == expected_missing


def test_from_pretrained_holds_our_bytes_and_the_verifier_rows(spec: Any, converted: Converted) -> None:
    _, draft_model, _ = spec
    with warnings.catch_warnings():
        # speculators warns when the config leaves the verifier layers to their default
        warnings.filterwarnings("ignore", message=".*target-layer-ids is not explicitly set.*")
        model = draft_model.from_pretrained(converted.out, config=_config(spec, converted))
    state = model.state_dict()
    ours = read_output(converted.out)
    wrong = [k for k, v in ours.items() if not same_bits(state[k], v)]
    assert not wrong, f"speculators holds other values (or dtypes) for {wrong}"
    # The embedding is ours when we ship one, else the verifier's.
    embed = ours.get("embed_tokens.weight", _verifier_tensor(converted, converted.embed_key))
    assert same_bits(state["embed_tokens.weight"], embed)
    # speculators selects the verifier's lm_head rows with t2d; they must be the rows of
    # the target ids d2t names (offsets), in draft order.
    d2t = ours["d2t"]
    verifier_lm = _verifier_tensor(converted, converted.lm_head_key)
    assert same_bits(state["verifier_lm_head.weight"], verifier_lm[torch.arange(len(d2t)) + d2t])
