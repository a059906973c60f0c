"""Every shipped drafter rule's output passes ``preflight`` for the consumers it is for
(issue 39, item 4): each rule runs on its stand-ins (``standins/for_rules.py``) and the
output is checked against the stand-in verifier when the rule has one.

A new drafter rule is caught by ``test_every_drafter_rule_is_listed``: a rule file that
names a drafter layout must be listed here, with the consumers its output is for.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import REPO

from ckptxform import api
from ckptxform.standins.dims import KIMI_K2_TINY, LLAMA31_8B_TINY
from ckptxform.standins.for_rules import STANDINS
from ckptxform.standins.verifiers import build_kimi_k25_verifier, build_llama_verifier
from ckptxform.vocab.preflight import preflight

#: rule -> the consumers its output is for (None: the layout's defaults)
DRAFTER_RULES: dict[str, str | None] = {
    "eagle3_to_speculators": "speculators,vllm",
    "aqmedai_k2_to_k25": "speculators,vllm",
    "speculators_to_eagle3": "sglang,vllm",  # vLLM loads the native layout too (midlayer. -> layers.0.)
    "aqmedai_k2_to_k25_sglang": "sglang,vllm",  # vLLM loads the native layout too (midlayer. -> layers.0.)
    "prune_draft_vocab": "sglang,vllm",  # vLLM loads the native layout too (midlayer. -> layers.0.)
    "prune_draft_vocab_mla": "sglang",
    "dflash_to_speculators": "speculators,vllm",
    "mtp_extract": "speculators,vllm",
    "dspark_to_speculators": "speculators,vllm,llama.cpp",  # llama.cpp reads DSpark in the speculators layout
    "speculators_to_dspark": "vllm,sglang",  # vLLM reads DeepSpec's target_layer_ids + 1
    # vLLM reads dflash_config.target_layer_ids + 1; transformers: z-lab's dflash package loads through it
    "speculators_to_dflash": "vllm,sglang,transformers",
    # SGLang's standalone NextN layer: a DeepSeek model config, so only the model checks
    # (config against tensors) apply
    "deepseek_nextn_extract": "transformers",
}
#: rules whose stand-ins name no verifier source: the verifier their drafter drafts for, so
#: that the layer ids, widths and vocabulary are checked against one
_VERIFIERS: dict[str, Callable[[Path], Path]] = {
    "eagle3_to_speculators": lambda root: build_llama_verifier(root / "Llama-3.1-8B-Instruct", LLAMA31_8B_TINY).path,
    "speculators_to_eagle3": lambda root: build_llama_verifier(root / "Llama-3.1-8B-Instruct", LLAMA31_8B_TINY).path,
    # both pruned to the Kimi-K2.5 draft vocabulary: the K2.5 verifier
    "prune_draft_vocab": lambda root: build_kimi_k25_verifier(root / "Kimi-K2.5", KIMI_K2_TINY, num_shards=2).path,
    "prune_draft_vocab_mla": lambda root: build_kimi_k25_verifier(root / "Kimi-K2.5", KIMI_K2_TINY,
                                                                  num_shards=2).path,
}
#: rules whose files name a drafter layout but whose output is no drafter
NOT_DRAFTER_OUTPUTS = {"mtp_graft": "writes the verifier with the drafter's MTP layer grafted back"}
_DRAFTER_MARKERS = re.compile(r"speculators_model_type|LlamaForCausalLMEagle3|midlayer|dflash|nextn|Eagle3Speculator")


def test_every_drafter_rule_is_listed() -> None:
    naming = {p.stem for p in (REPO / "rules").glob("*.yaml") if _DRAFTER_MARKERS.search(p.read_text())}
    assert naming - set(NOT_DRAFTER_OUTPUTS) == set(DRAFTER_RULES)


@pytest.mark.parametrize("rule", sorted(DRAFTER_RULES))
def test_drafter_rule_output_passes_preflight(rule: str, tmp_path: Path) -> None:
    sources = STANDINS[rule].build(tmp_path / "sources")
    out = api.apply(rule, out=tmp_path / "out", sources=sources, progress=False).out
    verifier = sources.get("verifier") or (str(_VERIFIERS[rule](tmp_path / "verifier")) if rule in _VERIFIERS
                                            else None)
    report = preflight(str(out), verifier=verifier, consumers=DRAFTER_RULES[rule])
    assert report.exit_code == 0, report.text()
    if verifier is not None:  # every check ran
        assert report.unchecked == (), report.text()
    if rule != "deepseek_nextn_extract":
        assert report.family in ("eagle3", "dflash", "dspark", "mtp"), report.text()
