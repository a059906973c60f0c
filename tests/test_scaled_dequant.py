"""rules/fp8_to_bf16.yaml and rules/nvfp4_to_bf16.yaml (op dequant_scaled) on stand-ins of
other widths, GQA ratios and seeds than the rules were written against, each output weight
compared with the dequantization written here from the libraries' definitions:

- FP8 (compressed-tensors float-quantized): ``weight.to(scale.dtype) * scale``, then
  bfloat16 (a float32 scale stays float32, a bf16 scale multiplies in bf16);
- NVFP4 compressed-tensors: ``value(code) * (weight_scale / weight_global_scale)`` in
  float32, code 8 read as ``-0.0``; ModelOpt: ``value(code) * (weight_scale *
  weight_scale_2)``, code 8 read as ``+0.0`` (its table). Then bfloat16.

The libraries' own dequantizers on sources they made: tests/test_scaled_dequant_reference.py.
Also: every other tensor copied, activation scales and quantization_config gone, and each
bad input one plan error naming the key (and the config group it cannot read).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, assert_clean_failure, error_lines, read_output, same_bits
from op_references import e2m1_values, ref_scaled
from safetensors.torch import load_file, save_file

from ckptxform import api
from ckptxform.errors import PlanError
from ckptxform.standins.hf_models import LmDims
from ckptxform.standins.scaled import SCALED_SCHEMES, build_scaled_llama

FP8_RULE = REPO / "rules" / "fp8_to_bf16.yaml"
NVFP4_RULE = REPO / "rules" / "nvfp4_to_bf16.yaml"
#: other widths: GQA 5:1 and 3:3 (no GQA), columns odd multiples of 16
DIMS = [LmDims(hidden=80, heads=5, kv_heads=1, intermediate=144, layers=2, vocab=96),
        LmDims(hidden=48, heads=3, kv_heads=3, intermediate=112, layers=3, vocab=64)]


def rule_for(scheme: str) -> Path:
    return FP8_RULE if scheme.startswith("fp8") else NVFP4_RULE


@pytest.mark.parametrize("scheme", SCALED_SCHEMES)
@pytest.mark.parametrize("dims, seed", [(DIMS[0], 11), (DIMS[1], 12)], ids=["gqa5-s11", "mha-s12"])
def test_rule_output_is_the_libraries_dequantization(tmp_path: Path, scheme: str, dims: LmDims, seed: int) -> None:
    src = build_scaled_llama(tmp_path / "src", scheme, dims, seed=seed)
    source = read_output(src)
    api.apply(rule_for(scheme), out=tmp_path / "out", sources={"model": str(src)}, progress=False)
    got = read_output(tmp_path / "out")
    parts = ("weight_scale", "weight_global_scale", "weight_scale_2", "input_scale", "weight_packed")
    modules = {k.rsplit(".", 1)[0] for k in source if k.endswith(".weight_scale")}
    assert len(modules) == 7 * dims.layers
    assert set(got) == {k for k in source if not k.endswith(parts)} | {f"{m}.weight" for m in modules}
    negative_zeros = 0
    for key, value in got.items():
        module = key.removesuffix(".weight")
        if module in modules:
            want = ref_scaled({k.removeprefix(module + '.'): v for k, v in source.items()
                               if k.startswith(module + '.')})
            assert value.dtype == torch.bfloat16 and same_bits(value, want), key
            negative_zeros += int((value.view(torch.int16) == -32768).sum())
        else:
            assert same_bits(value, source[key]), key  # norms, embeddings, lm_head: copied
    if scheme in ("nvfp4", "mixed"):
        assert negative_zeros  # compressed-tensors keeps e2m1 -0; the stand-ins have such codes
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["num_key_value_heads"] == dims.kv_heads


def test_the_global_scale_is_in_every_value(tmp_path: Path) -> None:
    """What a loader that drops weight_global_scale writes is off by the global scale:
    thousands of times the stored scale, never a rounding."""
    src = build_scaled_llama(tmp_path / "src", "nvfp4", seed=4)
    source = read_output(src)
    api.apply(NVFP4_RULE, out=tmp_path / "out", sources={"model": str(src)}, progress=False)
    got = read_output(tmp_path / "out")["model.layers.0.mlp.up_proj.weight"].float()
    module = "model.layers.0.mlp.up_proj"
    without = e2m1_values(source[f"{module}.weight_packed"], True).view(got.shape[0], -1, 16) * \
        source[f"{module}.weight_scale"].float()[:, :, None]
    ratio = without.view(got.shape).abs().sum() / got.abs().sum()
    assert ratio == pytest.approx(float(source[f"{module}.weight_global_scale"]), rel=0.02)


def test_float16_output_rounds_the_bf16_product_first(tmp_path: Path) -> None:
    """A bf16 weight_scale: compressed-tensors' product is bf16, then cast; float32
    scales are never rounded before the product."""
    src = build_scaled_llama(tmp_path / "src", "mixed", DIMS[1], seed=2)
    rule = tmp_path / "fp16.yaml"
    rule.write_text(f"version: 1\nextends: {NVFP4_RULE}\nname: nvfp4-to-fp16\ntensors:\n  - key: '{{X*}}.{{T:weight,weight_packed,weight_scale,"
                    "weight_global_scale,weight_scale_2,input_scale,input_global_scale}'\n    to: '{X}.weight'\n"
                    "    ops:\n      - dequant_scaled: {over: T, dtype: float16}\n  - match: '.+'\n")
    api.apply(rule, out=tmp_path / "out", sources={"model": str(src)}, progress=False)
    got, source = read_output(tmp_path / "out"), read_output(src)
    key = "model.layers.2.self_attn.o_proj"
    want = (source[f"{key}.weight"].to(torch.bfloat16) * source[f"{key}.weight_scale"]).to(torch.float16)
    assert same_bits(got[f"{key}.weight"], want)
    key = "model.layers.1.mlp.gate_proj"
    packed = source[f"{key}.weight_packed"]
    values = e2m1_values(packed, True).view(packed.shape[0], -1, 16)
    scale = source[f"{key}.weight_scale"].float() / source[f"{key}.weight_global_scale"]
    assert same_bits(got[f"{key}.weight"], (values * scale[:, :, None]).view(packed.shape[0], -1).to(torch.float16))


# ------------------------------------------------------------------------------ errors


def edited(src: Path, dst: Path, *, drop: str | None = None, replace: dict[str, torch.Tensor] | None = None,
           config: Any = None) -> Path:
    """A copy of a stand-in without tensor ``drop``, with tensors replaced, or with
    ``config(quantization_config)`` applied."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors.pop(drop or "", None)
    tensors.update(replace or {})
    save_file(tensors, str(dst / "model.safetensors"))
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg["quantization_config"])
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("scaled")
    return {s: build_scaled_llama(root / s, s, seed=1) for s in ("fp8-channel", "nvfp4-modelopt", "mixed")}


