"""``ckptxform invert``: the derived inverse undoes the rules byte for byte, and what has no
inverse is refused by rule and op."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from conftest import assert_clean_failure, read_output
from test_structural_engine import MIXTRAL_RULE, assert_same, mixtral_legacy, rand, write_model

from ckptxform import api
from ckptxform.errors import RuleError
from ckptxform.rules.invert import inverse_yaml
from ckptxform.rules.loader import load_rules

# the catch-all last: before them it would take these tensors (first match wins)
FORWARD = MIXTRAL_RULE.replace("- concat: {over: P, dim: 1}", "- concat: {over: P, dim: 1, sizes: "
                               "['${config.intermediate_size}', '${config.intermediate_size}']}").replace(
    "  - match: '.+'\n", "") + """\
  - key: 'model.layers.{L}.self_attn.qkv_proj.weight'
    to: 'model.layers.{L}.self_attn.{P:q,k,v}_proj.weight'
    ops:
      - split: {into: P, dim: 0, sizes: ['${config.num_attention_heads * config.head_dim}',
                                         '${config.num_key_value_heads * config.head_dim}',
                                         '${config.num_key_value_heads * config.head_dim}']}
  - key: 'model.layers.{L}.attention.wk.weight'
    to: 'model.layers.{L}.self_attn.k_rot.weight'
    ops: [{rope_permute: {heads: '${config.num_key_value_heads}'}}, {transpose: [0, 1]}]
  - key: model.embed_tokens.weight
    to: [model.embed_tokens.weight, lm_head.weight]
  - match: 'extra\\.(.+)\\.w'
    rename: 'moved.\\1.weight'
  - match: '.+'
"""
CONFIG = {"num_local_experts": 3, "intermediate_size": 6, "num_attention_heads": 5, "num_key_value_heads": 1,
          "head_dim": 4}


def write_rules(path: Path, body: str) -> Path:
    path.write_text("version: 1\nsources:\n  model: {path: src}\nconvert: model\n" + textwrap.dedent(body))
    return path


def test_round_trip_through_the_inverse_is_byte_identical(tmp_path: Path) -> None:
    src = mixtral_legacy(3)
    src["model.layers.0.self_attn.qkv_proj.weight"] = rand(28, 5, seed=21)
    src["model.layers.0.attention.wk.weight"] = rand(4, 5, seed=22)
    src["extra.a.b.w"] = rand(2, seed=23)
    write_model(tmp_path / "src", src, CONFIG)
    forward = write_rules(tmp_path / "forward.yaml", FORWARD)
    api.apply(forward, out=tmp_path / "fused", sources={"model": str(tmp_path / "src")}, progress=False)
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "src" / "config.json").read_text())
    inverse = tmp_path / "inverse.yaml"
    inverse.write_text(inverse_yaml(load_rules(forward), str(inverse)))
    api.apply(inverse, out=tmp_path / "back", sources={"model": str(tmp_path / "fused")}, progress=False)
    assert_same(read_output(tmp_path / "back"), src)


SIZED = MIXTRAL_RULE.replace("- concat: {over: P, dim: 1}", "- concat: {over: P, dim: 1, sizes: equal}")
FORWARD_CONFIG = """\
config:
  from: model
  set: {model_type: fused, head_dim: '${config.head_dim * 2}'}
inverse:
  config:
    from: model
    delete: [model_type]
    set: {head_dim: '${config.head_dim // 2}'}
"""


def test_inverse_config_is_the_inverse_config_section(tmp_path: Path) -> None:
    """The inverse writes ``inverse.config`` as its config, so the round trip gives back the
    source's config.json too; its own ``inverse`` is the forward's config, so inverting the
    inverse gives the forward's config sections back."""
    src = mixtral_legacy(3, layers=1)
    write_model(tmp_path / "src", src, CONFIG)
    forward = write_rules(tmp_path / "forward.yaml", SIZED + FORWARD_CONFIG)
    api.apply(forward, out=tmp_path / "fused", sources={"model": str(tmp_path / "src")}, progress=False)
    assert json.loads((tmp_path / "fused" / "config.json").read_text()) == {
        **CONFIG, "model_type": "fused", "head_dim": 8}
    inverse = _saved(tmp_path, forward)
    text = inverse.read_text()
    assert "by hand" not in text
    api.apply(inverse, out=tmp_path / "back", sources={"model": str(tmp_path / "fused")}, progress=False)
    assert_same(read_output(tmp_path / "back"), src)
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == CONFIG

    twice = tmp_path / "twice.yaml"
    twice.write_text(inverse_yaml(load_rules(inverse), str(twice)))
    sections = [yaml.safe_load(path.read_text()) for path in (forward, twice)]
    assert sections[1]["config"] == sections[0]["config"] and sections[1]["inverse"] == sections[0]["inverse"]


def test_without_inverse_config_a_built_config_is_left_to_write(tmp_path: Path) -> None:
    body = SIZED + FORWARD_CONFIG.split("inverse:")[0]
    text = inverse_yaml(load_rules(write_rules(tmp_path / "forward.yaml", body)))
    assert "# config: the forward rules build the output config; write the inverse's config section by hand " \
        "(or give the forward rules an inverse.config)" in text
    assert "\nconfig:" not in text


