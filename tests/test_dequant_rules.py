"""rules/fp8_block_to_bf16.yaml and rules/compressed_int4_to_bf16.yaml against independent
references, on stand-ins of sizes, seeds and blocks the rules were not written for:

- FP8: every output weight equals a plain loop over its blocks, written here from
  DeepSeek's definition (test_dequant_kernels.fp8_reference); every other tensor is the
  source's bytes; the scales are gone.
- int4: the output equals what compressed-tensors' own checkpoint dequantizer
  (``CompressedTensorsDequantizer``) makes of the same files, bit for bit; and a source
  packed by compressed-tensors itself (symmetric and asymmetric) comes out as
  compressed-tensors decompresses it.
- transformers loads the bf16 outputs with no missing or unexpected keys.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, assert_clean_failure, error_lines, read_audit, read_output, same_bits
from safetensors.torch import save_file
from test_dequant_kernels import fp8_reference

from ckptxform import api
from ckptxform.standins import KIMI_K2_TEXT, KIMI_K2_TINY, build_kimi_k2, build_kimi_k25_verifier
from ckptxform.standins.configs import int4_quantization_config

FP8_RULE = REPO / "rules" / "fp8_block_to_bf16.yaml"
INT4_RULE = REPO / "rules" / "compressed_int4_to_bf16.yaml"
REFERENCE = "needs the 'reference' extra: pip install torch==2.13.0 -e '.[test,reference]'"




def convert(rule: Path, source: Path, out: Path) -> dict[str, torch.Tensor]:
    api.apply(rule, out=out, sources={"model": str(source)}, progress=False)
    return read_output(out)


# ------------------------------------------------------------------------------ FP8


@pytest.mark.parametrize("divisor, layers, experts, block, seed", [
    (16, 2, 3, None, 5),          # the real block grid at 1/16 (block 8): [36, 448] / [5, 56]
    (32, 3, 2, (16, 24), 9),      # rectangular blocks dividing nothing: partial edges everywhere
    (8, 2, 2, (128, 128), 2),     # the real block size on 1/8 widths: every tensor one partial block wide
])
def test_fp8_rule_matches_the_block_loop(tmp_path: Path, divisor: int, layers: int, experts: int,
                                         block: tuple[int, int] | None, seed: int) -> None:
    dims = KIMI_K2_TEXT.scaled(divisor, layers=layers, routed_experts=experts, experts_per_token=1, vocab=320)
    src = build_kimi_k2(tmp_path / "src", dims, block=block, num_shards=7, seed=seed).path
    bh, bw = json.loads((src / "config.json").read_text())["quantization_config"]["weight_block_size"]
    source = read_output(src)
    got = convert(FP8_RULE, src, tmp_path / "out")
    scales = {k for k in source if k.endswith(".weight_scale_inv")}
    assert scales and set(got) == set(source) - scales
    partial = 0
    for key, value in source.items():
        if key in scales:
            continue
        if value.dtype == torch.float8_e4m3fn:
            scale = source[key + "_scale_inv"]
            partial += value.shape[0] % bh != 0 or value.shape[1] % bw != 0
            assert same_bits(got[key], fp8_reference(value, scale, (bh, bw), torch.bfloat16)), key
        else:
            assert same_bits(got[key], value), key  # copied untouched, float32 bias included
    assert partial  # the case transformers' Fp8Dequantize gets wrong is in every variant
    assert got["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["hidden_size"] == dims.hidden


def test_fp8_rule_audit_names_both_inputs_and_the_op(tmp_path: Path) -> None:
    src = build_kimi_k2(tmp_path / "src", num_shards=3).path
    api.apply(FP8_RULE, out=tmp_path / "out", sources={"model": str(src)}, progress=False)
    audit = read_audit(tmp_path / "out")
    kv_a = "model.layers.0.self_attn.kv_a_proj_with_mqa"
    written = next(e for e in audit if e["event"] == "written" and e["key"] == f"{kv_a}.weight")
    assert written["dtype"] == "BF16" and written["shape"] == [36, 448]
    assert [i["key"] for i in written["from"]["inputs"]] == [f"{kv_a}.weight", f"{kv_a}.weight_scale_inv"]
    assert written["from"]["ops"] == ["dequant_fp8_block over T to bfloat16"]
    records = {e["key"]: e for e in audit if e["event"] == "tensor"}
    assert records[f"{kv_a}.weight_scale_inv"]["target"] == f"{kv_a}.weight"
    assert (records[f"{kv_a}.weight"]["action"], records[f"{kv_a}.weight"]["reason"].split(" -> ")[0]) == (
        "transformed", "dequant_fp8_block over T to bfloat16")
    # a BF16 weight the op passes through is recorded as what happened to it: loaded, not transformed
    norm = records["model.norm.weight"]
    assert (norm["action"], norm["target"], norm["reason"]) == ("loaded", "model.norm.weight",
                                                                "matched -> 'model.norm.weight'")
    assert len(records) == len(read_output(src))  # every source tensor accounted for


def test_fp8_rule_is_an_extends_base(tmp_path: Path) -> None:
    """A variant in a few lines: float16 output, lm_head kept in float32."""
    src = build_kimi_k2(tmp_path / "src", num_shards=2).path
    variant = tmp_path / "variant.yaml"
    variant.write_text(f"""version: 1
