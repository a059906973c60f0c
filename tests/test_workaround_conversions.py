"""The two conversions issue 25 found expressible only through identities nobody reviewing
a rule would recognise, written again with the ops made for them:

- GPT-NeoX/Pythia's per-head fused ``query_key_value`` (rows: head 0's q, k, v, head 1's
  ...; transformers' GPTNeoXAttention views the output as ``(..., heads, 3 * head_size)``
  and chunks it in three) split into q/k/v: before, ``qkv_deinterleave`` with kv_heads =
  heads then an equal split; now ``split_heads``.
- gpt-oss's ``gate_up_proj`` [E, H, 2I], gate and up interleaved along the last dim
  (transformers' GptOssExperts: ``gate_up[..., ::2], gate_up[..., 1::2]``), to per-expert
  ``gate_proj``/``up_proj`` [I, H] (the layout of Mixtral's and Qwen's per-expert files):
  before, ``rope_permute {heads: 1}`` on the transposed rows; now ``deinterleave``.

Each is written both ways: the outputs are byte-identical, equal to the slicing
transformers does, and ``ckptxform invert`` of each rule gives the rule that turns the
output back into the source, byte for byte.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import tensor_bytes
from safetensors.torch import load_file, save_file

from ckptxform import api

HEAD = "version: 1\nsources: {model: {path: ./src}}\nconvert: model\ntensors:\n"

NEOX = {
    "before": """\
      - key: 'layers.{L}.attention.query_key_value.{T:weight,bias}'
        to: 'layers.{L}.attention.{P:q_proj,k_proj,v_proj}.{T}'
        ops:
          - qkv_deinterleave: {heads: '${config.num_attention_heads}', kv_heads: '${config.num_attention_heads}'}
          - split: {into: P, dim: 0}
    """,
    "after": """\
      - key: 'layers.{L}.attention.query_key_value.{T:weight,bias}'
        to: 'layers.{L}.attention.{P:q_proj,k_proj,v_proj}.{T}'
        ops:
          - split_heads: {into: P, heads: '${config.num_attention_heads}'}
    """,
}

GPT_OSS = {
    "before": """\
      - key: 'layers.{L}.mlp.experts.gate_up_proj'
        to: 'layers.{L}.mlp.experts.{E}.{P:gate_proj,up_proj}.weight'
        ops:
          - unstack: {into: E}
          - transpose: [0, 1]
          - rope_permute: {heads: 1}
          - split: {into: P, dim: 0}
      - key: 'layers.{L}.mlp.experts.gate_up_proj_bias'
        to: 'layers.{L}.mlp.experts.{E}.{P:gate_proj,up_proj}.bias'
        ops:
          - unstack: {into: E}
          - rope_permute: {heads: 1}
          - split: {into: P, dim: 0}
    """,
    "after": """\
      - key: 'layers.{L}.mlp.experts.gate_up_proj'
        to: 'layers.{L}.mlp.experts.{E}.{P:gate_proj,up_proj}.weight'
        ops:
          - deinterleave: {into: P, dim: 2}
          - unstack: {into: E}
          - transpose: [0, 1]
      - key: 'layers.{L}.mlp.experts.gate_up_proj_bias'
        to: 'layers.{L}.mlp.experts.{E}.{P:gate_proj,up_proj}.bias'
        ops:
          - deinterleave: {into: P, dim: 1}
          - unstack: {into: E}
    """,
}


def neox_source(heads: int, head_size: int, hidden: int, layers: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rows = 3 * heads * head_size
    out = {}
    for n in range(layers):
        out[f"layers.{n}.attention.query_key_value.weight"] = torch.randn(rows, hidden, generator=gen).to(torch.float16)
        out[f"layers.{n}.attention.query_key_value.bias"] = torch.randn(rows, generator=gen).to(torch.float16)
    return out


def gpt_oss_source(experts: int, hidden: int, intermediate: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"layers.0.mlp.experts.gate_up_proj": torch.randn(experts, hidden, 2 * intermediate,
                                                             generator=gen).to(torch.bfloat16),
            "layers.0.mlp.experts.gate_up_proj_bias": torch.randn(experts, 2 * intermediate,
                                                                  generator=gen).to(torch.bfloat16)}


def run(root: Path, name: str, body: str, tensors: dict[str, torch.Tensor], config: dict[str, int]) -> Path:
    """Apply the rule ``body`` to a source of ``tensors``; the rule file (its output beside it)."""
    src = root / "src"
    if not src.exists():
        src.mkdir(parents=True)
        save_file(tensors, str(src / "model.safetensors"))
        (src / "config.json").write_text(json.dumps(config))
    rule = root / f"{name}.yaml"
    rule.write_text(HEAD + textwrap.indent(textwrap.dedent(body), "  ") + "config: {from: model}\n")
    api.apply(rule, out=root / name, sources={"model": str(src)}, progress=False)
    return rule


def written(path: Path) -> dict[str, bytes]:
    return {k: tensor_bytes(v) for k, v in load_file(str(path / "model.safetensors")).items()}


def invert_and_apply(rule: Path, out: Path) -> dict[str, bytes]:
    """``ckptxform invert RULE`` as a user runs it, applied to RULE's output: what it gives back."""
    done = subprocess.run([sys.executable, "-m", "ckptxform", "invert", str(rule)], check=False,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    inverse = rule.with_name(rule.stem + "_inverse.yaml")
    inverse.write_text(done.stdout)
    back = out.with_name(out.name + "_back")
    api.apply(inverse, out=back, sources={"model": str(out)}, progress=False)
    return written(back)


@pytest.mark.parametrize(("heads", "head_size", "hidden", "seed"), [(5, 4, 20, 1), (3, 6, 18, 2)])
def test_neox_qkv_split_heads_is_the_qkv_deinterleave_workaround_and_inverts(
        tmp_path: Path, heads: int, head_size: int, hidden: int, seed: int) -> None:
    source = neox_source(heads, head_size, hidden, layers=2, seed=seed)
    config = {"num_attention_heads": heads, "hidden_size": hidden}
    rules = {way: run(tmp_path, way, body, source, config) for way, body in NEOX.items()}
    before, after = written(tmp_path / "before"), written(tmp_path / "after")
    assert after == before and len(after) == 12
    for n in range(2):  # what transformers' GPTNeoXAttention computes: per head, chunk(3) of 3 * head_size
        fused = source[f"layers.{n}.attention.query_key_value.weight"]
        q, k, v = fused.view(heads, 3 * head_size, hidden).chunk(3, dim=1)
        for name, part in zip(("q_proj", "k_proj", "v_proj"), (q, k, v)):
            assert after[f"layers.{n}.attention.{name}.weight"] == tensor_bytes(part.reshape(-1, hidden))
    want = {k: tensor_bytes(v) for k, v in source.items()}
    for way, rule in rules.items():
        assert invert_and_apply(rule, tmp_path / way) == want, way
    assert "merge_heads" in rules["after"].with_name("after_inverse.yaml").read_text()


@pytest.mark.parametrize(("experts", "hidden", "intermediate", "seed"), [(3, 12, 10, 3), (2, 7, 5, 4)])
def test_gpt_oss_gate_up_deinterleave_is_the_rope_permute_workaround_and_inverts(
        tmp_path: Path, experts: int, hidden: int, intermediate: int, seed: int) -> None:
    source = gpt_oss_source(experts, hidden, intermediate, seed)
    rules = {way: run(tmp_path, way, body, source, {"hidden_size": hidden}) for way, body in GPT_OSS.items()}
    before, after = written(tmp_path / "before"), written(tmp_path / "after")
    assert after == before and len(after) == 4 * experts
    gate_up = source["layers.0.mlp.experts.gate_up_proj"]
    bias = source["layers.0.mlp.experts.gate_up_proj_bias"]
    for e in range(experts):  # transformers' GptOssExperts: gate_up[..., ::2], gate_up[..., 1::2]
        p = f"layers.0.mlp.experts.{e}."
        assert after[p + "gate_proj.weight"] == tensor_bytes(gate_up[e][..., ::2].t())
        assert after[p + "up_proj.weight"] == tensor_bytes(gate_up[e][..., 1::2].t())
        assert after[p + "gate_proj.bias"] == tensor_bytes(bias[e][::2])
        assert after[p + "up_proj.bias"] == tensor_bytes(bias[e][1::2])
    want = {k: tensor_bytes(v) for k, v in source.items()}
    for way, rule in rules.items():
        assert invert_and_apply(rule, tmp_path / way) == want, way
    assert "interleave: {over: P, dim: 2}" in rules["after"].with_name("after_inverse.yaml").read_text()
