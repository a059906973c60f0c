"""rules/qwen2_to_llama.yaml (issue 34): a Qwen2 checkpoint as a LlamaForCausalLM with
``attention_bias: true`` and zero ``o_proj`` biases (an ``add`` constant per layer).

Reference: tiny random Qwen2ForCausalLM models built and saved by transformers (hidden 30
and 44, GQA, a head_dim that is not hidden // heads, float32 and bfloat16, tied and untied
embeddings); LlamaForCausalLM loads the output strictly (no missing or unexpected key) and
computes Qwen2's logits: bit for bit in float32, and in bfloat16 too (o_proj's added zero
bias changes no value). Without the reference extra: the config written, the zero biases,
and the refusals (another family, a Qwen2 that uses its sliding window).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, assert_clean_failure, read_audit, read_output

from ckptxform import api
from ckptxform.standins.hf_models import LmDims, build_llama, build_qwen2

RULE = REPO / "rules" / "qwen2_to_llama.yaml"
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers is not installed; to run the reference tests: "
                                               "pip install torch==2.13.0 -e '.[test,reference]'")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_every_tensor_is_kept_and_each_layer_gets_a_zero_o_proj_bias(tmp_path: Path, tied: bool) -> None:
    import torch

    dims = LmDims(hidden=48, heads=6, kv_heads=2, layers=3, intermediate=40, vocab=70, dtype="bfloat16")
    source = build_qwen2(tmp_path / "qwen2", dims, tied=tied, seed=3)
    result = api.apply(RULE, out=tmp_path / "out", sources={"model": str(source)}, progress=False)
    got, given = read_output(result.out), read_output(source)
    biases = {f"model.layers.{i}.self_attn.o_proj.bias" for i in range(dims.layers)}
    assert set(got) == set(given) | biases and ("lm_head.weight" in got) is not tied
    assert all(torch.equal(got[k], given[k]) for k in given)
    assert all(torch.equal(got[k], torch.zeros(dims.hidden, dtype=torch.bfloat16)) for k in biases)
    written = json.loads((result.out / "config.json").read_text())
    config = json.loads((source / "config.json").read_text())
    for gone in ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types"):
        del config[gone]
    assert written == {**config, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "head_dim": 8,
                       "attention_bias": True, "mlp_bias": False}
    created = [e for e in read_audit(result.out) if e["event"] == "written" and e["key"] in biases]
    assert len(created) == dims.layers and all(e["from"] == {"created": "constant", "fill": 0} for e in created)


def test_a_qwen2_that_uses_its_sliding_window_is_refused(tmp_path: Path, run_cli: Any) -> None:
    source = build_qwen2(tmp_path / "qwen2")
    config = json.loads((source / "config.json").read_text())
    config["use_sliding_window"] = True
    (source / "config.json").write_text(json.dumps(config))
    err = assert_clean_failure(run_cli("apply", RULE, "--source", f"model={source}", "--out", tmp_path / "out"))
    assert "use_sliding_window" in err and err.endswith(
        "Llama has no sliding window, so a Qwen2 that uses one would compute other logits on long inputs\n")
    assert not (tmp_path / "out").exists()


def test_another_family_is_refused(tmp_path: Path, run_cli: Any) -> None:
    err = assert_clean_failure(run_cli("plan", RULE, "--source", f"model={build_llama(tmp_path / 'llama')}"))
    assert '"llama", not "qwen2"' in err and err.endswith(
        "this rule reads a Qwen2ForCausalLM (Qwen2, Qwen2.5); other families need their own rule\n")


@dataclass(frozen=True)
class Case:
    id: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype: str
    tied: bool
    seed: int


CASES = (Case("f32-30-3-heads-1-kv-tied", 30, 3, 1, 14, 44, 61, "float32", True, 1),
         Case("f32-44-4-heads-2-kv-untied", 44, 4, 2, 12, 36, 67, "float32", False, 2),
         Case("bf16-44-4-heads-2-kv-tied", 44, 4, 2, 12, 36, 67, "bfloat16", True, 3),
         Case("bf16-30-3-heads-1-kv-untied", 30, 3, 1, 14, 44, 61, "bfloat16", False, 4))
TOKENS = ((3, 17, 5, 29, 11, 2, 40, 0), (1, 8, 33, 8, 21, 47, 0, 52))


@pytest.mark.reference
@needs_transformers
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_llama_loads_it_strictly_and_computes_qwen2_logits(case: Case, tmp_path: Path) -> None:
    import torch
    import transformers
    from reference_models import randomize

    config = transformers.Qwen2Config(vocab_size=case.vocab, hidden_size=case.hidden, num_hidden_layers=2,
                                      num_attention_heads=case.heads, num_key_value_heads=case.kv_heads,
                                      head_dim=case.head_dim, intermediate_size=case.intermediate,
                                      tie_word_embeddings=case.tied)
    torch_dtype = getattr(torch, case.dtype)
    randomize(transformers.Qwen2ForCausalLM(config), case.seed).to(torch_dtype).save_pretrained(tmp_path / "qwen2")
    result = api.apply(RULE, out=tmp_path / "out", sources={"model": str(tmp_path / "qwen2")}, progress=False)
    ids = torch.tensor(TOKENS)
    # both loaded from disk, so both pick the same attention implementation; in the saved
    # dtype, and in float32 (the measure)
    for dtype in dict.fromkeys((torch_dtype, torch.float32)):
        qwen2 = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "qwen2", dtype=dtype).eval()
        llama, info = transformers.LlamaForCausalLM.from_pretrained(result.out, dtype=dtype,
                                                                    output_loading_info=True)
        assert not any(info.values()), info  # no missing, unexpected or mismatched key
        assert llama.config.attention_bias and llama.config.tie_word_embeddings is case.tied
        assert all(torch.equal(layer.self_attn.o_proj.bias, torch.zeros(case.hidden, dtype=dtype))
                   for layer in llama.model.layers)
        with torch.no_grad():
            want = qwen2(input_ids=ids).logits
            got = llama.eval()(input_ids=ids).logits
        assert torch.equal(got, want), (dtype, (got.float() - want.float()).abs().max())
