"""A stand-in for every shipped rule (issue 24 items 1 and 7): ``ckptxform demo RULE``
builds its sources and prints the ``apply`` command, which runs as printed and gives an
output that verifies; ``rules show NAME`` prints each rule; the README's catalogue is the
one ``ckptxform.catalogue`` makes of the registry.

The stand-ins of the whole-model rules are built without transformers; where transformers
is installed (the ``reference`` extra) each is loaded by it strictly, so their key names,
shapes and config fields are the family's own.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

from ckptxform.cli.catalogue import readme_table, rule_cards
from ckptxform.sources.dcp_metadata import read_dcp_metadata
from ckptxform.standins.for_rules import STANDINS, TORCH_WRITTEN
from ckptxform.standins.prebuilt import PREBUILT_DIR, write_prebuilt

SHIPPED = sorted(p.stem for p in (REPO / "rules").glob("*.yaml"))


def test_every_shipped_rule_has_a_stand_in() -> None:
    assert sorted(STANDINS) == SHIPPED, "add a RuleStandin to ckptxform/standins/for_rules.py for each new rule"


def commands(stdout: str) -> list[list[str]]:
    return [shlex.split(line[2:])[1:] for line in stdout.splitlines() if line.startswith("$ ckptxform ")]


@pytest.mark.parametrize("stem", SHIPPED)
def test_demo_rule_prints_an_apply_that_runs_as_printed_and_verifies(stem: str, run_cli: Any,
                                                                     tmp_path: Path) -> None:
    demo = run_cli("demo", stem, "--out", tmp_path / "d d", cwd=tmp_path)
    assert demo.returncode == 0, demo.stderr
    lines = demo.stdout.splitlines()
    assert lines[0] == f"built stand-ins of the sources of {stem} under {tmp_path / 'd d' / 'sources'}:"
    apply, verify = commands(demo.stdout)
    assert apply[:2] == ["apply", stem] and apply[-2:] == ["--out", str(tmp_path / "d d" / "converted")]
    ran = run_cli(*apply, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert f"wrote {tmp_path / 'd d' / 'converted'}: " in ran.stdout
    # every source the conversion read is a stand-in, none is the Hub repo the rule names
    run = json.loads((tmp_path / "d d" / "converted" / "ckptxform_audit.jsonl").read_text().splitlines()[0])
    assert run["sources"] and all(s["location"].startswith(str(tmp_path / "d d" / "sources"))
                                  for s in run["sources"].values()), run["sources"]
    checked = run_cli(*verify, cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.startswith(f"{tmp_path / 'd d' / 'converted'}: ") and "tensors verified" in checked.stdout


def test_demo_rule_run_converts_the_stand_ins_and_without_it_says_nothing_was_converted(
        run_cli: Any, tmp_path: Path) -> None:
    shown = run_cli("demo", "untie_embeddings", "--out", tmp_path / "shown")
    assert shown.returncode == 0, shown.stderr
    assert "nothing was converted (add --run to convert them now)" in shown.stdout
    assert not (tmp_path / "shown" / "converted").exists()
    ran = run_cli("demo", "untie_embeddings", "--out", tmp_path / "ran", "--run")
    assert ran.returncode == 0, ran.stderr
    assert f"wrote {tmp_path / 'ran' / 'converted'}: " in ran.stdout and "nothing was converted" not in ran.stdout
    [verify] = commands(ran.stdout)[1:]  # the apply it ran, then the check
    checked = run_cli(*verify)
    assert checked.returncode == 0 and "tensors verified" in checked.stdout, checked.stderr
    assert run_cli("demo", "--run").returncode == 2  # the headline demo always converts


def _files(root: Path) -> dict[str, Path]:
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="compares with what torch writes")
@pytest.mark.parametrize("stem", sorted(TORCH_WRITTEN))
def test_the_shipped_prebuilt_stand_ins_are_what_torch_writes(stem: str, tmp_path: Path) -> None:
    """The light install copies these (no torch to write them): each file is byte for byte
    what torch writes today, but DCP's .metadata, which holds the save's path and a random
    id: what ckptxform reads of it (every tensor, chunk and offset) is the same."""
    write_prebuilt(TORCH_WRITTEN[stem], tmp_path / stem)
    shipped, fresh = _files(PREBUILT_DIR / stem), _files(tmp_path / stem)
    assert sorted(shipped) == sorted(fresh), "regenerate: python -m ckptxform.standins.write_prebuilt"
    for name, path in shipped.items():
        if path.name == ".metadata":
            assert read_dcp_metadata(path.parent).tensors == read_dcp_metadata(fresh[name].parent).tensors, name
        else:
            assert path.read_bytes() == fresh[name].read_bytes(), name


def test_demo_rule_refuses_to_build_over_an_earlier_demo_unless_forced(run_cli: Any, tmp_path: Path) -> None:
    assert run_cli("demo", "untie-embeddings", "--out", tmp_path).returncode == 0
    again = run_cli("demo", "untie_embeddings", "--out", tmp_path)
    assert again.returncode == 1 and again.stdout == ""
    assert again.stderr == (f"error: {str(tmp_path / 'sources')!r} already exists from an earlier demo; pass --force "
                            "to rebuild it or choose another --out\n")
    forced = run_cli("demo", "untie_embeddings", "--out", tmp_path, "--force")
    assert forced.returncode == 0, forced.stderr
    assert commands(forced.stdout)[0][-1] == "--force"


def test_demo_of_an_unknown_rule_is_one_usage_error(run_cli: Any) -> None:
    proc = run_cli("demo", "mixtral")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: demo 'mixtral': no shipped rule of that file stem or name has stand-ins "
                                  "(these do: aqmedai_k2_to_k25, ")


def test_demo_without_a_rule_is_still_the_headline(run_cli: Any, tmp_path: Path) -> None:
    proc = run_cli("demo", "--out", tmp_path / "demo")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"built stand-ins of the three sources under {tmp_path / 'demo' / 'sources'}:")
    assert [c[:2] for c in commands(proc.stdout)] == [["plan", "aqmedai_k2_to_k25"], ["apply", "aqmedai_k2_to_k25"]]


@pytest.mark.parametrize("stem", SHIPPED)
def test_rules_show_prints_the_file_its_sources_and_its_reference(stem: str, run_cli: Any) -> None:
    [card] = [c for c in rule_cards() if c.rule.stem == stem]
    proc = run_cli("rules", "show", card.rule.name)
    assert proc.returncode == 0, proc.stderr
    head, _, text = proc.stdout.partition(f"--- {card.rule.path}\n")
    assert text.rstrip("\n") == card.rule.path.read_text().rstrip("\n")
    for name, location in card.rule.sources.items():
        assert f"{name}={location}" in head
    assert f"  checked against: {card.standin.checked_against}\n" in head
    assert f"  try it:          ckptxform demo {stem}" in head
    assert ("  inverts:         yes" in head) == (card.no_inverse is None)


def test_rules_show_json_and_an_unknown_name(run_cli: Any) -> None:
    shown = json.loads(run_cli("--json", "rules", "show", "phi3_to_llama").stdout)
    assert (shown["name"], shown["inverts"], shown["demo"]) == ("phi3-to-llama", True, "ckptxform demo phi3_to_llama")
    assert shown["text"] == (REPO / "rules" / "phi3_to_llama.yaml").read_text()
    assert json.loads(run_cli("rules", "show", "prune_draft_vocab", "--json").stdout)["inverts"] is False
    bad = run_cli("rules", "show", "phi4")
    assert bad.returncode == 2 and bad.stderr.startswith("error: rules show 'phi4': no shipped rule has that file "
                                                         "stem or name (shipped: aqmedai_k2_to_k25, ")


def test_the_readme_lists_every_shipped_rule_as_the_catalogue_makes_it() -> None:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("\n## The rule library\n"):readme.index("\n## Development\n")]
    assert readme_table() in section, "regenerate it: python -m ckptxform.cli.catalogue"
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == SHIPPED


# --------------------------------------------------------------- against transformers itself

#: stand-in -> the transformers class that must load it strictly
HF_STANDINS = {"hf_llama_to_meta": "LlamaForCausalLM", "untie_embeddings": "LlamaForCausalLM",
               "tie_embeddings": "LlamaForCausalLM", "mixtral_legacy_to_fused": "MixtralForCausalLM",
               "qwen2_moe_legacy_to_fused": "Qwen3MoeForCausalLM", "phi3_to_llama": "Phi3ForCausalLM",
               "qwen2_to_llama": "Qwen2ForCausalLM",
               "gpt2_conv1d_to_linear": "GPT2LMHeadModel", "gemma_to_llama": "GemmaForCausalLM"}


@pytest.mark.reference
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed; the 'reference' extra: "
                           "pip install torch==2.13.0 -e '.[test,reference]'")
@pytest.mark.parametrize("stem", sorted(HF_STANDINS))
def test_whole_model_stand_ins_load_strictly_in_transformers(stem: str, tmp_path: Path) -> None:
    from reference_models import load_strict, tensor_bytes

    [path] = STANDINS[stem].build(tmp_path / "standin").values()
    model = load_strict(HF_STANDINS[stem], Path(path))
    # saved back by transformers (per-expert files for MoE: its original format), the
    # stand-in's every tensor comes out with the same bytes
    model.save_pretrained(tmp_path / "again")
    again = {k.removeprefix("transformer."): v for k, v in tensor_bytes(tmp_path / "again").items()}
    ours = tensor_bytes(Path(path))
    masks = {k for k in ours if k.endswith(".attn.bias")}  # GPT-2's causal-mask buffers, not saved
    assert set(ours) - masks == set(again)
    assert not [k for k in again if again[k] != ours[k]]


@pytest.mark.reference
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed; the 'reference' extra: "
                           "pip install torch==2.13.0 -e '.[test,reference]'")
def test_the_meta_stand_in_is_the_model_its_params_json_defines(tmp_path: Path) -> None:
    """The consolidated stand-in run by a forward written from Meta's definition gives the
    logits transformers computes from its meta_llama_to_hf conversion."""
    import torch
    from reference_models import load_strict, logits, meta_forward, read_tensors

    from ckptxform import api

    [path] = STANDINS["meta_llama_to_hf"].build(tmp_path / "standin").values()
    params = json.loads((Path(path).parent / "params.json").read_text())
    out = api.apply("meta_llama_to_hf", out=tmp_path / "hf", sources={"model": path}, progress=False).out
    torch.testing.assert_close(logits(load_strict("LlamaForCausalLM", out)),
                               meta_forward(read_tensors(Path(path)), params), rtol=1e-4, atol=1e-4)
