"""mtp_extract and dflash_to_speculators against speculators 0.9.0's own converters.

speculators is the reference: its MTPConverter and DFlashConverter convert the same
stand-ins (several dimensions, odd widths, GQA, several seeds; the tests build none of
the expected tensors by hand), and our output must hold exactly their tensors and their
config fields, and load with their ``from_pretrained``. Marked ``consumer``: speculators
is the optional consumer extra (see tests/test_consumers.py).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, read_output, same_bits

from ckptxform import api
from ckptxform.standins.dflash import QWEN3_DFLASH_TINY, DFlashDims, build_dflash_drafter, build_qwen3_verifier
from ckptxform.standins.mtp import QWEN3_NEXT_TINY, Qwen3NextDims, build_qwen3_next_verifier

pytestmark = [
    pytest.mark.consumer,
    pytest.mark.skipif(importlib.util.find_spec("speculators") is None,
                       reason="speculators is not installed; pip install 'speculators==0.9.0' (the 'consumer' extra)"),
]

RULES = REPO / "rules"
#: written by speculators' save_pretrained about itself, not about the drafter; auto_map
#: names the config.py it copies beside (its own loader never reads it)
WRITER_FIELDS = {"speculators_version", "transformers_version", "auto_map"}

QWEN3_NEXT_WIDE = Qwen3NextDims(hidden=24, heads=3, kv_heads=3, head_dim=8, experts=5, experts_per_token=3,
                                moe_intermediate=16, vocab=257, layers=8)
DFLASH_NEWER = DFlashDims(hidden=24, heads=3, kv_heads=3, head_dim=8, intermediate=40, vocab=263, layers=2,
                          verifier_layers=6, target_layer_ids=(0, 2, 3, 4), block_size=8,
                          block_size_in_dflash_config=True)


def _same_config(ours: dict[str, Any], theirs: dict[str, Any], verifier: Path) -> None:
    """Every field speculators writes, ours the same (name_or_path: the verifier as given,
    a local path to both); transformer_layer_config as transformers reads it (it rewrites
    rope_theta and torch_dtype on load)."""
    assert set(ours) == set(theirs) - WRITER_FIELDS
    for key in sorted(set(ours) - {"transformer_layer_config", "speculators_config"}):
        assert ours[key] == theirs[key], key
    assert ours["speculators_config"]["verifier"]["name_or_path"] == str(verifier)
    assert ours["speculators_config"] == theirs["speculators_config"]


def _loaded_layer_config(config_class: Any, out: Path) -> dict[str, Any]:
    layer = config_class.from_pretrained(out).transformer_layer_config.to_dict()
    layer.pop("transformers_version", None)
    return layer


def _same_tensors(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert sorted(ours) == sorted(theirs)
    wrong = [k for k in ours if not same_bits(ours[k], theirs[k])]
    assert not wrong, f"other bytes than speculators' converter for {wrong}"


# -- MTP ----------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=[(QWEN3_NEXT_TINY, 1), (QWEN3_NEXT_TINY, 2), (QWEN3_NEXT_WIDE, 3)],
                ids=["tiny-seed1", "tiny-seed2", "wide-seed3"])
def mtp_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    from speculators.convert.mtp.converter import MTPConverter

    dims, seed = request.param
    root = tmp_path_factory.mktemp("mtp")
    verifier = build_qwen3_next_verifier(root / "Qwen3-Next", dims, seed=seed).path
    ours = api.apply(RULES / "mtp_extract.yaml", out=root / "ours", sources={"verifier": str(verifier)},
                     progress=False).out
    MTPConverter().convert(verifier, root / "theirs", base_model=str(verifier), validate=True)
    return verifier, ours, root / "theirs"


def test_mtp_extract_writes_the_tensors_of_speculators_converter(mtp_case: tuple[Path, Path, Path]) -> None:
    import torch

    _, ours, theirs = mtp_case
    theirs_tensors = read_output(theirs)
    # its NaN placeholder, which its loader replaces; the loading test shows it is not needed
    placeholder = theirs_tensors.pop("verifier_lm_head.weight")
    assert torch.isnan(placeholder.float()).all()
    _same_tensors(read_output(ours), theirs_tensors)


def test_mtp_extract_writes_the_config_of_speculators_converter(mtp_case: tuple[Path, Path, Path]) -> None:
    from speculators.models.mtp import MTPSpeculatorConfig

    verifier, ours, theirs = mtp_case
    ours_json, theirs_json = (json.loads((d / "config.json").read_text()) for d in (ours, theirs))
    _same_config(ours_json, theirs_json, verifier)
    assert _loaded_layer_config(MTPSpeculatorConfig, ours) == _loaded_layer_config(MTPSpeculatorConfig, theirs)


def test_speculators_loads_the_mtp_drafter_without_the_nan_placeholder(mtp_case: tuple[Path, Path, Path]) -> None:
    from speculators.models.mtp import MTPDraftModel, MTPSpeculatorConfig

    verifier, ours, _ = mtp_case
    state, written = _loaded(MTPDraftModel, MTPSpeculatorConfig, ours, verifier)
    assert "verifier_lm_head.weight" not in written
    verifier_tensors = read_output(verifier)
    assert same_bits(state["embed_tokens.weight"], verifier_tensors["model.embed_tokens.weight"])
    assert same_bits(state["lm_head.weight"], verifier_tensors["lm_head.weight"])


def test_mtp_graft_of_speculators_drafter_gives_the_verifier_back_byte_for_byte(
        mtp_case: tuple[Path, Path, Path], tmp_path: Path) -> None:
    verifier, _, theirs = mtp_case
    grafted = api.apply(RULES / "mtp_graft.yaml", out=tmp_path / "grafted",
                        sources={"drafter": str(theirs), "verifier": str(verifier)}, progress=False).out
    _same_tensors(read_output(grafted), read_output(verifier))


def _loaded(model_class: Any, config_class: Any, out: Path, verifier: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the state speculators' from_pretrained holds, our tensors), after checking that it
    holds each of ours as written; the verifier it reads is the local stand-in."""
    config = config_class.from_pretrained(out)
    config.speculators_config.verifier.name_or_path = str(verifier)
    state = model_class.from_pretrained(out, config=config).state_dict()
    written = read_output(out)
    wrong = [k for k, v in written.items() if not same_bits(state[k], v)]
    assert not wrong, f"speculators holds other values (or dtypes) for {wrong}"
    return state, written


