"""speculators_to_dflash (issue 39, item 3): a speculators DFlash drafter back to z-lab's
layout. z-lab's own package (PyPI ``dflash`` 0.1.0, CI's reference step) loads the output
strictly and reads from it the verifier hidden states, block size and mask token that
speculators reads from the input; z-lab -> speculators -> z-lab gives back the tensors and
config fields; what z-lab's model cannot hold is refused.

The layer ids: speculators' ``aux_hidden_state_layer_ids`` index the verifier's
hidden_states as they are (DFlashConverter writes target_layer_ids + 1), z-lab's
``extract_context_feature`` reads hidden_states[id + 1].
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, read_output, same_bits

from ckptxform import api
from ckptxform.errors import CkptxformError
from ckptxform.standins.dflash import QWEN3_DFLASH_TINY, DFlashDims, build_dflash_drafter, build_qwen3_verifier
from ckptxform.vocab.preflight import preflight

RULES = REPO / "rules"

#: block_size inside dflash_config (z-lab's newer releases), a block other than the dflash
#: package's default 16, float32, GQA 3:1, a first-layer id (z-lab 0, speculators 1)
NEWER = DFlashDims(hidden=24, heads=3, kv_heads=1, head_dim=8, intermediate=40, vocab=263, layers=2,
                   verifier_layers=7, target_layer_ids=(0, 3, 5), block_size=10, block_size_in_dflash_config=True,
                   dtype="float32")

needs_dflash = pytest.mark.skipif(importlib.util.find_spec("dflash") is None,
                                  reason="z-lab's dflash package is not installed (CI's reference step installs it)")


def _speculators(root: Path, dims: DFlashDims, seed: int) -> tuple[Path, Path, Path]:
    """z-lab stand-in, its verifier, and the speculators drafter dflash_to_speculators makes of it."""
    zlab = build_dflash_drafter(root / "Qwen3-8B-DFlash-b16", dims, seed=seed).path
    verifier = build_qwen3_verifier(root / "Qwen3-8B", dims, seed=seed + 1).path
    out = api.apply(RULES / "dflash_to_speculators.yaml", out=root / "speculators",
                    sources={"model": str(zlab), "verifier": str(verifier)}, progress=False).out
    return zlab, verifier, out


def _back(root: Path, speculators: Path, verifier: Path) -> Path:
    return api.apply(RULES / "speculators_to_dflash.yaml", out=root / "zlab", progress=False,
                     sources={"model": str(speculators), "verifier": str(verifier)}).out


def _config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize(("dims", "seed"), [(QWEN3_DFLASH_TINY, 3), (NEWER, 8)], ids=["qwen3-b16", "newer-b10"])
def test_round_trip_gives_back_the_zlab_drafter(dims: DFlashDims, seed: int, tmp_path: Path) -> None:
    zlab, verifier, speculators = _speculators(tmp_path, dims, seed)
    back = _back(tmp_path, speculators, verifier)
    source, again = read_output(zlab), read_output(back)
    assert sorted(again) == sorted(source) and all(same_bits(again[k], source[k]) for k in source)
    written, original = _config(back), _config(zlab)
    # no auto_map (it names a dflash.py this output does not carry); block_size in both of z-lab's places
    original.pop("auto_map")
    original.setdefault("block_size", dims.block_size)
    original["dflash_config"].setdefault("block_size", dims.block_size)
    assert written == original
    report = preflight(str(back), verifier=str(verifier))
    assert report.exit_code == 0 and report.consumers == ("vllm", "sglang", "transformers"), report.text()
    # vLLM reads dflash_config.target_layer_ids + 1, since its pull request #40727 only
    assert any("pull request #40727" in note for note in report.notes), report.text()


@needs_dflash
@pytest.mark.reference
@pytest.mark.parametrize(("dims", "seed"), [(QWEN3_DFLASH_TINY, 11), (NEWER, 12)], ids=["qwen3-b16", "newer-b10"])
def test_dflash_package_loads_it_strictly_and_reads_what_speculators_reads(dims: DFlashDims, seed: int,
                                                                            tmp_path: Path) -> None:
    from dflash import DFlashDraftModel, extract_context_feature

    _, verifier, speculators = _speculators(tmp_path, dims, seed)
    theirs = _config(speculators)
    back = _back(tmp_path, speculators, verifier)
    model, info = DFlashDraftModel.from_pretrained(str(back), output_loading_info=True)
    assert {k: set(v) for k, v in info.items()} == {"missing_keys": set(), "unexpected_keys": set(),
                                                    "mismatched_keys": set(), "error_msgs": set()}
    tensors = read_output(speculators)
    state = model.state_dict()
    assert sorted(state) == sorted(tensors) and all(same_bits(state[k], tensors[k]) for k in tensors)
    assert str(model.dtype).removeprefix("torch.") == dims.dtype
    # every field the package reads with a default of its own is the speculators drafter's
    assert (model.block_size, model.mask_token_id) == (theirs["block_size"], theirs["mask_token_id"])
    # z-lab's reading of its ids picks the hidden states speculators' ids name
    hidden_states = [torch.full((1, 2, dims.hidden), float(i)) for i in range(dims.verifier_layers + 1)]
    picked = extract_context_feature(hidden_states, model.target_layer_ids)
    assert torch.equal(picked, torch.cat([hidden_states[i] for i in theirs["aux_hidden_state_layer_ids"]], dim=-1))
    assert model.fc.in_features == picked.shape[-1]


def _refused(sources: dict[str, str], out: Path) -> str:
    with pytest.raises(CkptxformError) as err:
        api.apply(RULES / "speculators_to_dflash.yaml", out=out, sources=sources, progress=False)
    assert not out.exists()
    return str(err.value)


@pytest.mark.parametrize(("field", "change"), [
    ("sample_from_anchor", lambda c: c.update(sample_from_anchor=True)),
    ("aux_hidden_state_layer_ids", lambda c: c.update(aux_hidden_state_layer_ids=[0, 5, 7])),
    ("aux_hidden_state_layer_ids", lambda c: c.update(aux_hidden_state_layer_ids=[2, 5, 10])),
    ("mask_token_id", lambda c: c.update(mask_token_id=None)),
    ("transformer_layer_config.model_type", lambda c: c["transformer_layer_config"].update(model_type="gemma3_text")),
    ("draft_vocab_size", lambda c: c.update(draft_vocab_size=64)),
], ids=["anchor", "embedding-output", "past-last-layer", "no-mask-token", "gemma", "draft-vocab"])
def test_what_zlab_cannot_hold_is_refused(field: str, change: Any, tmp_path: Path) -> None:
    _, verifier, speculators = _speculators(tmp_path, QWEN3_DFLASH_TINY, seed=21)
    config = _config(speculators)
    change(config)
    (speculators / "config.json").write_text(json.dumps(config))
    message = _refused({"model": str(speculators), "verifier": str(verifier)}, tmp_path / "out")
    assert field in message, message


def test_preflight_names_a_missing_block_size(tmp_path: Path) -> None:
    """The dflash package reads a missing block_size as 16, speculators' DFlash config as 8."""
    zlab, verifier, speculators = _speculators(tmp_path, NEWER, seed=31)
    back = _back(tmp_path, speculators, verifier)

    def zlab_without(config: dict[str, Any]) -> None:
        del config["block_size"], config["dflash_config"]["block_size"]

    def speculators_without(config: dict[str, Any]) -> None:
        del config["block_size"]

    for path, consumers, drop in ((back, "transformers", zlab_without), (speculators, "speculators",
                                                                          speculators_without)):
        config = _config(path)
        drop(config)
        (path / "config.json").write_text(json.dumps(config))
        report = preflight(str(path), verifier=str(verifier), consumers=consumers)
        [finding] = report.findings
        reads = ("z-lab's dflash package reads 16 (its default), speculators' DFlashConverter refuses the checkpoint"
                 if consumers == "transformers" else "reads 8 (DFlashSpeculatorConfig's default)")
        assert finding.text() == (f"block_size: absent: {reads}; a block other than the one the drafter was trained "
                                  "with drafts at the wrong positions; fix: write block_size, as the drafter was "
                                  "trained")