def test_inverse_text_turns_each_rule_around(tmp_path: Path) -> None:
    forward = write_rules(tmp_path / "forward.yaml", FORWARD)
    inverse = load_rules(_saved(tmp_path, forward))
    gate_up = next(r for r in inverse.tensors if r.match == "model.layers.{L}.mlp.experts.gate_up_proj")
    assert [t.text for t in gate_up.to] == ["model.layers.{L}.block_sparse_moe.experts.{E}.{P:w1,w3}.weight"]
    assert [s.verb for s in gate_up.ops] == ["split", "unstack"]
    assert [(r.template.text if r.template else r.match, r.tie) for r in inverse.tensors if r.tie] == [
        ("lm_head.weight", "model.embed_tokens.weight")]
    rename = next(r for r in inverse.tensors if r.rename)
    assert (rename.match, rename.rename) == (r"moved\.(.+)\.weight", r"extra.\1.w")


def _saved(tmp_path: Path, forward: Path) -> Path:
    out = tmp_path / "inverse.yaml"
    out.write_text(inverse_yaml(load_rules(forward), str(out)))
    return out


def test_what_has_no_inverse_is_refused_by_rule_and_op(tmp_path: Path) -> None:
    rules = write_rules(tmp_path / "r.yaml", """\
        tensors:
          - key: 'a.{P:x,y}'
            to: b
            ops: [{concat: {over: P, dim: 0}}]
          - key: 'c.{L}'
            ops: [{resize_rows: {rows: 3}}]
          - match: 'd'
            cast: bfloat16
          - match: '(a|b)\\.(.+)'
            rename: 'x.\\2'
        """)
    with pytest.raises(RuleError) as err:
        inverse_yaml(load_rules(rules))
    assert err.value.problems == [
        f"{rules}:6: tensors[0] has no inverse: ops[0] concat: it has no sizes, so the inverse split cannot know "
        "where to cut; add sizes: [...] (or sizes: equal) to the concat (they are checked at plan time)",
        f"{rules}:9: tensors[1] has no inverse: ops[0] resize_rows: resizing drops or invents rows; write the "
        "reverse resize_rows by hand",
        f"{rules}:11: tensors[2] has no inverse: cast: bfloat16 is a lossy cast",
        f"{rules}:13: tensors[3] has no inverse: rename 'x.\\\\2' of match '(a|b)\\\\.(.+)' cannot be read "
        "backwards; write the inverse rule by hand (or use key: templates, which always invert)"]


def test_cli_prints_the_inverse_with_a_schema_that_exists(tmp_path: Path, run_cli) -> None:  # type: ignore[no-untyped-def]
    # no catch-all: the CLI proves the inverse one-to-one (tests/test_invert_guards.py)
    forward = write_rules(tmp_path / "forward.yaml", "tensors:\n  - match: 'extra\\.(.+)\\.w'\n"
                                                      "    rename: 'moved.\\1.weight'\n")
    proc = run_cli("invert", forward, "--out", tmp_path / "sub" / "inverse.yaml", cwd=tmp_path) \
        if (tmp_path / "sub").mkdir() is None else None
    assert proc is not None and proc.returncode == 0, proc.stderr
    text = (tmp_path / "sub" / "inverse.yaml").read_text()
    schema = text.splitlines()[0].split("$schema=")[1]
    assert (tmp_path / "sub" / schema).resolve().is_file()
    bad = write_rules(tmp_path / "bad.yaml", "tensors:\n  - match: 'd'\n    cast: bfloat16\n")
    stderr = assert_clean_failure(run_cli("invert", bad), code=2)
    assert stderr.strip().endswith("tensors[0] has no inverse: cast: bfloat16 is a lossy cast")


def test_torch_reference_for_gate_up_is_what_the_forward_writes(tmp_path: Path) -> None:
    """Guard against a round trip that is right only because both directions are wrong."""
    src = mixtral_legacy(3, layers=1)
    write_model(tmp_path / "src", src, CONFIG)
    forward = write_rules(tmp_path / "forward.yaml", MIXTRAL_RULE)
    api.apply(forward, out=tmp_path / "out", sources={"model": str(tmp_path / "src")}, progress=False)
    fused = read_output(tmp_path / "out")["model.layers.0.mlp.experts.gate_up_proj"]
    base = "model.layers.0.block_sparse_moe.experts"
    assert torch.equal(fused[2, :6], src[f"{base}.2.w1.weight"]) and torch.equal(fused[2, 6:], src[f"{base}.2.w3.weight"])


def test_inverse_turns_declarations_config_names_and_config_files_around(tmp_path: Path) -> None:
    """A module path `{X*}` and enumerations are declared on the side that now matches;
    `${config.n_heads}` is read under the name the forward wrote it to; the inverse of a
    params.json reader writes params.json and reads config.json; `sizes: equal` and a
    stack count become an equal split and an unstack counting dim 0."""
    rules = tmp_path / "r.yaml"
    rules.write_text("version: 1\nsources:\n  model: {path: src, config: params.json}\nconvert: model\n"
                     + textwrap.dedent("""\
        tensors:
          - key: '{X*}.experts.{E}.{P:w1,w3}.weight'
            to: '{X}.experts.gate_up'
            ops:
              - stack: {over: E, count: '${shape.{X}.gate.weight[0]}'}
              - concat: {over: P, dim: 1, sizes: equal}
          - key: 'layers.{L}.wq.weight'
            to: 'model.layers.{L}.q_proj.weight'
            ops: [{rope_permute: {heads: '${config.n_heads}'}}]
          - match: '.+'
        config:
          from: model
          keep: []
          set: {num_attention_heads: '${config.n_heads}'}
        """))
    text = inverse_yaml(load_rules(rules))
    assert "key: '{X*}.experts.gate_up'" in text and "to: '{X}.experts.{E}.{P:w1,w3}.weight'" in text
    assert "- split: {into: P, dim: 1}" in text and "- unstack: {into: E}" in text
    assert "rope_unpermute: {heads: '${config.num_attention_heads}'}" in text
    assert "config: params.json" not in text and "output: {config_file: params.json}" in text
