"""rules/llava_to_text.yaml (issue 34): a Llava checkpoint's language model as a text-only
model whose config is the source's ``text_config`` (``config.root``).

Reference: tiny random LlavaForConditionalGeneration models built and saved by transformers
(hidden 30 and 44, GQA, a head_dim that is not hidden // heads, float32 and bfloat16), then
LlamaForCausalLM loads the output strictly (no missing or unexpected key) and computes the
logits of the VLM's text path (input ids without pixel values) bit for bit. Without the
reference extra: the refusals (a text_config of another family, a checkpoint that is not a
VLM) and the config moved from text_config.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, assert_clean_failure

from ckptxform import api
from ckptxform.standins.hf_models import build_llama
from ckptxform.standins.vlm import build_llava

RULE = REPO / "rules" / "llava_to_text.yaml"
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers is not installed; to run the reference tests: "
                                               "pip install torch==2.13.0 -e '.[test,reference]'")


def test_the_config_is_the_text_config_with_the_architecture(tmp_path: Path) -> None:
    source = build_llava(tmp_path / "llava", head_dim=12)
    result = api.apply(RULE, out=tmp_path / "out", sources={"model": str(source)}, progress=False)
    written = json.loads((result.out / "config.json").read_text())
    text = json.loads((source / "config.json").read_text())["text_config"]
    assert written == {**text, "architectures": ["LlamaForCausalLM"]}
    audit = [json.loads(line) for line in (result.out / "ckptxform_audit.jsonl").read_text().splitlines()]
    skipped = {r["key"] for r in audit if r.get("event") == "tensor" and r["action"] == "skipped"}
    assert skipped and all(k.startswith(("vision_tower.", "multi_modal_projector.")) for k in skipped)


def test_a_text_config_of_another_family_is_refused(tmp_path: Path, run_cli: Any) -> None:
    source = build_llava(tmp_path / "llava-mistral")
    config = json.loads((source / "config.json").read_text())
    config["text_config"]["model_type"] = "mistral"
    (source / "config.json").write_text(json.dumps(config))
    proc = run_cli("apply", RULE, "--source", f"model={source}", "--out", tmp_path / "out")
    err = assert_clean_failure(proc)
    assert err.endswith('"mistral", not "llama"; this rule writes a LlamaForCausalLM; a text_config of another family '
                   'needs its own architecture\n')
    assert not (tmp_path / "out").exists()


def test_a_config_without_text_config_is_refused_naming_config_root(tmp_path: Path, run_cli: Any) -> None:
    source = build_llava(tmp_path / "llava")
    config = json.loads((source / "config.json").read_text())
    del config["text_config"]
    (source / "config.json").write_text(json.dumps(config))
    err = assert_clean_failure(run_cli("plan", RULE, "--source", f"model={source}"))
    line = next(n for n, text in enumerate(RULE.read_text().splitlines(), 1) if text.strip().startswith("root:"))
    assert err == (f"error: config.root ({RULE}:{line}): 'text_config' of config.json of source 'model' is absent; "
                   "its mappings there: 'vision_config'\n")


def test_a_text_only_checkpoint_is_refused(tmp_path: Path, run_cli: Any) -> None:
    err = assert_clean_failure(run_cli("plan", RULE, "--source", f"model={build_llama(tmp_path / 'llama')}"))
    assert "2 tensor rules match no tensor of source 'model'" in err  # the language_model and vision ones


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
    seed: int


CASES = (Case("f32-30-3-heads-1-kv", 30, 3, 1, 14, 44, 61, "float32", 1),
         Case("bf16-44-4-heads-2-kv", 44, 4, 2, 12, 36, 67, "bfloat16", 2))
TOKENS = ((3, 17, 5, 29, 11, 2, 40, 0), (1, 8, 33, 8, 21, 47, 0, 52))


@pytest.mark.reference
@needs_transformers
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_the_text_model_computes_the_vlm_text_logits(case: Case, tmp_path: Path) -> None:
    import torch
    import transformers
    from reference_models import randomize

    text = transformers.LlamaConfig(vocab_size=case.vocab, hidden_size=case.hidden, num_hidden_layers=2,
                                    num_attention_heads=case.heads, num_key_value_heads=case.kv_heads,
                                    head_dim=case.head_dim, intermediate_size=case.intermediate)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=40, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=28, patch_size=14, projection_dim=16)
    config = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_index=case.vocab - 1)
    torch_dtype = getattr(torch, case.dtype)
    vlm = randomize(transformers.LlavaForConditionalGeneration(config), case.seed).to(torch_dtype).eval()
    vlm.save_pretrained(tmp_path / "llava")
    # both loaded from disk, so both pick the same attention implementation
    vlm = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path / "llava", dtype=torch_dtype).eval()

    result = api.apply(RULE, out=tmp_path / "out", sources={"model": str(tmp_path / "llava")}, progress=False)
    llama, info = transformers.LlamaForCausalLM.from_pretrained(result.out, dtype=torch_dtype,
                                                                output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched key
    ids = torch.tensor(TOKENS)
    with torch.no_grad():
        want = vlm(input_ids=ids).logits
        got = llama.eval()(input_ids=ids).logits
    assert torch.equal(got, want)
