"""dspark_to_speculators and speculators_to_dspark on DeepSpec stand-ins (issue 39, item 2).

The tensors are copies, so the check is bytes: every drafter tensor of the DeepSpec
checkpoint is in the speculators output unchanged, and DeepSpec -> speculators -> DeepSpec
gives back the same tensors and config fields. The layer-id shift follows DeepSpec's
``extract_context_feature`` (id i reads hidden_states[i + 1], -1 hidden_states[0]); the
config follows speculators' pull request #737 but for the draft block, where DeepSpec
is followed (see the rule). That speculators 0.9 loads the output strictly is
tests/test_drafter_consumers.py's (the consumer extra).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, read_output, same_bits

from ckptxform import api
from ckptxform.errors import CkptxformError
from ckptxform.standins.dspark import QWEN3_DSPARK_TINY, DSparkDims, build_dspark_drafter, build_dspark_verifier
from ckptxform.vocab.preflight import preflight

RULES = REPO / "rules"
#: gated Markov head, confidence head without the Markov features, float32, GQA 3:1, ids without -1
GATED = DSparkDims(hidden=24, heads=3, kv_heads=1, head_dim=8, intermediate=40, vocab=263, layers=1,
                   verifier_layers=6, target_layer_ids=(0, 2, 5), block_size=4, markov_rank=6,
                   markov_head_type="gated", confidence_head_with_markov=False, dtype="float32")
#: no Markov head and no confidence head (pure DFlash drafting in DeepSpec's layout)
BARE = DSparkDims(hidden=24, heads=3, kv_heads=3, head_dim=8, intermediate=40, vocab=263, layers=2,
                  verifier_layers=6, target_layer_ids=(-1, 4), block_size=5, markov_rank=0, confidence_head=False)


def _convert(root: Path, dims: DSparkDims, seed: int) -> tuple[Path, Path, Path]:
    verifier = build_dspark_verifier(root / "Qwen3-4B", dims, seed=seed).path
    deepspec = build_dspark_drafter(root / "DSpark", verifier, dims, seed=seed + 1).path
    out = api.apply(RULES / "dspark_to_speculators.yaml", out=root / "speculators",
                    sources={"model": str(deepspec), "verifier": str(verifier)}, progress=False).out
    return verifier, deepspec, out


@pytest.mark.parametrize("dims", [QWEN3_DSPARK_TINY, GATED, BARE], ids=["vanilla", "gated", "bare"])
def test_round_trip_is_bit_exact(dims: DSparkDims, tmp_path: Path) -> None:
    verifier, deepspec, out = _convert(tmp_path, dims, seed=3)
    source, ours = read_output(deepspec), read_output(out)
    # speculators 0.9 saves no embed_tokens/lm_head for a full-vocabulary drafter
    assert sorted(ours) == sorted(k for k in source if k not in ("embed_tokens.weight", "lm_head.weight"))
    assert all(same_bits(ours[k], source[k]) for k in ours)
    back = api.apply(RULES / "speculators_to_dspark.yaml", out=tmp_path / "back",
                     sources={"model": str(out), "verifier": str(verifier)}, progress=False).out
    again = read_output(back)
    assert sorted(again) == sorted(source) and all(same_bits(again[k], source[k]) for k in source)
    written, original = (json.loads((p / "config.json").read_text()) for p in (back, deepspec))
    # DeepSpec writes markov_head_type only with a Markov head and confidence_head_with_markov only
    # with a confidence head; the reverse always writes both (its model reads neither then)
    extra = {k: written.pop(k) for k in ("markov_head_type", "confidence_head_with_markov") if k not in original}
    assert written == original
    assert extra == ({} if dims.markov_rank and dims.confidence_head else
                     {"markov_head_type": "vanilla", "confidence_head_with_markov": False})


def test_speculators_config(tmp_path: Path) -> None:
    _, deepspec, out = _convert(tmp_path, QWEN3_DSPARK_TINY, seed=5)
    config = json.loads((out / "config.json").read_text())
    theirs = json.loads((deepspec / "config.json").read_text())
    # DeepSpec's -1 (the embedding output, hidden_states[0]) is speculators' 0; i reads hidden_states[i + 1]
    assert theirs["target_layer_ids"] == [-1, 3, 7] and config["aux_hidden_state_layer_ids"] == [0, 4, 8]
    # DeepSpec's anchor-first block: block_size slots draft block_size tokens
    assert config["sample_from_anchor"] is True
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == theirs["block_size"] == 7
    assert {k: config[k] for k in ("markov_rank", "markov_head_type", "enable_confidence_head",
                                   "confidence_head_with_markov", "mask_token_id", "block_size")} == {
        k: theirs[k] for k in ("markov_rank", "markov_head_type", "enable_confidence_head",
                               "confidence_head_with_markov", "mask_token_id", "block_size")}
    layer = config["transformer_layer_config"]
    assert not set(layer) & {"target_layer_ids", "markov_rank", "num_anchors", "block_size", "architectures"}
    assert {k: v for k, v in theirs.items() if k in layer} == layer
    assert preflight(str(out), verifier=str(tmp_path / "Qwen3-4B")).exit_code == 0


def _refused(rule: str, sources: dict[str, str], out: Path) -> str:
    with pytest.raises(CkptxformError) as err:
        api.apply(RULES / rule, out=out, sources=sources, progress=False)
    assert not out.exists()
    return str(err.value)


def test_refusals(tmp_path: Path) -> None:
    verifier, deepspec, out = _convert(tmp_path, QWEN3_DSPARK_TINY, seed=7)
    # a verifier with fewer layers than the drafter reads
    small = build_dspark_verifier(tmp_path / "small", DSparkDims(**{**_fields(QWEN3_DSPARK_TINY),
                                                                     "verifier_layers": 4})).path
    message = _refused("dspark_to_speculators.yaml", {"model": str(deepspec), "verifier": str(small)}, tmp_path / "x")
    assert "target_layer_ids" in message and "7" in message
    # a speculators drafter trained with sample_from_anchor false cannot be DeepSpec's
    config = json.loads((out / "config.json").read_text())
    config["sample_from_anchor"] = False
    (out / "config.json").write_text(json.dumps(config))
    message = _refused("speculators_to_dspark.yaml", {"model": str(out), "verifier": str(verifier)}, tmp_path / "y")
    assert "sample_from_anchor" in message
    # a tied verifier has no lm_head.weight for DeepSpec's frozen head
    tied = tmp_path / "tied"
    tied.mkdir()
    from safetensors.numpy import load_file, save_file
    head = load_file(str(verifier / "model.safetensors"))
    save_file({k: v for k, v in head.items() if k != "lm_head.weight"}, str(tied / "model.safetensors"))
    (tied / "config.json").write_text((verifier / "config.json").read_text())
    config["sample_from_anchor"] = True
    (out / "config.json").write_text(json.dumps(config))
    message = _refused("speculators_to_dspark.yaml", {"model": str(out), "verifier": str(tied)}, tmp_path / "z")
    assert "lm_head.weight" in message


def _fields(dims: DSparkDims) -> dict[str, Any]:
    from dataclasses import fields

    return {f.name: getattr(dims, f.name) for f in fields(dims)}