extends: {FP8_RULE}
name: fp8-to-fp16
tensors:
  - match: 'lm_head\\.weight'
    cast: float32
  - key: '{{X*}}.{{T:weight,weight_scale_inv}}'
    to: '{{X}}.weight'
    ops: [{{dequant_fp8_block: {{over: T, dtype: float16}}}}]
""")
    got = convert(variant, src, tmp_path / "out")
    source = read_output(src)
    key = "model.layers.1.mlp.experts.0.up_proj.weight"
    assert same_bits(got[key], fp8_reference(source[key], source[key + "_scale_inv"], (8, 8), torch.float16))
    assert same_bits(got["lm_head.weight"], source["lm_head.weight"].float())


# ----------------------------------------------------------------------------- int4


def ct_reference(root: Path) -> dict[str, torch.Tensor]:
    convert_mod = pytest.importorskip("compressed_tensors.entrypoints.convert", reason=REFERENCE)
    return convert_mod.CompressedTensorsDequantizer(str(root)).validate(read_output(root))


@pytest.mark.reference
@pytest.mark.parametrize("layout, seed", [("k25", 3), ("k25-wide", 4), ("k2-thinking", 8)])
def test_int4_rule_matches_compressed_tensors(tmp_path: Path, layout: str, seed: int) -> None:
    if layout == "k2-thinking":  # top-level quantization_config, group 32
        dims = KIMI_K2_TEXT.scaled(32, layers=2, routed_experts=3, experts_per_token=1, vocab=300)
        src = build_kimi_k2(tmp_path / "src", dims, quantization="int4", num_shards=9, seed=seed).path
    else:  # multimodal wrapper, text_config.quantization_config
        dims = KIMI_K2_TINY if layout == "k25" else KIMI_K2_TINY.scaled(hidden=128, verifier_layers=4)
        src = build_kimi_k25_verifier(tmp_path / "src", dims, num_shards=64 if layout == "k25" else 5,
                                      seed=seed).path
    want = ct_reference(src)
    got = convert(INT4_RULE, src, tmp_path / "out")
    assert set(got) == set(want)
    assert any(k.endswith("experts.0.down_proj.weight") for k in got)
    for key in want:
        assert same_bits(got[key], want[key]), key
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and "quantization_config" not in config.get("text_config", {})


def packed_by_compressed_tensors(root: Path, symmetric: bool, group: int, seed: int) -> None:
    """A checkpoint whose int4 modules compressed-tensors' own compressor wrote."""
    pq = pytest.importorskip("compressed_tensors.compressors.pack_quantized", reason=REFERENCE)
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {"model.norm.weight": torch.ones(64, dtype=torch.bfloat16)}
    for i, (rows, cols) in enumerate([(64, 96), (40, 64), (24, 192)]):
        w = (0.02 * torch.randn(rows, cols, generator=gen)).to(torch.bfloat16)
        groups = w.float().view(rows, cols // group, group)
        if symmetric:
            state = {"weight": w, "weight_scale": (groups.abs().amax(2) / 7).to(torch.bfloat16)}
        else:
            lo, hi = groups.amin(2), groups.amax(2)
            scale = ((hi - lo) / 15).to(torch.bfloat16)
            zp = torch.clamp(torch.round(-8 - lo / scale.float()), -8, 7).to(torch.int8)
            state = {"weight": w, "weight_scale": scale, "weight_zero_point": zp}
        packed = pq.PackedQuantizationCompressor.compress(state, scheme)
        tensors.update({f"model.layers.{i}.mlp.experts.0.up_proj.{k}": v for k, v in packed.items()})
    root.mkdir()
    save_file(tensors, str(root / "model.safetensors"))
    quant = int4_quantization_config(group)
    quant["config_groups"]["group_0"]["weights"]["symmetric"] = symmetric
    (root / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "quantization_config": quant}))


