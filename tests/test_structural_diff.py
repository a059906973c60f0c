"""``diff A B --emit-rules`` infers stack, concat, split and transpose, and its rule file,
applied to A, reproduces B byte for byte (B is built here from A with torch)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import read_output
from test_structural_engine import assert_same, rand, write_model

from ckptxform import api
from ckptxform.diff.checkpoint import checkpoint_diff


def apply_emitted(tmp_path: Path, a: Path, b: Path, run_cli) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    rules = tmp_path / "rules" / "emitted.yaml"
    rules.parent.mkdir()
    proc = run_cli("diff", a, b, "--emit-rules", "--out", rules)
    assert proc.returncode == 0, proc.stderr
    text = rules.read_text()
    schema = text.splitlines()[0].split("$schema=")[1]
    assert (rules.parent / schema).resolve().is_file(), schema
    assert "\nconfig:\n  from: source" in text
    api.apply(rules, out=tmp_path / "out", progress=False)
    return read_output(tmp_path / "out")


def test_a_removed_model_prefix_is_a_rename_not_a_skip(tmp_path: Path, run_cli) -> None:  # type: ignore[no-untyped-def]
    a = {"model.embed_tokens.weight": rand(9, 4, seed=1), "model.norm.weight": rand(4, seed=2),
         "model.layers.0.mlp.up_proj.weight": rand(6, 4, seed=3), "lm_head.weight": rand(9, 4, seed=4)}
    b = {k.removeprefix("model."): v for k, v in a.items()}
    write_model(tmp_path / "a", a, {"hidden_size": 4})
    write_model(tmp_path / "b", b)
    result = checkpoint_diff(str(tmp_path / "a"), str(tmp_path / "b"))
    assert result.unexplained_a == [] and result.unexplained_b == []
    assert_same(apply_emitted(tmp_path, tmp_path / "a", tmp_path / "b", run_cli), b)
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == {"hidden_size": 4}


def test_stack_concat_and_transpose_are_inferred(tmp_path: Path, run_cli) -> None:  # type: ignore[no-untyped-def]
    a: dict[str, torch.Tensor] = {}
    for layer in range(2):
        for e in range(3):
            a[f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight"] = rand(4, 6, seed=10 * layer + e)
        for i, (name, rows) in enumerate((("q", 8), ("k", 4), ("v", 4))):
            a[f"model.layers.{layer}.self_attn.{name}_proj.weight"] = rand(rows, 4, seed=100 + 10 * layer + i)
        a[f"model.layers.{layer}.self_attn.o_proj.weight"] = rand(4, 8, seed=200 + layer)
        a[f"h.{layer}.mlp.c_fc.weight"] = rand(4, 7, seed=300 + layer)
    b: dict[str, torch.Tensor] = {}
    for layer in range(2):
        base = f"model.layers.{layer}"
        b[f"{base}.mlp.experts.down_proj"] = torch.stack([a[f"{base}.mlp.experts.{e}.down_proj.weight"]
                                                           for e in range(3)])
        b[f"{base}.self_attn.qkv_proj.weight"] = torch.cat([a[f"{base}.self_attn.{n}_proj.weight"] for n in "qkv"])
        b[f"{base}.self_attn.o_proj.weight"] = a[f"{base}.self_attn.o_proj.weight"]
        b[f"h.{layer}.mlp.c_fc.weight"] = a[f"h.{layer}.mlp.c_fc.weight"].t()
    write_model(tmp_path / "a", a, {})
    write_model(tmp_path / "b", b)
    result = checkpoint_diff(str(tmp_path / "a"), str(tmp_path / "b"))
    assert sorted((s.key, s.to) for s in result.structural) == [
        ("h.{L}.mlp.c_fc.weight", "h.{L}.mlp.c_fc.weight"),
        ("model.layers.{L}.mlp.experts.{E}.down_proj.weight", "model.layers.{L}.mlp.experts.down_proj"),
        ("model.layers.{L}.self_attn.{P:q_proj,k_proj,v_proj}.weight", "model.layers.{L}.self_attn.qkv_proj.weight")]
    assert result.unexplained_a == [] and result.unexplained_b == []
    assert_same(apply_emitted(tmp_path, tmp_path / "a", tmp_path / "b", run_cli), b)


def test_an_unequal_split_is_inferred(tmp_path: Path, run_cli) -> None:  # type: ignore[no-untyped-def]
    qkv = rand(16, 4, seed=5)
    write_model(tmp_path / "a", {"layers.0.qkv_proj.weight": qkv, "layers.0.gate_up_proj.weight": rand(6, 4)}, {})
    q, k, v = torch.split(qkv, [8, 4, 4])
    b = {"layers.0.q_proj.weight": q, "layers.0.k_proj.weight": k, "layers.0.v_proj.weight": v}
    write_model(tmp_path / "b", b)
    result = checkpoint_diff(str(tmp_path / "a"), str(tmp_path / "b"))
    assert [(s.key, s.to, s.ops) for s in result.structural] == [
        ("layers.{L}.qkv_proj.weight", "layers.{L}.{P:q_proj,k_proj,v_proj}.weight",
         ("{split: {into: P, dim: 0, sizes: [8, 4, 4]}}",))]
    assert result.unexplained_a == ["layers.0.gate_up_proj.weight"]  # B has no counterpart: skipped
    assert_same(apply_emitted(tmp_path, tmp_path / "a", tmp_path / "b", run_cli), b)


def test_stack_then_concat_of_experts_is_inferred(tmp_path: Path, run_cli) -> None:  # type: ignore[no-untyped-def]
    a = {f"model.layers.{layer}.mlp.experts.{e}.{name}_proj.weight": rand(6, 4, seed=100 * layer + 10 * e + i)
         for layer in range(2) for e in range(3) for i, name in enumerate(("gate", "up"))}
    b = {f"model.layers.{layer}.mlp.experts.gate_up_proj": torch.cat(
        [torch.stack([a[f"model.layers.{layer}.mlp.experts.{e}.{n}_proj.weight"] for e in range(3)])
         for n in ("gate", "up")], dim=1) for layer in range(2)}
    write_model(tmp_path / "a", a, {})
    write_model(tmp_path / "b", b)
    result = checkpoint_diff(str(tmp_path / "a"), str(tmp_path / "b"))
    assert [(s.key, s.to, s.ops) for s in result.structural] == [
        ("model.layers.{L}.mlp.experts.{E}.{P:gate_proj,up_proj}.weight", "model.layers.{L}.mlp.experts.gate_up_proj",
         ("{stack: {over: E, count: 3}}", "{concat: {over: P, dim: 1, sizes: [6, 6]}}"))]
    assert_same(apply_emitted(tmp_path, tmp_path / "a", tmp_path / "b", run_cli), b)
