"""rules/mistral_to_hf.yaml against transformers' convert_mistral_weights_to_hf.py (issue 38
item 5), restated in tests/mistral_reference.py from the transformers repository at a
pinned commit (no wheel ships it): on Mistral consolidated checkpoints the rule was not
tuned for (head_dim set apart from dim / n_heads as Mistral-Nemo does, GQA and MQA, with
and without head_dim, rope_theta, sliding_window and max_seq_len in params.json), every
tensor is the converter's, bit for bit, and the config fields equal its MistralConfig's;
MistralForCausalLM loads our output strictly and gives the logits of the converter's output.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import REPO, read_output
from safetensors.torch import load_file

from ckptxform import api
from ckptxform.standins.mistral import MistralDims, build_mistral_consolidated

RULE = REPO / "rules" / "mistral_to_hf.yaml"
REFERENCE = "needs the 'reference' extra: pip install torch==2.13.0 -e '.[test,reference]'"
FIELDS = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads",
          "head_dim", "vocab_size", "rms_norm_eps", "sliding_window", "max_position_embeddings", "hidden_act",
          "tie_word_embeddings", "model_type", "bos_token_id", "eos_token_id")

pytestmark = pytest.mark.reference


@pytest.mark.parametrize("dims", [
    MistralDims(),                                                     # Nemo-like: head_dim 24, dim 80, 5 heads
    MistralDims(dim=96, n_heads=4, n_kv_heads=2, head_dim=40, hidden_dim=160, n_layers=3, vocab_size=100,
                sliding_window=4096, max_seq_len=1024, dtype="float32"),
    MistralDims(dim=64, n_heads=4, n_kv_heads=4, head_dim=None, rope_theta=None, vocab_size=77, dtype="float16"),
], ids=["nemo", "gqa-swa-f32", "no-head-dim-f16"])
def test_the_output_is_what_the_converter_writes(tmp_path: Path, dims: MistralDims) -> None:
    pytest.importorskip("transformers", reason=REFERENCE)
    from mistral_reference import convert_and_load

    weights = build_mistral_consolidated(tmp_path / "Mistral-Nemo", dims, seed=dims.dim)
    params = json.loads(weights.with_name("params.json").read_text())
    model, config = convert_and_load(params, load_file(weights))
    model.save_pretrained(tmp_path / "theirs")  # as convert_and_write_model ends
    want = read_output(tmp_path / "theirs")

    out = api.apply(RULE, out=tmp_path / "out", sources={"model": str(weights)}, progress=False).out
    got = read_output(out)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        assert torch.equal(got[key].contiguous().view(torch.uint8), value.contiguous().view(torch.uint8)), key

    ours = json.loads((out / "config.json").read_text())
    theirs = config.to_dict()
    for field in FIELDS:
        assert ours.get(field) == theirs.get(field), field
    assert ours["rope_parameters"]["rope_theta"] == theirs["rope_parameters"]["rope_theta"]
    assert ours["architectures"] == ["MistralForCausalLM"]

    import transformers

    def load(path: Path) -> torch.nn.Module:
        loaded, info = transformers.MistralForCausalLM.from_pretrained(path, output_loading_info=True,
                                                                       dtype=value.dtype)
        assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
        return loaded.eval()

    ids = (torch.arange(48) * 7 % dims.vocab_size).reshape(1, -1)
    with torch.no_grad():
        assert torch.equal(load(out)(ids).logits, load(tmp_path / "theirs")(ids).logits)


def test_the_inverse_gives_the_checkpoint_and_its_params_back(tmp_path: Path, run_cli) -> None:
    """``ckptxform invert`` of the rule, applied to its output: the same tensors, and a
    params.json with head_dim and sliding_window again."""
    dims = MistralDims(sliding_window=4096, max_seq_len=2048)
    weights = build_mistral_consolidated(tmp_path / "src", dims, seed=5)
    out = api.apply(RULE, out=tmp_path / "hf", sources={"model": str(weights)}, progress=False).out
    proc = run_cli("invert", RULE, "--out", tmp_path / "inverse.yaml")
    assert proc.returncode == 0, proc.stderr
    back = api.apply(tmp_path / "inverse.yaml", out=tmp_path / "back", sources={"model": str(out)},
                     progress=False).out
    got, want = load_file(back / "model.safetensors"), load_file(weights)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    params = json.loads((back / "params.json").read_text())
    assert {k: params[k] for k in json.loads(weights.with_name("params.json").read_text())} == \
        json.loads(weights.with_name("params.json").read_text())