@pytest.mark.reference
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_rule_on_a_source_compressed_tensors_packed(tmp_path: Path, symmetric: bool) -> None:
    packed_by_compressed_tensors(tmp_path / "src", symmetric, 32, seed=int(symmetric))
    convert_mod = pytest.importorskip("compressed_tensors.entrypoints.convert", reason=REFERENCE)
    from safetensors.torch import load_file

    want = convert_mod.CompressedTensorsDequantizer(str(tmp_path / "src")).validate(
        load_file(str(tmp_path / "src" / "model.safetensors")))
    got = convert(INT4_RULE, tmp_path / "src", tmp_path / "out")
    assert set(got) == set(want) and len(got) == 4
    for key in want:
        assert same_bits(got[key], want[key]), key


# ----------------------------------------------------------------------- transformers


def loading_info(out: Path) -> dict[str, Any]:
    transformers = pytest.importorskip("transformers", reason=REFERENCE)
    config = json.loads((out / "config.json").read_text())
    config["model_type"] = "deepseek_v3"  # kimi_k2 is DeepSeek-V3 (its own code is remote)
    cfg = transformers.DeepseekV3Config(**{k: v for k, v in config.items() if k not in ("architectures",)})
    _, info = transformers.DeepseekV3ForCausalLM.from_pretrained(out, config=cfg, output_loading_info=True)
    return info


@pytest.mark.reference
@pytest.mark.parametrize("quantization", ["fp8", "int4"])
def test_transformers_loads_the_bf16_output(tmp_path: Path, quantization: str) -> None:
    dims = KIMI_K2_TEXT.scaled(32, layers=2, routed_experts=4, experts_per_token=2, vocab=256)
    src = build_kimi_k2(tmp_path / "src", dims, quantization=quantization, num_shards=4).path
    rule = FP8_RULE if quantization == "fp8" else INT4_RULE
    api.apply(rule, out=tmp_path / "out", sources={"model": str(src)}, progress=False)
    info = loading_info(tmp_path / "out")
    assert info["missing_keys"] == set() or info["missing_keys"] == []
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info


# ------------------------------------------------------------------------------ errors


