"""The EAGLE-3 rule library against what the real repositories hold (issue 16, item 7):
speculators' d2t.npy/t2d.npy vocabulary files, drafters shipped without t2d, the norm
flags whose defaults differ between SpecForge and speculators/vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, read_output
from reference_models import OWN_REFERENCE_RULES, STRUCTURAL_RULES
from safetensors.torch import load_file

from ckptxform import api, load_rules
from ckptxform.errors import CheckpointFormatError, RuleError
from ckptxform.standins import (
    KIMI_K2_TINY,
    LLAMA31_8B_TINY,
    HeadlineStandins,
    build_eagle3_drafter,
    build_llama_eagle3,
    make_draft_vocab,
)

RULES = REPO / "rules"
FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def _npy_mapping(folder: Path, drafter: Path) -> Path:
    """The K2.5 stand-in's d2t/t2d saved as speculators saves them."""
    folder.mkdir()
    tensors = load_file(str(drafter / "model.safetensors"))
    np.save(folder / "d2t.npy", tensors["d2t"].numpy())
    np.save(folder / "t2d.npy", tensors["t2d"].numpy())
    return folder


@pytest.mark.parametrize("form", ["folder", "d2t.npy"])
def test_a_speculators_npy_mapping_is_a_vocab_file(form: str, headline: HeadlineStandins, headline_out: Path,
                                                   tmp_path: Path) -> None:
    mapping = _npy_mapping(tmp_path / "vocab_mapping", headline.target_vocab.path)
    file = mapping if form == "folder" else mapping / "d2t.npy"
    child = tmp_path / "k25_from_npy.yaml"
    child.write_text(f"version: 1\nextends: aqmedai_k2_to_k25\nvocab:\n  k25: {{file: '{file}', encoding: offset}}\n")
    # the K2.5 drafter is no longer read, so it is not needed
    sources = {k: v for k, v in headline.sources.items() if k != "target_vocab"}
    result = api.apply(child, out=tmp_path / "out", sources=sources)
    assert (result.out / "model.safetensors").read_bytes() == (headline_out / "model.safetensors").read_bytes()


def test_a_t2d_npy_that_disagrees_with_d2t_is_refused(headline: HeadlineStandins, tmp_path: Path) -> None:
    from ckptxform.errors import VocabMapError
    from ckptxform.sources.vocab_files import load_vocab_file

    mapping = _npy_mapping(tmp_path / "m", headline.target_vocab.path)
    t2d = np.load(mapping / "t2d.npy")
    np.save(mapping / "t2d.npy", np.roll(t2d, 1))
    with pytest.raises(VocabMapError, match="t2d disagrees with d2t"):
        load_vocab_file(mapping, name="k25", encoding="offset")


