"""Issue 40 item 3: fp8_block_to_nvfp4 and fp8_block_to_w4a16, one rule each, give the bytes
of the two shipped rules run one after the other (fp8_block_to_bf16, then bf16_to_nvfp4 or
bf16_to_w4a16), on FP8 block-scaled Kimi-K2 stand-ins with the real 128x128 blocks, a
partial edge block (kv_a_proj's 144 rows), MoE experts and a 301-row vocabulary:

- every tensor, byte for byte, and config.json field for field (its quantization_config the
  target format's, nothing of the FP8 one left);
- the ignored modules (embeddings, lm_head, the router) come out as their bfloat16 weights,
  the scales are consumed, every source tensor has its audit record;
- a chain source whose FP8 weight lacks its scale still fails the plan naming the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, assert_clean_failure, assert_same_checkpoint, error_lines, read_audit, read_output, same_bits

from ckptxform import api
from ckptxform.standins import build_kimi_k2
from ckptxform.standins.for_rules import KIMI_K2_REQUANT

RULES = REPO / "rules"
TARGETS = {"fp8_block_to_nvfp4": "bf16_to_nvfp4", "fp8_block_to_w4a16": "bf16_to_w4a16"}


@pytest.fixture(scope="module", params=[(1, 3), (4, 1)], ids=["seed1-3shards", "seed4-1shard"])
def fp8_source(request: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    seed, shards = request.param
    return build_kimi_k2(tmp_path_factory.mktemp("fp8") / "Kimi-K2-Instruct", KIMI_K2_REQUANT, block=(128, 128),
                         num_shards=shards, seed=seed).path


def _apply(rule: str, source: Path, out: Path) -> Path:
    api.apply(RULES / f"{rule}.yaml", out=out, sources={"model": str(source)}, progress=False)
    return out


@pytest.mark.parametrize("rule", sorted(TARGETS))
def test_one_rule_is_the_two_shipped_rules_in_a_row(rule: str, fp8_source: Path, tmp_path: Path) -> None:
    one = _apply(rule, fp8_source, tmp_path / "one")
    bf16 = _apply("fp8_block_to_bf16", fp8_source, tmp_path / "bf16")
    two = _apply(TARGETS[rule], bf16, tmp_path / "two")
    quant = assert_same_checkpoint(one, two)["quantization_config"]
    assert quant["quant_method"] == "compressed-tensors" and "weight_block_size" not in quant


@pytest.mark.parametrize("rule", sorted(TARGETS))
def test_ignored_modules_are_bf16_and_every_source_tensor_is_accounted_for(rule: str, fp8_source: Path,
                                                                           tmp_path: Path) -> None:
    out = _apply(rule, fp8_source, tmp_path / "out")
    got, source = read_output(out), read_output(fp8_source)
    assert not [k for k in got if k.endswith("weight_scale_inv")]
    for key in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.1.mlp.gate.weight"):
        assert same_bits(got[key], source[key]), key  # stored bf16 in the FP8 release: unchanged
    assert str(got["model.layers.0.mlp.down_proj.weight_packed"].dtype) in ("torch.uint8", "torch.int32")
    assert "model.layers.0.mlp.down_proj.weight" not in got
    records = {e["key"]: e for e in read_audit(out) if e["event"] == "tensor"}
    assert sorted(records) == sorted(source)
    module = "model.layers.0.self_attn.kv_a_proj_with_mqa"
    for part in ("weight", "weight_scale_inv"):  # both inputs of the chain, each naming what it became
        record = records[f"{module}.{part}"]
        assert (record["action"], record["target"]) == ("transformed", sorted(k for k in got if k.startswith(module)))


def test_an_fp8_weight_without_its_scale_fails_the_plan(fp8_source: Path, tmp_path: Path, run_cli: Any) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    from safetensors.torch import save_file

    tensors = read_output(fp8_source)
    del tensors["model.layers.0.mlp.down_proj.weight_scale_inv"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    (broken / "config.json").write_text((fp8_source / "config.json").read_text())
    proc = run_cli("apply", RULES / "fp8_block_to_nvfp4.yaml", "--source", f"model={broken}",
                   "--out", tmp_path / "out")
    lines = error_lines(assert_clean_failure(proc))
    assert len(lines) == 1 and "missing scale" in lines[0] and "model.layers.0.mlp.down_proj.weight" in lines[0], lines
    assert not (tmp_path / "out").exists()
