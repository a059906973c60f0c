"""The structural library rules refuse broken sources at plan time, as a user runs them.

A layer missing an expert, a fused projection whose rows do not add up to the config's
heads, a params.json without the field an op needs, an lm_head that is not the
embedding's copy, a tied checkpoint that already has an lm_head: each is one line on
stderr naming the key or field and the rule's FILE:LINE, exit 1, and no output directory.
The sources are small hand-written safetensors files (no transformers needed): the
layouts are those tests/reference_models.py builds with transformers.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch
from conftest import REPO
from safetensors.torch import save_file

RULES = REPO / "rules"
CLI = Callable[..., subprocess.CompletedProcess[str]]


def write_checkpoint(root: Path, tensors: dict[str, tuple[int, ...]], config: dict | None = None,
                     *, file_name: str = "model.safetensors", config_name: str = "config.json",
                     seed: int = 0) -> Path:
    gen = torch.Generator().manual_seed(seed)
    root.mkdir(parents=True)
    save_file({k: torch.randn(shape, generator=gen) for k, shape in tensors.items()}, root / file_name)
    if config is not None:
        (root / config_name).write_text(json.dumps(config))
    return root


def rule_line(rule: str, text: str) -> int:
    """The line of ``rule`` where ``text`` first appears: the rule entry an error names."""
    lines = (RULES / rule).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def refused(run_cli: CLI, rule: str, source: Path, out: Path) -> str:
    """Apply ``rule`` to ``source``; it must fail with exit 1, one stderr line, no output."""
    done = run_cli("apply", RULES / rule, "--source", f"model={source}", "--out", out)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert not out.exists() and not list(out.parent.glob(f".{out.name}*"))
    return lines[0]


def _mixtral(experts: int, layers: int = 2) -> dict[str, tuple[int, ...]]:
    hidden, inter = 12, 8
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (16, hidden),
                                       "lm_head.weight": (16, hidden)}
    for n in range(layers):
        out[f"model.layers.{n}.block_sparse_moe.gate.weight"] = (experts, hidden)
        for e in range(experts):
            for w, shape in (("w1", (inter, hidden)), ("w2", (hidden, inter)), ("w3", (inter, hidden))):
                out[f"model.layers.{n}.block_sparse_moe.experts.{e}.{w}.weight"] = shape
    return out


def test_a_layer_missing_an_expert_is_refused(run_cli: CLI, tmp_path: Path) -> None:
    tensors = _mixtral(experts=3)
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    source = write_checkpoint(tmp_path / "mixtral", tensors, {"num_local_experts": 3})
    line = refused(run_cli, "mixtral_legacy_to_fused.yaml", source, tmp_path / "out")
    assert "'model.layers.1.block_sparse_moe.experts.2.w3.weight'" in line
    stack = rule_line("mixtral_legacy_to_fused.yaml", "- stack: {over: E")
    assert f"mixtral_legacy_to_fused.yaml:{stack}): incomplete group" in line


def test_the_last_expert_missing_in_every_layer_is_refused(run_cli: CLI, tmp_path: Path) -> None:
    """The count comes from the router's rows, so experts 0..n-2 alone are not a
    complete group (a truncated last shard)."""
    tensors = {k: v for k, v in _mixtral(experts=4).items() if ".experts.3." not in k}
    tensors = {k.replace("block_sparse_moe", "mlp").replace(".w1.", ".gate_proj.")
               .replace(".w3.", ".up_proj.").replace(".w2.", ".down_proj."): v
               for k, v in tensors.items()}
    source = write_checkpoint(tmp_path / "qwen", tensors, {"num_experts": 4})
    line = refused(run_cli, "qwen2_moe_legacy_to_fused.yaml", source, tmp_path / "out")
    assert re.search(r"'model\.layers\.0\.mlp\.experts\.3\.(gate|up|down)_proj\.weight'", line), line
    assert "qwen2_moe_legacy_to_fused.yaml:" in line


def test_a_qkv_split_that_does_not_add_up_names_both_numbers(run_cli: CLI, tmp_path: Path) -> None:
    # 4 heads of 5, 2 kv heads: qkv has (4 + 2*2) * 5 = 40 rows; the config says 1 kv head.
    tensors = {"model.layers.0.self_attn.qkv_proj.weight": (40, 20),
               "model.layers.0.mlp.gate_up_proj.weight": (16, 20)}
    source = write_checkpoint(tmp_path / "phi3", tensors, {
        "hidden_size": 20, "num_attention_heads": 4, "num_key_value_heads": 1})
    line = refused(run_cli, "phi3_to_llama.yaml", source, tmp_path / "out")
    assert "[20, 5, 5] add up to 30" in line and "is 40" in line
    assert f"phi3_to_llama.yaml:{rule_line('phi3_to_llama.yaml', '- split:')}" in line


def test_tying_refuses_an_lm_head_that_is_not_the_embedding(run_cli: CLI, tmp_path: Path) -> None:
    tensors = {"model.embed_tokens.weight": (16, 8), "lm_head.weight": (16, 8), "model.norm.weight": (8,)}
    source = write_checkpoint(tmp_path / "untied", tensors, {"tie_word_embeddings": False})
    line = refused(run_cli, "tie_embeddings.yaml", source, tmp_path / "out")
    assert "lm_head.weight differs from output 'model.embed_tokens.weight'" in line
    assert f"tie_embeddings.yaml:{rule_line('tie_embeddings.yaml', 'key: lm_head.weight')}" in line


def test_untying_refuses_a_checkpoint_that_has_an_lm_head(run_cli: CLI, tmp_path: Path) -> None:
    tensors = {"model.embed_tokens.weight": (16, 8), "lm_head.weight": (16, 8)}
    source = write_checkpoint(tmp_path / "untied", tensors, {"tie_word_embeddings": False})
    line = refused(run_cli, "untie_embeddings.yaml", source, tmp_path / "out")
    assert "'lm_head.weight'" in line
    assert "untie_embeddings.yaml:" in line