def test_a_pickled_npy_is_refused_and_never_unpickled(tmp_path: Path) -> None:
    from ckptxform.sources.vocab_files import load_vocab_file

    path = tmp_path / "d2t.npy"
    np.save(path, np.array([{"d2t": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(CheckpointFormatError) as err:
        load_vocab_file(path, name="k", encoding="offset")
    assert str(err.value) == (f"vocab file '{path}' is not a plain numpy array (Object arrays cannot be loaded "
                              "when allow_pickle=False); fix: save d2t with numpy.save('d2t.npy', d2t.numpy())")


def test_eagle3_to_speculators_derives_t2d_for_a_drafter_without_one(tmp_path: Path) -> None:
    """vLLM and SGLang never read t2d, and real drafters ship without it; speculators
    needs it: it is built from d2t (target = i + d2t[i]) and the config's vocab_size."""
    dims = LLAMA31_8B_TINY
    ids = make_draft_vocab(dims.vocab, dims.draft_vocab, seed=8)
    whole = build_eagle3_drafter(tmp_path / "whole", dims, ids, seed=8)
    without = build_eagle3_drafter(tmp_path / "no-t2d", dims, ids, seed=8, omit_keys=["t2d"])
    outs = {}
    for name, drafter in (("whole", whole), ("no-t2d", without)):
        outs[name] = api.apply(RULES / "eagle3_to_speculators.yaml", out=tmp_path / f"out-{name}",
                               sources={"drafter": str(drafter.path)}).out
    d2t = load_file(str(without.path / "model.safetensors"))["d2t"]
    expected = torch.zeros(dims.vocab, dtype=torch.bool)
    expected[torch.arange(len(d2t)) + d2t] = True
    derived = read_output(outs["no-t2d"])["t2d"]
    assert derived.dtype == torch.bool and torch.equal(derived, expected)
    # with a t2d in the drafter, every output tensor is the same, byte for byte (the files'
    # layouts differ: a tensor copied unchanged leads its shard, lined up for cloning)
    whole_out, derived_out = read_output(outs["whole"]), read_output(outs["no-t2d"])
    assert sorted(whole_out) == sorted(derived_out)
    for key, tensor in whole_out.items():
        assert tensor.dtype == derived_out[key].dtype and tensor.shape == derived_out[key].shape, key
        assert tensor.view(-1).view(torch.uint8).tolist() == derived_out[key].view(-1).view(torch.uint8).tolist(), key
    assert torch.equal(load_file(str(whole.path / "model.safetensors"))["t2d"], derived)


def test_t2d_optional_needs_a_vocab_size(tmp_path: Path) -> None:
    rule = tmp_path / "r.yaml"
    rule.write_text("version: 1\nsources: {d: {path: d}}\nvocab:\n  v: {source: d, encoding: offset, t2d_optional: true}\n")
    with pytest.raises(RuleError) as err:
        load_rules(rule)
    assert len(err.value.problems) == 1 and err.value.problems[0].startswith(f"{rule}:4:6: vocab.v:")
    assert "vocab_size" in err.value.problems[0]


def _configs(tmp_path: Path, headline: HeadlineStandins) -> dict[str, dict[str, object]]:
    from test_rule_library import NOT_EAGLE3_RULES, STANDINS, VERIFIER_RULES

    out = {}
    for name, build in STANDINS.items():
        if name in VERIFIER_RULES or name in NOT_EAGLE3_RULES:
            continue
        scenario = build(tmp_path / name / "sources")
        result = api.apply(RULES / name, out=tmp_path / name / "out", sources=scenario.sources)
        out[name] = json.loads((result.out / "config.json").read_text())
    return out


def test_every_rule_that_writes_a_drafter_config_writes_the_norm_flags(tmp_path: Path,
                                                                       headline: HeadlineStandins) -> None:
    """vLLM reads a missing norm_before_residual in a speculators config as true, speculators
    as false: no output leaves a flag to the reader. A source that states none is a classic
    EAGLE-3 drafter for every trainer, so every flag is written false; in particular
    norm_output, whose true is EAGLE-3.1's post-norm feedback to speculators
    (models/eagle3/config.py L76-82, core.py L302), vLLM and SGLang (an earlier version of
    these rules wrote true, turning classic drafters into EAGLE-3.1 ones)."""
    configs = _configs(tmp_path, headline)
    from test_rule_library import NOT_EAGLE3_RULES, TRAINER_RULES, VERIFIER_RULES

    drafter_rules = ({p.name for p in RULES.glob("*.yaml")} - set(STRUCTURAL_RULES) - set(VERIFIER_RULES)
                     - set(OWN_REFERENCE_RULES) - set(NOT_EAGLE3_RULES) - set(TRAINER_RULES))
    assert sorted(configs) == sorted(drafter_rules)
    for name, config in configs.items():
        flags = {flag: config.get(flag) for flag in FLAGS}
        assert flags == dict.fromkeys(FLAGS, False), name


def test_native_outputs_name_the_verifier_layers_where_each_engine_reads_them(tmp_path: Path,
                                                                              headline: HeadlineStandins) -> None:
    """SGLang and SpecForge read eagle_config.eagle_aux_hidden_state_layer_ids, vLLM the
    top-level field first (gpu_model_runner._get_eagle3_aux_layers_from_config): a native
    output names the same list in both places; a speculators output at the top level only."""
    for name, config in _configs(tmp_path, headline).items():
        top = config["eagle_aux_hidden_state_layer_ids"]
        assert top and all(isinstance(i, int) for i in top), name
        if config.get("speculators_model_type") is None:
            assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == top, name
        else:
            assert "eagle_config" not in config, name


def test_a_flag_the_source_states_is_carried(tmp_path: Path) -> None:
    drafter = build_llama_eagle3(tmp_path / "d", seed=9)
    config = json.loads((drafter.path / "config.json").read_text())
    (drafter.path / "config.json").write_text(json.dumps({**config, "norm_output": True,
                                                          "norm_before_residual": True}))
    out = api.apply(RULES / "eagle3_to_speculators.yaml", out=tmp_path / "out",
                    sources={"drafter": str(drafter.path)}).out
    written = json.loads((out / "config.json").read_text())
    assert (written["norm_output"], written["norm_before_residual"], written["fc_norm"]) == (True, True, False)


def test_a_config_default_must_be_json_or_an_expression(tmp_path: Path) -> None:
    rule = tmp_path / "r.yaml"
    rule.write_text("version: 1\nsources: {d: {path: d}}\nconfig:\n  from: d\n  set:\n"
                    "    flag: ${config.flag ?? yes please}\n")
    with pytest.raises(RuleError) as err:
        load_rules(rule)
    [problem] = err.value.problems
    assert problem.startswith(
        f"{rule}:6:11: config.set.flag: '${{config.flag ?? yes please}}': the default after ' ?? ' must be a "
        "JSON value (true, false, a number, \"text\", null) or an expression: unknown reference 'yes'; use ")


def test_the_kimi_k2_drafter_stand_in_says_kimi_k2(tmp_path: Path) -> None:
    built = build_eagle3_drafter(tmp_path, KIMI_K2_TINY, make_draft_vocab(KIMI_K2_TINY.vocab,
                                                                           KIMI_K2_TINY.draft_vocab, seed=1))
    assert json.loads((built.path / "config.json").read_text())["model_type"] == "kimi_k2"


def test_an_mla_drafter_is_pruned_by_target_id_with_its_attention_unchanged(tmp_path: Path) -> None:
    """The MLA layout's keys as SpecForge's and vLLM's deepseek_eagle3 loaders name them."""
    from ckptxform.standins.mla import KIMI_K25_MLA_TINY, build_mla_drafter

    dims = KIMI_K25_MLA_TINY
    drafter = build_mla_drafter(tmp_path / "mla", dims, seed=12)
    ids = make_draft_vocab(dims.base.vocab, dims.base.draft_vocab, seed=13)
    vocab = build_eagle3_drafter(tmp_path / "vocab", dims.base, ids, seed=13)
    out = api.apply("prune_draft_vocab_mla", out=tmp_path / "out",
                    sources={"drafter": str(drafter.path), "vocab": str(vocab.path)}).out
    source = load_file(str(drafter.path / "model.safetensors"))
    written = read_output(out)
    assert set(written) == set(source) | {"d2t", "t2d"}
    assert {k for k in source if ".self_attn." in k} == {
        f"midlayer.self_attn.{name}.weight" for name in
        ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")}
    for key in source:
        if key != "lm_head.weight":
            assert torch.equal(written[key], source[key]), key
    assert torch.equal(written["lm_head.weight"], source["lm_head.weight"][list(ids)])  # row j: token ids[j]
    assert torch.equal(written["d2t"] + torch.arange(len(ids)), torch.tensor(ids))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["model_type"] == "deepseek_v3"
    assert (config["kv_lora_rank"], config["draft_vocab_size"], config["vocab_size"]) == \
        (dims.kv_lora_rank, dims.base.draft_vocab, dims.base.vocab)
