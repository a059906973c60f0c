"""The headline conversion (Kimi-K2 drafter -> Kimi-K2.5 drafter, speculators layout).

Outputs are compared bit for bit with ``conftest.expected_conversion``, computed from the
stand-in files with torch alone; the property test states the same in terms of logits.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import LM_HEAD, SMALL_DIMS, expected_conversion, read_output, same_bits, verifier_tensor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from ckptxform import api
from ckptxform.standins import (
    DrafterDims,
    HeadlineStandins,
    build_eagle3_drafter,
    build_kimi_k25_verifier,
)


def assert_bit_exact(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert sorted(got) == sorted(want)
    wrong = [k for k in want if not same_bits(got[k], want[k])]
    assert not wrong, f"tensors differing from the expectation: {wrong}"


def test_expectation_is_not_trivial(headline: HeadlineStandins) -> None:
    """Guard: on these stand-ins the permutation moves rows and some come from the verifier,
    so an engine that copied lm_head unchanged (or never used the verifier) would fail."""
    k2, k25 = set(headline.k2_ids), headline.k25_ids
    missing = [t for t in k25 if t not in k2]
    assert 0 < len(missing) < len(k25) // 4
    moved = [j for j, t in enumerate(k25) if t in k2 and headline.k2_ids.index(t) != j]
    assert len(moved) > len(k25) // 2


def test_api_output_is_bit_exact(headline: HeadlineStandins, headline_out: Path) -> None:
    want = expected_conversion(headline.drafter.path, headline.target_vocab.path, headline.verifier.path)
    assert_bit_exact(read_output(headline_out), want)
    assert sorted(p.name for p in headline_out.iterdir()) == [
        "ckptxform_audit.jsonl", "config.json", "model.safetensors"]


def test_cli_output_is_bit_exact_and_identical_to_the_api(
        headline: HeadlineStandins, headline_rule: Path, headline_out: Path, run_cli: Any,
        tmp_path: Path) -> None:
    from conftest import source_args

    out = tmp_path / "cli-out"
    proc = run_cli("apply", headline_rule, *source_args(headline.sources), "--out", out)
    assert proc.returncode == 0, proc.stderr
    want = expected_conversion(headline.drafter.path, headline.target_vocab.path, headline.verifier.path)
    assert_bit_exact(read_output(out), want)
    # Deterministic: the same inputs give the same file, byte for byte.
    assert (out / "model.safetensors").read_bytes() == (headline_out / "model.safetensors").read_bytes()
    assert json.loads((out / "config.json").read_text()) == json.loads((headline_out / "config.json").read_text())
    assert f"audit: {out / 'ckptxform_audit.jsonl'}" in proc.stdout


def test_config_is_the_speculators_layout(headline: HeadlineStandins, headline_out: Path) -> None:
    config = json.loads((headline_out / "config.json").read_text())
    source = json.loads((headline.drafter.path / "config.json").read_text())
    k25 = load_file(str(headline.target_vocab.path / "model.safetensors"))
    assert config["architectures"] == ["Eagle3Speculator"]
    assert config["speculators_model_type"] == "eagle3"
    assert config["draft_vocab_size"] == k25["d2t"].shape[0] == headline.drafter.dims.draft_vocab
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama"
    assert layer["num_hidden_layers"] == 1
    for field in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings"):
        assert layer[field] == source[field], field
    assert layer["vocab_size"] == k25["t2d"].shape[0] == headline.drafter.dims.vocab
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3"
    assert spec["default_proposal_method"] in {m["proposal_type"] for m in spec["proposal_methods"]}
    # the verifier given (a local stand-in), as given: what a consumer loads offline (issue 35 item 4)
    assert spec["verifier"]["name_or_path"] == headline.sources["verifier"]
    # nothing of the native config leaks through (keep: [])
    assert "eagle_config" not in config and "LlamaForCausalLMEagle3" not in json.dumps(config)


# ------------------------------------------------------------------------- property test


def _draw_maps(data: st.DataObject, vocab: int, n: int) -> tuple[list[int], list[int]]:
    """Two sorted draft vocabularies of ``n`` tokens sharing at least 75% of them (the
    headline rule's min_rows_from_source), with arbitrary others."""
    rng = random.Random(data.draw(st.integers(0, 2**32 - 1), label="map seed"))
    k2 = rng.sample(range(vocab), n)
    shared = data.draw(st.integers(-(-3 * n // 4), n), label="shared")
    others = rng.sample(sorted(set(range(vocab)) - set(k2)), n - shared)
    k25 = rng.sample(k2, shared) + others
    return sorted(k2), sorted(k25)


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_logits_of_every_draft_token_carry_over(data: st.DataObject, headline_rule: Path,
                                                tmp_path_factory: pytest.TempPathFactory) -> None:
    """For random hidden states h: converted_lm_head @ h gives, for each K2.5 draft token,
    the K2 drafter's logit of that token when K2 has it, else the verifier's."""
    vocab = data.draw(st.integers(40, 400), label="vocab")
    n = data.draw(st.integers(4, min(48, vocab // 2)), label="draft vocab")
    hidden = data.draw(st.sampled_from([8, 16, 24]), label="hidden")
    dims: DrafterDims = SMALL_DIMS.scaled(hidden=hidden, head_dim=8, vocab=vocab, draft_vocab=n,
                                          verifier_layers=4, bos_token_id=0, eos_token_id=1)
    k2_ids, k25_ids = _draw_maps(data, vocab, n)
    seed = data.draw(st.integers(0, 2**31 - 1), label="weights seed")
    root = tmp_path_factory.mktemp("prop")
    build_eagle3_drafter(root / "k2", dims, k2_ids, seed=seed)
    build_eagle3_drafter(root / "k25", dims, k25_ids, seed=seed + 1)
    build_kimi_k25_verifier(root / "verifier", dims, seed=seed + 2,
                            num_shards=data.draw(st.integers(1, 3), label="verifier shards"))
    api.apply(headline_rule, out=root / "out", progress=False,
              sources={"drafter": str(root / "k2"), "target_vocab": str(root / "k25"),
                       "verifier": str(root / "verifier")})

    converted = read_output(root / "out")["lm_head.weight"]
    source = load_file(str(root / "k2" / "model.safetensors"))["lm_head.weight"]
    verifier = verifier_tensor(root / "verifier", LM_HEAD)
    # bf16 hidden states in float64: every product of two bf16 values is exact, so the
    # logits do not depend on the order a matmul sums in, and equality must be exact.
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(hidden, 3, generator=gen).to(torch.bfloat16).to(torch.float64)
    logits = converted.to(torch.float64) @ h
    source_logits = source.to(torch.float64) @ h
    verifier_logits = verifier.to(torch.float64) @ h
    k2_index = {t: i for i, t in enumerate(k2_ids)}
    assert converted.shape == (n, hidden) and converted.dtype == source.dtype
    for j, t in enumerate(k25_ids):
        if t in k2_index:
            assert torch.equal(logits[j], source_logits[k2_index[t]]), (j, t)
        else:
            assert torch.equal(logits[j], verifier_logits[t]), (j, t)
            assert same_bits(converted[j], verifier[t]), (j, t)
