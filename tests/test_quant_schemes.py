"""Reading quantization_config: where it is, what is refused (exact messages), and which
modules a compressed-tensors config quantizes (compared with compressed-tensors' own
name matching)."""

from __future__ import annotations

from typing import Any

import pytest

from ckptxform.engine.plan.references import MISSING, get_path
from ckptxform.errors import QuantizationConfigError
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
    (int4(num_bits=8), "q.config_groups.group_0.weights.num_bits is 8; only num_bits 4 is supported (int4, per group)"),
    (int4(strategy="channel"), "q.config_groups.group_0.weights.strategy is 'channel'; only strategy 'group' is "
                               "supported (int4, per group)"),
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