def _int4_mlp(q: dict[str, Any]) -> None:
    q["config_groups"]["mlp"] = {"format": "pack-quantized", "targets": ["re:.*mlp.*"],
                                 "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 16}}


def _ignore_attention(q: dict[str, Any]) -> None:
    q["ignore"].append("re:.*self_attn.*")


M = "model.layers.1.mlp.down_proj"
A = "model.layers.0.self_attn.k_proj"
CASES = {
    "missing global scale": ("mixed", {"drop": f"{M}.weight_global_scale"}, (
        f"missing global scale: '{M}.weight_global_scale' is missing beside '{M}.weight_packed' (compressed-tensors "
        "NVFP4 (quantization_config.config_groups.mlp) needs weight_packed, weight_scale, weight_global_scale; the "
        "rule's key must enumerate them all)")),
    "missing ModelOpt scale_2": ("nvfp4-modelopt", {"drop": f"{M}.weight_scale_2"}, (
        f"missing global scale: '{M}.weight_scale_2' is missing beside '{M}.input_scale' (modelopt NVFP4 "
        "(quantization_config.quant_algo) needs weight, weight_scale, weight_scale_2; the rule's key must enumerate "
        "them all)")),
    "unreadable group": ("mixed", {"config": _int4_mlp}, (
        f"'{M.replace('1', '0')}.weight_global_scale': quantization_config.config_groups.mlp cannot be read: format "
        "'pack-quantized' with 4-bit int weights, strategy 'group' is neither FP8 float-quantized nor NVFP4 "
        "(pack-quantized int4: rules/compressed_int4_to_bf16.yaml)")),
    "ignored but quantized": ("mixed", {"config": _ignore_attention}, (
        "'model.layers.0.self_attn.k_proj.weight' is quantized but quantization_config.ignore lists "
        "'re:.*self_attn.*': the config does not describe this module")),
    "per-tensor scale under a per-channel group": (
        "fp8-channel", {"replace": {f"{A}.weight_scale": torch.ones(1, dtype=torch.bfloat16)}}, (
            f"'{A}.weight_scale' has shape [1], but quantization_config.config_groups.group_0 is FP8 per channel, "
            f"which for '{A}.weight' [32, 96] needs [32, 1]: the quantization_config does not match the tensors")),
    "scale groups that do not fit": (
        "mixed", {"replace": {f"{M}.weight_scale": torch.ones(96, 5).to(torch.float8_e4m3fn)}}, (
            f"'{M}.weight_scale' has shape [96, 5], but '{M}.weight_packed' [96, 88] holds 96 rows of 176 codes, "
            "which need [96, 11] (one scale per 16): the quantization_config does not match the tensors")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_bad_source_is_one_plan_error(tmp_path: Path, sources: dict[str, Path], run_cli: Any,
                                           case: str) -> None:
    scheme, edit, message = CASES[case]
    src = edited(sources[scheme], tmp_path / "src", **edit)
    before = sorted(p.name for p in src.iterdir())
    proc: subprocess.CompletedProcess[str] = run_cli("apply", str(NVFP4_RULE), "--source", f"model={src}",
                                                     "--out", str(tmp_path / "out"))
    assert_clean_failure(proc, 1)
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].endswith(message), lines
    assert "rules/nvfp4_to_bf16.yaml:" in lines[0]
    assert not (tmp_path / "out").exists() and sorted(p.name for p in src.iterdir()) == before


def test_the_fp8_rule_refuses_nvfp4_modules(tmp_path: Path, sources: dict[str, Path], run_cli: Any) -> None:
    """The FP8 rule's key enumerates FP8 parts: an NVFP4 module's scale reaches the op
    without its codes and is refused, not copied."""
    proc = run_cli("apply", str(FP8_RULE), "--source", f"model={sources['mixed']}", "--out", str(tmp_path / "out"))
    assert_clean_failure(proc, 1)
    (line,) = error_lines(proc.stderr)
    assert line.endswith("incomplete module: 'model.layers.0.mlp.down_proj.weight_packed' is missing beside "
                         "'model.layers.0.mlp.down_proj.weight_scale' (compressed-tensors NVFP4 "
                         "(quantization_config.config_groups.mlp) needs weight_packed, weight_scale, "
                         "weight_global_scale; the rule's key must enumerate them all)"), line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("scheme, key", [("fp8-channel", "weight"), ("nvfp4", "weight_packed"),
                                         ("nvfp4-modelopt", "weight")])
def test_a_cast_of_the_stored_codes_is_refused_naming_dequant_scaled(tmp_path: Path, scheme: str, key: str) -> None:
    src = build_scaled_llama(tmp_path / "src", scheme, seed=6)
    rule = tmp_path / "cast.yaml"
    rule.write_text("version: 1\nsources: {model: {path: x}}\nconvert: model\ntensors:\n"
                    "  - match: '.+'\n    cast: bfloat16\n")
    with pytest.raises(PlanError) as err:
        api.plan(rule, sources={"model": str(src)}).close()
    message = str(err.value)
    assert f"'model.layers.0.mlp.down_proj.{key}' would drop its scale" in message
    assert "dequantize it with dequant_scaled" in message


def test_a_nan_scale_is_refused_naming_the_element(tmp_path: Path, sources: dict[str, Path], run_cli: Any) -> None:
    key = "model.layers.1.mlp.up_proj.weight_scale"
    scale = load_file(str(sources["nvfp4-modelopt"] / "model.safetensors"))[key].clone()
    scale.view(torch.uint8)[3, 2] = 0x7F  # e4m3 NaN: the 16 values of group 2 of row 3
    src = edited(sources["nvfp4-modelopt"], tmp_path / "src", replace={key: scale})
    proc = run_cli("apply", str(NVFP4_RULE), "--source", f"model={src}", "--out", str(tmp_path / "out"))
    assert_clean_failure(proc, 1)
    (line,) = error_lines(proc.stderr)
    assert line.endswith("'model.layers.1.mlp.up_proj.weight' dequantized gives nan at [3, 32], a non-finite value "
                         "from a NaN or inf scale or a NaN byte of the source; fix the source, or add "
                         "allow_nonfinite: true to the op to write such values"), line
    assert not (tmp_path / "out").exists()
