"""rules/gemma_to_llama.yaml against its references (issue 25 items 1 and 7).

Tiny random GemmaForCausalLM models built by transformers (hidden sizes 30 and 44, 3 and
4 heads over 1 and 2 kv heads, a head_dim that is not hidden // heads, float32 and
bfloat16, two seeds), saved with ``save_pretrained`` (tied: no lm_head.weight), then:

- every RMSNorm weight is llama.cpp's ``data_torch + 1`` (convert_hf_to_gguf.py,
  GemmaModel.modify_tensors, for names ending in ``norm.weight``) bit for bit;
- every row of the embedding is what transformers' GemmaTextScaledWordEmbedding returns
  for that token (the normalizer ``sqrt(hidden_size)`` rounded to the embedding's dtype,
  then the product): bit for bit;
- lm_head.weight is the unscaled embedding (Gemma's tied head);
- LlamaForCausalLM loads the output with no missing or unexpected key, and computes
  Gemma's logits: bit for bit in float32 (the same float32 products in the same order);
  in bfloat16 within the roundings the Llama layout makes (Llama rounds the normalised
  activations to bfloat16 before multiplying by the norm weight, Gemma after, and w + 1
  is itself rounded to bfloat16): the bound is measured below.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, tensor_bytes

from ckptxform import api

pytestmark = [
    pytest.mark.reference,
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                       reason="transformers is not installed; to run the reference tests: "
                              "pip install torch==2.13.0 -e '.[test,reference]'"),
]

TOKENS = ((3, 17, 5, 29, 11, 2, 40, 0), (1, 8, 33, 8, 21, 47, 0, 52))


@dataclass(frozen=True)
class Case:
    id: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype: torch.dtype
    seed: int


CASES = (Case("f32-30-3-heads-1-kv", 30, 3, 1, 10, 44, 61, torch.float32, 1),
         Case("bf16-44-4-heads-2-kv", 44, 4, 2, 12, 36, 67, torch.bfloat16, 2))


@dataclass(frozen=True)
class Converted:
    case: Case
    gemma: Any
    source: Path
    out: Path


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.id)
def converted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Converted:
    import transformers
    from reference_models import randomize

    case: Case = request.param
    root = tmp_path_factory.mktemp(case.id)
    config = transformers.GemmaConfig(vocab_size=case.vocab, hidden_size=case.hidden, num_hidden_layers=2,
                                      num_attention_heads=case.heads, num_key_value_heads=case.kv_heads,
                                      head_dim=case.head_dim, intermediate_size=case.intermediate,
                                      bos_token_id=2, eos_token_id=1, pad_token_id=0)
    gemma = randomize(transformers.GemmaForCausalLM(config), case.seed).to(case.dtype)
    with torch.no_grad():  # Gemma's norm weights are zero-centred: w of x * (1 + w)
        for name, param in gemma.named_parameters():
            if name.endswith("norm.weight"):
                param.sub_(1)
    gemma.save_pretrained(root / "gemma")
    out = api.apply(REPO / "rules" / "gemma_to_llama.yaml", out=root / "llama", sources={"model": str(root / "gemma")},
                    progress=False).out
    return Converted(case, gemma, root / "gemma", out)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def test_norm_weights_are_llama_cpps_plus_one(converted: Converted) -> None:
    source, ours = _tensors(converted.source), _tensors(converted.out)
    norms = [k for k in source if k.endswith("norm.weight")]
    assert len(norms) == 2 * 2 + 1
    for key in norms:
        data_torch = source[key]
        data_torch = data_torch + 1  # llama.cpp convert_hf_to_gguf.py, GemmaModel.modify_tensors
        assert ours[key].dtype == data_torch.dtype and tensor_bytes(ours[key]) == tensor_bytes(data_torch), key


def test_embedding_rows_are_what_transformers_scaled_embedding_returns(converted: Converted) -> None:
    gemma = converted.gemma
    with torch.no_grad():
        scaled = gemma.model.embed_tokens(torch.arange(converted.case.vocab))
    ours = _tensors(converted.out)["model.embed_tokens.weight"]
    assert ours.dtype == scaled.dtype and tensor_bytes(ours) == tensor_bytes(scaled)
    # the normalizer is rounded to the embedding's dtype first: in bfloat16 that changes values
    unrounded = (gemma.model.embed_tokens.weight.float() * converted.case.hidden ** 0.5).to(scaled.dtype)
    assert (tensor_bytes(ours) != tensor_bytes(unrounded)) == (converted.case.dtype == torch.bfloat16)


def test_head_is_the_unscaled_tied_embedding_and_the_rest_is_kept(converted: Converted) -> None:
    source, ours = _tensors(converted.source), _tensors(converted.out)
    assert "lm_head.weight" not in source
    assert tensor_bytes(ours["lm_head.weight"]) == tensor_bytes(source["model.embed_tokens.weight"])
    kept = [k for k in source if not k.endswith("norm.weight") and k != "model.embed_tokens.weight"]
    assert sorted(ours) == sorted([*source, "lm_head.weight"])
    assert [k for k in kept if tensor_bytes(ours[k]) != tensor_bytes(source[k])] == []


def test_llama_loads_it_strictly_and_computes_gemmas_logits(converted: Converted) -> None:
    from reference_models import load_strict

    llama = load_strict("LlamaForCausalLM", converted.out)
    config = json.loads((converted.out / "config.json").read_text())
    assert (config["model_type"], config["tie_word_embeddings"], config["hidden_act"]) == (
        "llama", False, "gelu_pytorch_tanh")
    tokens = torch.tensor(TOKENS)
    with torch.no_grad():
        want = converted.gemma(tokens).logits
        got = llama(tokens).logits
    assert got.dtype == want.dtype == converted.case.dtype
    if converted.case.dtype == torch.float32:
        assert torch.equal(got, want)
    else:
        # measured on three such models: at most 0.031 apart, one bfloat16 step of logits
        # of magnitude 4-8; the bound is 3% of the largest logit
        scale = want.float().abs().max()
        assert (got.float() - want.float()).abs().max() <= 0.03 * max(1.0, float(scale))
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_gemma_2_is_refused_naming_what_it_computes(tmp_path: Path) -> None:
    from ckptxform.errors import RequirementError
    from ckptxform.standins.hf_models import build_gemma

    source = build_gemma(tmp_path / "gemma2")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "model_type": "gemma2"}))
    with pytest.raises(RequirementError) as err:
        api.apply(REPO / "rules" / "gemma_to_llama.yaml", out=tmp_path / "out", sources={"model": str(source)},
                  progress=False)
    assert "model_type" in str(err.value) and 'is "gemma2", not "gemma"' in str(err.value)
    assert "Gemma 2 and 3 compute what no Llama config can express" in str(err.value)
    assert not (tmp_path / "out").exists()
