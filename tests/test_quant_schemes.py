"""Reading quantization_config: where it is, what is refused (exact messages), and which
modules a compressed-tensors config quantizes (compared with compressed-tensors' own
name matching)."""

from __future__ import annotations

from typing import Any

import pytest

from ckptxform.engine.plan.references import MISSING, get_path
from ckptxform.errors import QuantizationConfigError
from ckptxform.quant.group_schemes import GroupSchemes, WeightScheme
from ckptxform.quant.schemes import CompressedConfig, Found, Fp8BlockConfig, find_quantization_config
from ckptxform.standins.configs import int4_quantization_config

FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def lookup(config: dict[str, Any]) -> Found | None:
    def at(path: str) -> Any:
        value = get_path(config, path)
        return None if value is MISSING else value
    return find_quantization_config(at)


def test_the_config_is_found_where_vllm_and_compressed_tensors_look() -> None:
    assert lookup({"quantization_config": FP8}) == Found("quantization_config", FP8)
    assert lookup({"text_config": {"quantization_config": FP8}}) == Found("text_config.quantization_config", FP8)
    assert lookup({"compression_config": FP8}) == Found("compression_config", FP8)
    both = {"quantization_config": FP8, "text_config": {"quantization_config": {}}}
    assert lookup(both) == Found("quantization_config", FP8)  # the top level wins, as in both loaders
    assert lookup({"hidden_size": 8}) is None
    with pytest.raises(QuantizationConfigError, match=r"^quantization_config is list \[1\], not an object$"):
        lookup({"quantization_config": [1]})


def test_fp8_block_size_and_modules_not_converted() -> None:
    parsed = Fp8BlockConfig.parse(Found("quantization_config", {**FP8, "modules_to_not_convert": ["lm_head"]}))
    assert parsed.block == (128, 128)
    assert not parsed.converts("lm_head") and not parsed.converts("model.lm_head")
    assert parsed.converts("model.layers.0.mlp.down_proj")


@pytest.mark.parametrize("change, message", [
    ({"quant_method": "gptq"}, "quantization_config.quant_method is 'gptq', not 'fp8'; this rule dequantizes "
                               "FP8 block-scaled checkpoints"),
    ({"fmt": "e5m2"}, "quantization_config.fmt is 'e5m2'; only 'e4m3' weights are supported"),
    ({"weight_block_size": None}, "quantization_config.weight_block_size is None; block-scaled FP8 needs "
                                  "[rows, cols] of positive integers (per-tensor FP8 is not this format)"),
    ({"weight_block_size": [128, 0]}, "quantization_config.weight_block_size is [128, 0]; block-scaled FP8 "
                                      "needs [rows, cols] of positive integers (per-tensor FP8 is not this format)"),
])
def test_fp8_configs_that_are_not_block_scaled_e4m3_are_refused(change: dict[str, Any], message: str) -> None:
    with pytest.raises(QuantizationConfigError) as err:
        Fp8BlockConfig.parse(Found("quantization_config", {**FP8, **change}))
    assert str(err.value) == message


def int4(**weights: Any) -> dict[str, Any]:
    config = int4_quantization_config(32)
    config["config_groups"]["group_0"]["weights"].update(weights)
    return config


@pytest.mark.parametrize("config, message", [
    ({**int4(), "quant_method": "awq"}, "q.quant_method is 'awq', not 'compressed-tensors'; this rule "
                                        "dequantizes pack-quantized int4"),
    ({**int4(), "format": "float-quantized"}, "q.config_groups.group_0: format 'float-quantized' is not "
                                              "'pack-quantized'"),
    (int4(num_bits=8), "q.config_groups.group_0.weights.num_bits is 8; only num_bits 4 is supported (int4, per "
                       "group or channel)"),
    (int4(strategy="tensor"), "q.config_groups.group_0.weights.strategy is 'tensor'; only strategy 'group' or "
                              "'channel' is supported (int4, per group or channel)"),
    (int4(group_size=None), "q.config_groups.group_0.weights.group_size is None, not a positive integer"),
    ({**int4(), "config_groups": {}}, "q.config_groups is {}; it must name at least one group"),
    ({**int4(), "ignore": "lm_head"}, "q.ignore is 'lm_head', not a list of strings"),
])
def test_int4_configs_this_rule_cannot_read_are_refused(config: dict[str, Any], message: str) -> None:
    with pytest.raises(QuantizationConfigError) as err:
        CompressedConfig.parse(Found("q", config))
    assert str(err.value) == message