# -- DFlash -------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=[(QWEN3_DFLASH_TINY, 4), (QWEN3_DFLASH_TINY, 5), (DFLASH_NEWER, 6)],
                ids=["qwen3-seed4", "qwen3-seed5", "block-in-dflash-config-seed6"])
def dflash_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    from speculators.convert.dflash.converter import DFlashConverter

    dims, seed = request.param
    root = tmp_path_factory.mktemp("dflash")
    drafter = build_dflash_drafter(root / "Qwen3-8B-DFlash-b16", dims, seed=seed).path
    verifier = build_qwen3_verifier(root / "Qwen3-8B", dims, seed=seed + 100).path
    ours = api.apply(RULES / "dflash_to_speculators.yaml", out=root / "ours",
                     sources={"model": str(drafter), "verifier": str(verifier)}, progress=False).out
    DFlashConverter().convert(drafter, root / "theirs", base_model=str(verifier), validate=True)
    return verifier, ours, root / "theirs"


def test_dflash_to_speculators_writes_the_tensors_of_speculators_converter(
        dflash_case: tuple[Path, Path, Path]) -> None:
    _, ours, theirs = dflash_case
    _same_tensors(read_output(ours), read_output(theirs))


def test_dflash_to_speculators_writes_the_config_of_speculators_converter(
        dflash_case: tuple[Path, Path, Path]) -> None:
    from speculators.models.dflash import DFlashSpeculatorConfig

    verifier, ours, theirs = dflash_case
    ours_json, theirs_json = (json.loads((d / "config.json").read_text()) for d in (ours, theirs))
    _same_config(ours_json, theirs_json, verifier)
    assert _loaded_layer_config(DFlashSpeculatorConfig, ours) == _loaded_layer_config(DFlashSpeculatorConfig, theirs)


def test_dflash_draft_model_from_pretrained_loads_ours(dflash_case: tuple[Path, Path, Path]) -> None:
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    verifier, ours, _ = dflash_case
    state, _ = _loaded(DFlashDraftModel, DFlashSpeculatorConfig, ours, verifier)
    verifier_tensors = read_output(verifier)
    assert same_bits(state["embed_tokens.weight"], verifier_tensors["model.embed_tokens.weight"])
    assert same_bits(state["lm_head.weight"], verifier_tensors["lm_head.weight"])


# -- DSpark (issue 39) ---------------------------------------------------------------------
# speculators 0.9.0 ships DSparkDraftModel (models/dspark) but no DSpark converter (the one in
# its pull request #737 came later): the reference here is its model loading our output
# strictly, holding every tensor as written and taking embed_tokens/lm_head from the verifier.

@pytest.mark.parametrize("variant", ["vanilla", "gated", "bare"])
def test_dspark_draft_model_loads_ours_strictly(variant: str, tmp_path: Path) -> None:
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
    from test_dspark_rules import BARE, GATED

    from ckptxform.standins.dspark import QWEN3_DSPARK_TINY, build_dspark_drafter, build_dspark_verifier

    dims = {"vanilla": QWEN3_DSPARK_TINY, "gated": GATED, "bare": BARE}[variant]
    verifier = build_dspark_verifier(tmp_path / "Qwen3-4B", dims, seed=21).path
    deepspec = build_dspark_drafter(tmp_path / "DSpark", verifier, dims, seed=22).path
    ours = api.apply(RULES / "dspark_to_speculators.yaml", out=tmp_path / "ours",
                     sources={"model": str(deepspec), "verifier": str(verifier)}, progress=False).out
    config = DSparkSpeculatorConfig.from_pretrained(ours)
    config.speculators_config.verifier.name_or_path = str(verifier)
    # transformers' report: nothing missing (but what its model takes from the verifier), nothing unexpected
    _, info = DSparkDraftModel.from_pretrained(ours, config=config, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    # (with output_loading_info speculators skips its verifier step, so load again for the values)
    model = DSparkDraftModel.from_pretrained(ours, config=config)
    state, written = model.state_dict(), read_output(ours)
    wrong = [k for k, v in written.items() if not same_bits(state[k], v)]
    assert not wrong, f"speculators holds other values (or dtypes) for {wrong}"
    # every parameter it has is ours or the verifier's
    verifier_tensors = read_output(verifier)
    assert set(state) - set(written) <= {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                                         "verifier_norm.weight"}
    assert same_bits(state["embed_tokens.weight"], verifier_tensors["model.embed_tokens.weight"])
    assert same_bits(state["lm_head.weight"], verifier_tensors["lm_head.weight"])
    assert (model.markov_head is None) == (dims.markov_rank == 0)
    assert (model.confidence_head is None) == (not dims.confidence_head)
    assert model.config.sample_from_anchor is True and model.config.aux_hidden_state_layer_ids == [
        i + 1 for i in dims.target_layer_ids]
