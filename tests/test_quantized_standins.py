"""The quantized stand-ins look like the real checkpoints: moonshotai/Kimi-K2-Instruct
(FP8 block-scaled, 61 unpadded shards) at 1/16 of its widths, written deterministically,
with the quantization done as the real one was (per-block amax / 448)."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import read_output

from ckptxform.errors import UsageError
from ckptxform.standins.deepseek import KIMI_K2_TEXT
from ckptxform.standins.quantized import KIMI_K2_FP8_TINY, build_kimi_k2
from ckptxform.standins.shards import balanced_runs




@pytest.fixture(scope="module")
def k2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_kimi_k2(tmp_path_factory.mktemp("k2") / "Kimi-K2-Instruct").path


def test_kimi_k2_has_61_unpadded_shards_and_a_complete_index(k2: Path) -> None:
    index = json.loads((k2 / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert shards == {f"model-{i}-of-61.safetensors" for i in range(1, 62)}
    assert sorted(p.name for p in k2.glob("*.safetensors")) == sorted(shards)
    assert index["weight_map"]["model.embed_tokens.weight"] == "model-1-of-61.safetensors"
    assert index["weight_map"]["lm_head.weight"] == "model-61-of-61.safetensors"
    total = sum(t.numel() * t.element_size() for t in read_output(k2).values())
    assert index["metadata"]["total_size"] == total


def test_kimi_k2_linear_weights_are_fp8_with_a_scale_per_block(k2: Path) -> None:
    config = json.loads((k2 / "config.json").read_text())
    assert config["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3",
                                             "quant_method": "fp8", "weight_block_size": [8, 8]}
    tensors = read_output(k2)
    fp8 = [k for k, t in tensors.items() if t.dtype == torch.float8_e4m3fn]
    assert fp8 and all(k.endswith(".weight") for k in fp8)
    for key in fp8:
        scale = tensors[key.removesuffix("weight") + "weight_scale_inv"]
        rows, cols = tensors[key].shape
        assert scale.dtype == torch.float32 and tuple(scale.shape) == (math.ceil(rows / 8), math.ceil(cols / 8))
    # the real partial edge block, scaled down: [576, 7168] with scale [5, 56]
    kv_a = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert tuple(tensors[kv_a].shape) == (576 // 16, 7168 // 16)
    assert tuple(tensors[kv_a + "_scale_inv"].shape) == (5, 56)
    scales = {k for k in tensors if k.endswith("_scale_inv")}
    assert scales == {k + "_scale_inv" for k in fp8}
    plain = {k: t.dtype for k, t in tensors.items() if k not in scales and k not in fp8}
    assert plain["model.embed_tokens.weight"] == plain["lm_head.weight"] == torch.bfloat16
    assert plain["model.layers.1.mlp.gate.weight"] == torch.bfloat16
    assert plain["model.layers.1.mlp.gate.e_score_correction_bias"] == torch.float32
    assert all(plain[k] == torch.bfloat16 for k in plain if k.endswith("norm.weight"))
    assert not any("mlp.gate.weight" in k or "norm" in k for k in fp8)


def test_kimi_k2_quantization_uses_the_fp8_range_per_block(k2: Path) -> None:
    tensors = read_output(k2)
    w = tensors["model.layers.1.mlp.experts.3.down_proj.weight"].to(torch.float32)
    s = tensors["model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"]
    amax = w.view(w.shape[0] // 8, 8, w.shape[1] // 8, 8).abs().amax(dim=(1, 3))
    assert torch.equal(amax, torch.full_like(amax, 448.0))  # every block reaches e4m3's max
    dequantized = w * s.repeat_interleave(8, 0).repeat_interleave(8, 1)
    assert 0.015 < dequantized.std().item() < 0.025  # N(0, 0.02) weights


def test_kimi_k2_weights_and_scales_may_sit_in_different_shards(k2: Path) -> None:
    weight_map = json.loads((k2 / "model.safetensors.index.json").read_text())["weight_map"]
    split = [k for k in weight_map if k.endswith("_scale_inv")
             and weight_map[k] != weight_map[k.removesuffix("_scale_inv")]]
    assert split  # real checkpoints split modules across shards too: readers must not assume otherwise


def test_kimi_k2_is_deterministic_and_seeded(tmp_path: Path, k2: Path) -> None:
    def digest(root: Path) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}

    assert digest(build_kimi_k2(tmp_path / "again").path) == digest(k2)
    other = build_kimi_k2(tmp_path / "seed1", seed=1).path
    assert digest(other)["config.json"] == digest(k2)["config.json"]
    assert digest(other) != digest(k2)


def test_kimi_k2_takes_other_sizes_and_blocks(tmp_path: Path) -> None:
    dims = KIMI_K2_TEXT.scaled(32, layers=2, routed_experts=2, experts_per_token=1, vocab=300)
    built = build_kimi_k2(tmp_path / "k2", dims, block=(16, 24), num_shards=5)
    assert len({f for f in built.files if f.endswith(".safetensors")}) == 5
    assert built.shapes["model.layers.1.mlp.experts.1.up_proj.weight"] == (64, 224)
    assert built.shapes["model.layers.1.mlp.experts.1.up_proj.weight_scale_inv"] == (4, 10)  # 224/24: partial


def test_tiny_dims_are_kimi_k2_at_one_sixteenth() -> None:
    assert (KIMI_K2_FP8_TINY.hidden, KIMI_K2_FP8_TINY.kv_lora_rank, KIMI_K2_FP8_TINY.qk_rope_head_dim) == \
        (448, 32, 4)
    with pytest.raises(UsageError, match="3 does not divide hidden=7168"):
        KIMI_K2_TEXT.scaled(3)


def test_balanced_runs_are_contiguous_non_empty_and_even() -> None:
    placed = balanced_runs([10] * 12, 4)
    assert placed == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert balanced_runs([1000, 1, 1, 1], 4) == [0, 1, 2, 3]  # a big first item cannot starve the rest
    assert balanced_runs([1, 1, 1, 1000], 2) == [0, 0, 0, 1]
    with pytest.raises(UsageError, match="cannot split 2 tensors into 3 non-empty shards"):
        balanced_runs([1, 1], 3)


def test_kimi_k2_thinking_quantizes_routed_experts_to_int4_only(tmp_path: Path) -> None:
    root = build_kimi_k2(tmp_path / "k2t", quantization="int4", group=32, num_shards=7).path
    config = json.loads((root / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == 32
    tensors = read_output(root)
    packed = {k.removesuffix(".weight_packed") for k in tensors if k.endswith(".weight_packed")}
    experts = {k.removesuffix(".weight") for k in tensors if ".mlp.experts." in k and k.endswith(".weight")}
    assert packed and not experts and all(".mlp.experts." in m for m in packed)
    for module in packed:
        rows, cols = tensors[f"{module}.weight_shape"].tolist()
        assert tuple(tensors[f"{module}.weight_packed"].shape) == (rows, math.ceil(cols / 8))
        assert tuple(tensors[f"{module}.weight_scale"].shape) == (rows, cols // 32)
    assert not any(t.dtype == torch.float8_e4m3fn for t in tensors.values())


@pytest.mark.reference
def test_compressed_tensors_reads_the_int4_standins(tmp_path: Path) -> None:
    """compressed-tensors' own checkpoint dequantizer takes both int4 stand-ins as they are
    (top-level and text_config quantization_config) and leaves no quantization parameter."""
    ct = pytest.importorskip("compressed_tensors.entrypoints.convert",
                             reason="needs the 'reference' extra: pip install torch==2.13.0 -e '.[test,reference]'")
    from ckptxform.standins import KIMI_K2_TINY, build_kimi_k25_verifier

    for root in (build_kimi_k2(tmp_path / "k2t", quantization="int4", num_shards=7).path,
                 build_kimi_k25_verifier(tmp_path / "k25", KIMI_K2_TINY, num_shards=5).path):
        tensors = read_output(root)
        out = ct.CompressedTensorsDequantizer(str(root)).validate(dict(tensors))
        assert not any(k.endswith(("weight_packed", "weight_scale", "weight_shape")) for k in out)
        assert {k for k in out if k.endswith(".weight")} >= {
            k.replace("weight_packed", "weight") for k in tensors if k.endswith("weight_packed")}