K25_MODULES = [
    "language_model.model.layers.1.mlp.experts.0.gate_proj",
    "language_model.model.layers.60.mlp.experts.383.down_proj",
    "language_model.model.layers.1.mlp.shared_experts.up_proj",
    "language_model.model.layers.0.mlp.gate_proj",
    "language_model.model.layers.3.self_attn.kv_a_proj_with_mqa",
    "language_model.lm_head",
    "lm_head",
    "vision_tower.encoder.blocks.0.wqkv",
    "mm_projector.proj.0",
]


@pytest.mark.reference
def test_ignore_entries_match_as_compressed_tensors_matches_them() -> None:
    match = pytest.importorskip("compressed_tensors.utils.match",
                                reason="needs the 'reference' extra: pip install torch==2.13.0 -e '.[test,reference]'")
    parsed = CompressedConfig.parse(Found("q", int4()))
    for module in K25_MODULES:
        theirs = any(match.match_name(module, entry) for entry in parsed.ignore)
        assert (parsed.ignored(module) is not None) == theirs, module
    quantized = [m for m in K25_MODULES if parsed.group_for(m, stored_quantized=True) is not None]
    assert quantized == K25_MODULES[:2]  # the routed experts, and nothing else


def test_targets_name_modules_by_regex_name_or_class() -> None:
    config = int4()
    config["config_groups"]["group_0"]["targets"] = ["re:.*experts\\.\\d+\\..*"]
    config["config_groups"]["group_1"] = {**config["config_groups"]["group_0"], "targets": ["model.layers.0.o"]}
    parsed = CompressedConfig.parse(Found("q", config))
    assert parsed.group_for("model.layers.1.mlp.experts.3.up_proj", stored_quantized=False).name == "group_0"
    assert parsed.group_for("model.layers.0.o", stored_quantized=False).name == "group_1"
    assert parsed.group_for("model.layers.0.q", stored_quantized=True) is None
    classy = CompressedConfig.parse(Found("q", int4()))  # targets ["Linear"]: no name to check
    assert classy.group_for("model.layers.0.q", stored_quantized=False) is None
    assert classy.group_for("model.layers.1.mlp.experts.0.up_proj", stored_quantized=True).group_size == 32


# ------------------------------------------------------- FP8 / NVFP4 groups, per module


def scaled(scheme: str) -> dict[str, Any]:
    from ckptxform.standins.scaled import scaled_quantization_config

    return scaled_quantization_config(scheme)  # type: ignore[arg-type]


def test_a_mixed_config_gives_each_module_its_group() -> None:
    parsed = GroupSchemes.parse(Found("q", scaled("mixed")))
    attn = parsed.group_for("model.layers.3.self_attn.k_proj", stored_quantized=True)
    mlp = parsed.group_for("model.layers.3.mlp.down_proj", stored_quantized=True)
    assert attn is not None and attn.readable() == WeightScheme("fp8", "channel", "compressed-tensors")
    assert mlp is not None and mlp.readable() == WeightScheme("nvfp4", "tensor_group", "compressed-tensors")
    assert parsed.group_for("lm_head", stored_quantized=True) is None and parsed.ignored("lm_head") == "lm_head"
    assert parsed.group_for("model.embed_tokens", stored_quantized=True) is None  # no target names it
    modelopt = GroupSchemes.parse(Found("q", scaled("nvfp4-modelopt")))
    assert modelopt.group_for("model.layers.0.mlp.up_proj", stored_quantized=True).readable().convention == "modelopt"
    assert modelopt.ignored("model.embed_tokens") == "model.embed_tokens"
    wild = GroupSchemes.parse(Found("q", {**scaled("nvfp4-modelopt"), "ignore": ["*.mlp.gate", "model.layers.1"]}))
    assert wild.ignored("model.layers.0.mlp.gate") == "*.mlp.gate"  # ModelOpt's fnmatch patterns
    assert wild.ignored("model.layers.1.self_attn.q_proj") == "model.layers.1"  # a parent excludes its children


