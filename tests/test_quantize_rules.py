"""The bf16_to_* quantize rules on the engine's side: deterministic bytes for any --jobs, the
audit's reason for every kept tensor, and one clear plan error (or warning) naming the key
for each input the schemes cannot take. (Bit-exactness with llm-compressor and
compressed-tensors: tests/test_quantize_reference.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from ckptxform import api
from ckptxform.errors import CheckpointFormatError, PlanError
from ckptxform.standins.hf_models import LmDims, build_llama
from ckptxform.standins.tensors import save_safetensors

RULES = Path(__file__).resolve().parent.parent / "rules"
STEMS = ("bf16_to_fp8_block", "bf16_to_fp8_dynamic", "bf16_to_nvfp4")
DIMS = LmDims(hidden=208, heads=4, kv_heads=2, intermediate=400)


def _bf16(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32).astype(ml_dtypes.bfloat16)


def _checkpoint(folder: Path, tensors: dict[str, np.ndarray]) -> Path:
    folder.mkdir(parents=True)
    save_safetensors(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    return folder


def _extending(tmp: Path, stem: str, text: str) -> Path:
    rule = tmp / f"{stem}_child.yaml"
    rule.write_text(f"version: 1\nextends: {stem}\n{text}")
    return rule


def _audit(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "ckptxform_audit.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("stem", STEMS)
def test_same_bytes_and_digests_for_any_jobs(stem: str, tmp_path: Path) -> None:
    model = build_llama(tmp_path / "model", DIMS)
    rule = _extending(tmp_path, stem, "output: {max_shard_size: 300KB}\n")  # several shards to share out
    outs = [tmp_path / f"out{jobs}" for jobs in (1, 2)]
    for jobs, out in zip((1, 2), outs):
        api.apply(rule, out=out, sources={"model": str(model)}, progress=False, jobs=jobs)
    files = sorted(p.name for p in outs[0].glob("*.safetensors"))
    assert len(files) > 1 and files == sorted(p.name for p in outs[1].glob("*.safetensors"))
    for name in files:
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes()
    digests = [{r["key"]: r["digest"] for r in _audit(out) if r["event"] == "written"} for out in outs]
    assert digests[0] == digests[1] and digests[0]


def test_the_audit_says_why_each_kept_tensor_is_not_quantized(tmp_path: Path) -> None:
    model = build_llama(tmp_path / "model", DIMS)
    out = tmp_path / "out"
    api.apply(RULES / "bf16_to_fp8_block.yaml", out=out, sources={"model": str(model)}, progress=False)
    reasons = {r["key"]: r["reason"] for r in _audit(out) if r["event"] == "tensor"}
    assert "ignore entry 're:.*embed_tokens$' names 'model.embed_tokens'" in reasons["model.embed_tokens.weight"]
    assert "ignore entry 're:.*lm_head$' names 'lm_head'" in reasons["lm_head.weight"]
    assert "is a norm" in reasons["model.layers.0.input_layernorm.weight"]
    assert reasons["model.layers.0.mlp.down_proj.weight"].startswith("quantize_fp8_block into T")


def test_a_row_that_is_not_whole_fp4_groups_is_a_plan_error_naming_the_key(tmp_path: Path) -> None:
    model = build_llama(tmp_path / "model", LmDims(hidden=200, heads=4, kv_heads=2, intermediate=400))
    with pytest.raises(PlanError, match=r"\.weight' has 200 columns: NVFP4 scales groups of 16 and 16 does not "
                                        r"divide the row") as err:
        api.plan(RULES / "bf16_to_nvfp4.yaml", sources={"model": str(model)}).close()
    assert "add " in str(err.value) and "to ignore" in str(err.value) and err.value.key


def test_a_targeted_1d_weight_is_a_plan_error_naming_the_key(tmp_path: Path) -> None:
    src = _checkpoint(tmp_path / "model", {"a.proj.weight": _bf16((32, 32), 0), "a.gain.weight": _bf16((32,), 1)})
    with pytest.raises(PlanError, match=r"'a\.gain\.weight' is BF16 \[32\]: quantize_fp8_channel quantizes 2-D") as err:
        api.plan(RULES / "bf16_to_fp8_dynamic.yaml", sources={"model": str(src)}).close()
    assert err.value.key == "a.gain.weight"


def test_a_fused_set_missing_a_member_is_a_plan_error_naming_it(tmp_path: Path) -> None:
    src = _checkpoint(tmp_path / "model", {f"m.self_attn.{p}.weight": _bf16((32, 32), i)
                                           for i, p in enumerate(("q_proj", "k_proj"))})
    with pytest.raises(PlanError, match=r"incomplete group: 'm\.self_attn\.v_proj\.weight' is missing"):
        api.plan(RULES / "bf16_to_nvfp4.yaml", sources={"model": str(src)}).close()


def test_an_ignore_entry_naming_no_module_is_a_warning(tmp_path: Path) -> None:
    model = build_llama(tmp_path / "model", DIMS)
    base = (RULES / "bf16_to_fp8_block.yaml").read_text()
    typo = base.replace("'re:.*mtp.*']", "'re:.*mtp.*', model.layer.0.mlp.down_proj]")  # 'layer' for 'layers'
    rule = tmp_path / "typo.yaml"
    rule.write_text(typo)
    with api.plan(rule, sources={"model": str(model)}) as plan:
        assert any("ignore entry 'model.layer.0.mlp.down_proj' names no module of 'model'" in w for w in plan.warnings)


def test_an_op_ignore_the_written_config_does_not_list_is_a_plan_error(tmp_path: Path) -> None:
    model = build_llama(tmp_path / "model", DIMS)
    rule = _extending(tmp_path, "bf16_to_fp8_block", """tensors:
  - key: '{X*}.weight'
    to: '{X}.{T:weight,weight_scale}'
    ops: [{quantize_fp8_block: {into: T, ignore: ['re:.*embed_tokens$', 're:.*lm_head$', 're:.*o_proj$']}}]
""")
    with pytest.raises(PlanError, match=r"ignores \[.*o_proj.*\], but the config's quantization_config\.ignore is"):
        api.plan(rule, sources={"model": str(model)}).close()


def test_a_nan_weight_fails_the_run_naming_it_and_writes_nothing(tmp_path: Path) -> None:
    bad = _bf16((32, 32), 0)
    bad[3, 4] = np.nan
    src = _checkpoint(tmp_path / "model", {"a.proj.weight": bad})
    with pytest.raises(CheckpointFormatError, match=r"'a\.proj\.weight' holds NaN or infinite values"):
        api.apply(RULES / "bf16_to_fp8_block.yaml", out=tmp_path / "out", sources={"model": str(src)},
                  progress=False, jobs=1)
    assert not (tmp_path / "out").exists()