def broken_copy(src: Path, dst: Path, *, drop: str | None = None,
                quantization: dict[str, Any] | None = None) -> Path:
    """A copy of the stand-in ``src`` without tensor ``drop``, or with another
    ``quantization_config`` (``{}``: none at all)."""
    import shutil

    from safetensors.torch import load_file

    shutil.copytree(src, dst)
    if drop is not None:
        index_path = dst / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        shard = index["weight_map"].pop(drop)
        save_file({k: v for k, v in load_file(str(dst / shard)).items() if k != drop}, str(dst / shard))
        index_path.write_text(json.dumps(index))
    if quantization is not None:
        config = json.loads((dst / "config.json").read_text())
        target = config["text_config"] if "text_config" in config else config
        target.pop("quantization_config")
        if quantization:
            target["quantization_config"] = quantization
        (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def k2_fp8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_kimi_k2(tmp_path_factory.mktemp("k2") / "Kimi-K2-Instruct", num_shards=5).path


@pytest.fixture(scope="module")
def k25_int4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_kimi_k25_verifier(tmp_path_factory.mktemp("k25") / "Kimi-K2.5", KIMI_K2_TINY, num_shards=5).path


KV_A = "model.layers.0.self_attn.kv_a_proj_with_mqa"
DOWN = "model.layers.0.mlp.down_proj"
EXPERT = "language_model.model.layers.2.mlp.experts.1.up_proj"
K25_DOWN = "language_model.model.layers.1.mlp.experts.0.down_proj"
def _op_line(rule: Path, verb: str) -> int:
    return next(i for i, line in enumerate(rule.read_text().splitlines(), 1) if line.strip().startswith(f"- {verb}"))


FP8_AT = f"tensors[0].ops[0] dequant_fp8_block ({{rule}}:{_op_line(FP8_RULE, 'dequant_fp8_block')}): "
INT4_AT = f"tensors[0].ops[0] dequant_int4 ({{rule}}:{_op_line(INT4_RULE, 'dequant_int4')}): "


def int4_config(k25: Path, **weights: Any) -> dict[str, Any]:
    quant = json.loads((k25 / "config.json").read_text())["text_config"]["quantization_config"]
    quant["config_groups"]["group_0"]["weights"].update(weights)
    return quant


@pytest.mark.parametrize("case", ["missing scale", "orphan scale", "block size", "not fp8", "no config",
                                  "int4 missing scale", "int4 ignored", "int4 group size"])
def test_a_source_the_rule_cannot_explain_fails_with_one_line_naming_the_key(
        case: str, k2_fp8: Path, k25_int4: Path, tmp_path: Path, run_cli: Any) -> None:
    fp8_quant = json.loads((k2_fp8 / "config.json").read_text())["quantization_config"]
    cases = {
        "missing scale": (FP8_RULE, lambda d: broken_copy(k2_fp8, d, drop=f"{KV_A}.weight_scale_inv"),
                          FP8_AT + f"missing scale: '{KV_A}.weight' is F8_E4M3 but the source has no "
                          f"'{KV_A}.weight_scale_inv'"),
        "orphan scale": (FP8_RULE, lambda d: broken_copy(k2_fp8, d, drop=f"{KV_A}.weight"),
                         FP8_AT + f"orphan scale: '{KV_A}.weight_scale_inv' has no weight '{KV_A}.weight' to "
                         "scale; drop the scale with a skip rule if that is intended"),
        "block size": (FP8_RULE, lambda d: broken_copy(k2_fp8, d, quantization={**fp8_quant,
                                                                                "weight_block_size": [16, 16]}),
                       FP8_AT + f"'{DOWN}.weight_scale_inv' has shape [56, 144], but weight_block_size [16, 16] "
                       f"of '{DOWN}.weight' [448, 1152] needs [28, 72]: the quantization_config does not match "
                       "the tensors"),
        "not fp8": (FP8_RULE, lambda d: broken_copy(k2_fp8, d, quantization={"quant_method": "bitsandbytes"}),
                    FP8_AT + "quantization_config.quant_method is 'bitsandbytes', not 'fp8'; this rule "
                    "dequantizes FP8 block-scaled checkpoints"),
        "no config": (FP8_RULE, lambda d: broken_copy(k2_fp8, d, quantization={}),
                      FP8_AT + "the converted source's config has no quantization_config (nor "
                      "text_config.quantization_config); this rule needs one"),
        "int4 missing scale": (INT4_RULE, lambda d: broken_copy(k25_int4, d, drop=f"{EXPERT}.weight_scale"),
                               INT4_AT + f"missing scale: '{EXPERT}.weight_scale' is missing beside "
                               f"'{EXPERT}.weight_packed' (text_config.quantization_config.config_groups.group_0 "
                               "needs weight_packed, weight_scale, weight_shape)"),
        "int4 ignored": (INT4_RULE, lambda d: broken_copy(k25_int4, d, quantization={
            **int4_config(k25_int4), "ignore": ["re:.*experts.*"]}),
            INT4_AT + f"'{K25_DOWN}.weight_packed' is quantized but text_config.quantization_config.ignore "
            "lists 're:.*experts.*': the config does not describe this module"),
        "int4 group size": (INT4_RULE, lambda d: broken_copy(k25_int4, d, quantization=int4_config(
            k25_int4, group_size=32)),
            INT4_AT + f"'{K25_DOWN}.weight_scale' [112, 2] with group_size 32 (text_config.quantization_config) "
            f"means 64 columns, but '{K25_DOWN}.weight_packed' [112, 4] holds 32 columns: the quantization_config "
            "does not match the tensors"),
    }
    rule, make, message = cases[case]
    src = make(tmp_path / "src")
    before = sorted((p.name, p.stat().st_mtime_ns) for p in src.iterdir())
    out = tmp_path / "out"
    proc = run_cli("apply", rule, "--source", f"model={src}", "--out", out)
    assert_clean_failure(proc, 1)
    assert error_lines(proc.stderr) == ["error: " + message.format(rule=rule)]
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["src"]  # no output, no temp sibling
    assert sorted((p.name, p.stat().st_mtime_ns) for p in src.iterdir()) == before


def test_a_weight_shape_that_disagrees_fails_apply_with_no_output(k25_int4: Path, tmp_path: Path,
                                                                  run_cli: Any) -> None:
    """weight_shape's values are read when the module is written: the run fails, and the
    output never appears."""
    from safetensors.torch import load_file

    src = broken_copy(k25_int4, tmp_path / "src")
    shard = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][f"{K25_DOWN}.weight_shape"]
    tensors = load_file(str(src / shard))
    tensors[f"{K25_DOWN}.weight_shape"] = torch.tensor([112, 30], dtype=torch.int32)
    save_file(tensors, str(src / shard))
    out = tmp_path / "out"
    proc = run_cli("apply", INT4_RULE, "--source", f"model={src}", "--out", out)
    assert_clean_failure(proc, 1)
    assert error_lines(proc.stderr) == [
        "error: " + INT4_AT.format(rule=INT4_RULE) + f"'{K25_DOWN}.weight_shape' says [112, 30], but weight_packed "
        "and weight_scale make [112, 32]: the quantization_config does not match the tensors"]
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["src"]