@pytest.mark.parametrize("group, problem", [
    ({"format": "pack-quantized", "weights": {"num_bits": 4, "type": "int", "strategy": "group"}},
     "format 'pack-quantized' with 4-bit int weights, strategy 'group' is neither FP8 float-quantized nor NVFP4 "
     "(pack-quantized int4: rules/compressed_int4_to_bf16.yaml)"),
    ({"format": "mxfp4-pack-quantized", "weights": {"num_bits": 4, "type": "float", "strategy": "group"}},
     "format 'mxfp4-pack-quantized' with 4-bit float weights, strategy 'group' is neither FP8 float-quantized nor "
     "NVFP4"),
    ({"format": "nvfp4-pack-quantized", "weights": {"num_bits": 4, "type": "float", "strategy": "group",
                                                    "group_size": 32}},
     "format 'nvfp4-pack-quantized' with 4-bit float weights, strategy 'group', group_size 32: NVFP4 is strategy "
     "'tensor_group' with group_size 16"),
    ({"format": "float-quantized", "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                               "symmetric": False}},
     "format 'float-quantized' with 8-bit float weights, strategy 'channel': only symmetric weights with a stored "
     "scale (symmetric: true, dynamic: false) are read"),
    ({"format": "float-quantized", "weights": {"num_bits": 8, "type": "float", "strategy": "block"}},
     "format 'float-quantized' with 8-bit float weights, strategy 'block', block_structure None: FP8 weights are "
     "read per tensor, per channel or per block [rows, cols]"),
    ({"format": "float-quantized", "weights": None}, "weights is None: the group quantizes no weights"),
])
def test_a_group_that_cannot_be_read_is_refused_by_name_when_used(group: dict[str, Any], problem: str) -> None:
    config = scaled("mixed")
    config["config_groups"]["mlp"] = {"targets": ["re:.*mlp.*"], **group}
    parsed = GroupSchemes.parse(Found("q", config))  # parsed: the FP8 group still reads
    assert parsed.group_for("model.layers.0.self_attn.q_proj", stored_quantized=True).readable().kind == "fp8"
    with pytest.raises(QuantizationConfigError) as err:
        parsed.group_for("model.layers.0.mlp.up_proj", stored_quantized=True).readable()
    assert str(err.value) == f"q.config_groups.mlp cannot be read: {problem}"


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "fp8"}, "q.quant_method is 'fp8', not 'compressed-tensors' or 'modelopt'; this rule "
                              "dequantizes FP8 (weight_scale) and NVFP4"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": "Linear"}}},
     "q.config_groups.g.targets is 'Linear', not a list of strings"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "exclude_modules": "lm_head"},
     "q.ignore is 'lm_head', not a list of strings"),
])
def test_a_malformed_config_is_refused_at_once(config: dict[str, Any], message: str) -> None:
    with pytest.raises(QuantizationConfigError) as err:
        GroupSchemes.parse(Found("q", config))
    assert str(err.value) == message


@pytest.mark.reference
def test_targets_match_as_compressed_tensors_matches_them() -> None:
    match = pytest.importorskip("compressed_tensors.utils.match",
                                reason="needs the 'reference' extra: pip install torch==2.13.0 -e '.[test,reference]'")
    config = scaled("mixed")
    parsed = GroupSchemes.parse(Found("q", config))
    modules = ["model.layers.0.self_attn.q_proj", "model.layers.11.mlp.experts.3.down_proj", "lm_head",
               "model.layers.2.mlp.gate", "model.embed_tokens", "visual.blocks.0.attn.qkv"]
    for module in modules:
        theirs = next((name for name, g in config["config_groups"].items()
                       if any(match.match_name(module, t) for t in g["targets"])), None)
        if any(match.match_name(module, entry) for entry in config["ignore"]):
            theirs = None
        ours = parsed.group_for(module, stored_quantized=False)
        assert (ours.name if ours else None) == theirs, module
