"""What a new user hits in a first hour (issue 35): rules that refuse what they do not fit,
messages that name the fix, and the other small things of items 2, 3, 6, 7 and 8."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_hostile_inputs import Case, make_source, write_rule


@pytest.fixture
def case(tmp_path: Path, run_cli: Any) -> Case:
    return Case(tmp_path, run_cli)


# ---------------------------------------------------------------- 8: a rename with $1


def test_a_dollar_group_in_a_rename_is_refused_with_the_backslash_fix(case: Case) -> None:
    rule = write_rule(case.root / "r.yaml", "sources: {m: {path: m}}\ntensors:\n"
                      "  - match: 'a\\.(.+)'\n    rename: 'x.$1'\n")
    case.fails("validate", rule, code=2, line=(
        "r.yaml:5:13: tensors[0].rename: '$1' is not a group reference in a rename (it would be written "
        "literally into the key); write '\\1' for group 1, e.g. rename: 'x.\\1'"))


def test_a_braced_dollar_group_is_refused_too(case: Case) -> None:
    rule = write_rule(case.root / "r.yaml", "sources: {m: {path: m}}\ntensors:\n"
                      "  - match: '(a)\\.(.+)'\n    rename: '${2}.${1}'\n")
    proc = case.run_cli("validate", rule)
    assert proc.returncode == 2 and "'${2}' is not a group reference" in proc.stderr
    assert "rename: '\\2.\\1'" in proc.stderr


# ---------------------------------------------------------------- 2 and 8: a rule matching nothing


def test_a_rule_that_matches_only_as_a_prefix_is_an_error_with_the_full_match_fix(case: Case) -> None:
    make_source(case.root / "m", {"model.layers.0.w": torch.ones(2), "b": torch.ones(2)})
    rule = write_rule(case.root / "r.yaml", "sources: {m: {path: m}}\ntensors:\n"
                      "  - match: 'model\\.layers\\.0'\n  - match: 'b'\n")
    case.fails("apply", rule, "--out", "out", code=1, line=(
        "error: r.yaml: 1 tensor rule matches no tensor of source 'm' (m): tensors[0] (r.yaml:4) match "
        "'model\\.layers\\.0' matches 'model.layers.0.w' only as a prefix, and a match must match the whole "
        "key: write match: 'model\\.layers\\.0.*' (and a rename with the group: match: 'model\\.layers\\.0(.*)', "
        "rename: 'NEW\\1'); this rule does not fit this checkpoint (or the pattern is wrong); mark a rule "
        "'optional: true' when the tensor may be absent; no shipped rule plans on it (ckptxform rules --for m)"))


def test_a_rule_that_matches_nothing_fails_unless_optional(case: Case) -> None:
    make_source(case.root / "m", {"w": torch.ones(2)})
    rule = write_rule(case.root / "r.yaml", "sources: {m: {path: m}}\ntensors:\n  - match: 'x'\n  - match: 'w'\n")
    proc = case.run_cli("apply", "r.yaml", "--out", "out", cwd=case.root)
    assert proc.returncode == 1 and "tensors[0] (r.yaml:4) match 'x';" in proc.stderr, proc.stderr
    assert not (case.root / "out").exists()
    write_rule(rule, "sources: {m: {path: m}}\ntensors:\n  - {match: 'x', optional: true}\n  - match: 'w'\n")
    proc = case.run_cli("apply", rule, "--out", "out", cwd=case.root)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


# ---------------------------------------------------------------- 8: require.loaded of a typo


def test_require_loaded_of_a_key_no_rule_writes_suggests_the_close_key(case: Case) -> None:
    make_source(case.root / "m", {"lm_head.weight": torch.ones(2, 2)})
    rule = write_rule(case.root / "r.yaml", "sources: {m: {path: m}}\ntensors:\n  - match: 'lm_head\\.weight'\n"
                      "require:\n  loaded: ['lm_haed\\.weight']\n")
    proc = case.run_cli("apply", rule, "--out", "out", cwd=case.root)
    assert proc.returncode == 1, proc.stderr
    assert "did you mean 'lm_head.weight', which is loaded?" in proc.stderr, proc.stderr


# ---------------------------------------------------------------- 2: config flags against the tensors


@pytest.mark.parametrize(("flag", "keys", "line"), [
    ("attention_bias: false", ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias"],
     "attention_bias is false but output 'model.layers.0.self_attn.q_proj.bias' is written: transformers would "
     "drop it as unexpected"),
    ("mlp_bias: true", ["model.layers.0.mlp.up_proj.weight"],
     "mlp_bias is true but no such bias is written: transformers would initialise them at random"),
])
def test_a_bias_flag_the_tensors_contradict_is_refused(case: Case, flag: str, keys: list[str], line: str) -> None:
    make_source(case.root / "m", {key: torch.ones(4, 4) if key.endswith("weight") else torch.ones(4) for key in keys})
    write_rule(case.root / "r.yaml", "sources: {m: {path: m}}\ntensors:\n  - match: '.+'\n"
               f"config:\n  from: m\n  set: {{{flag}}}\n")
    case.fails("apply", "r.yaml", "--out", "out", code=1, line=(
        f"error: config (r.yaml:6): {line}; the written config must describe the tensors written: fix the rule's "
        "config section, or convert the whole checkpoint (one model-parallel shard has a fraction of the model's "
        "dimensions)"))


def test_phi3_to_llama_refuses_a_qwen2_checkpoint(case: Case) -> None:
    from ckptxform.standins.hf_models import build_llama

    model = build_llama(case.root / "qwen2")
    config = (model / "config.json").read_text().replace('"llama"', '"qwen2"')
    (model / "config.json").write_text(config)
    proc = case.run_cli("apply", "phi3_to_llama", "--source", "model=qwen2", "--out", "out", cwd=case.root)
    assert proc.returncode == 1, proc.stderr
    assert "2 tensor rules match no tensor of source 'model'" in proc.stderr
    assert not (case.root / "out").exists()


# ---------------------------------------------------------------- 3: which rule fits


def test_rules_for_a_torchtitan_0_2_save_points_to_the_0_2_rule(tmp_path: Path, run_cli: Any) -> None:
    import json

    from ckptxform.standins.for_rules import STANDINS

    sources = STANDINS["torchtitan_0_2_llama_to_hf"].build(tmp_path / "s")
    proc = run_cli("rules", "--for", sources["model"], "--json")
    assert proc.returncode == 0, proc.stderr
    fits = json.loads(proc.stdout)
    assert all(set(f) == {"name", "plans", "reason"} for f in fits)
    assert [f["name"] for f in fits if f["plans"]] == ["torchtitan_0_2_llama_to_hf"]
    newer = next(f for f in fits if f["name"] == "torchtitan_llama_to_hf")
    assert newer["reason"] == "6 tensors match no rule, e.g. 'layers.0.attention.wq.weight'"
    text = run_cli("rules", "--for", sources["model"]).stdout.splitlines()
    assert text[:2] == [f"rules that plan on {sources['model']}:",
                        "  torchtitan_0_2_llama_to_hf  (every tensor matches its rules (not opened: hf_assets))"]


def test_a_rule_that_does_not_fit_names_the_rules_that_would(tmp_path: Path, run_cli: Any) -> None:
    from ckptxform.standins.hf_models import build_llama

    model = build_llama(tmp_path / "llama")
    proc = run_cli("plan", "phi3_to_llama", "--source", f"model={model}")
    assert proc.returncode == 1
    assert proc.stderr.rstrip().endswith(
        "; shipped rules that plan on it: bf16_to_fp8_block, bf16_to_fp8_dynamic, bf16_to_nvfp4, "
        f"fp8_block_to_bf16, hf_llama_to_meta, peft_lora_merge, "
        f"tie_embeddings (ckptxform rules --for {model})"), proc.stderr


@pytest.mark.parametrize(("rule", "reason"), [
    ("awq_to_bf16", "this rule reads AutoAWQ's qweight, qzeros and scales; the source's quantization_config names "
                    "another method (or none): rules --for SOURCE lists the rules that fit"),
    ("fp8_block_to_w4a16", "this rule re-quantizes an FP8 block-scaled checkpoint (DeepSeek layout); for a bf16 "
                           "source: rules/bf16_to_w4a16.yaml"),
])
def test_a_quantized_source_rule_on_a_bf16_model_is_refused_by_its_quant_method(
        rule: str, reason: str, tmp_path: Path, run_cli: Any) -> None:
    from ckptxform.standins.hf_models import build_llama

    model = build_llama(tmp_path / "llama")
    proc = run_cli("plan", rule, "--source", f"model={model}")
    assert proc.returncode == 1
    assert proc.stderr.rstrip().endswith(
        f"has no field 'quantization_config.quant_method'; add it to that file, or point the source at the "
        f"checkpoint it belongs to; {reason}"), proc.stderr
