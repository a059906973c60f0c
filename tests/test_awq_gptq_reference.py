"""awq_to_bf16, gptq_to_bf16 (and the repacking rules) against the libraries that define the formats.

- AWQ: AutoAWQ 0.2.9's ``awq.utils.packing_utils.dequantize_gemm`` (the CPU dequantizer its
  GEMM layout is defined by), on every module of the stand-in, groups of 32 and 16; the
  rule's bfloat16 output is its float16 result cast, and ``dtype: float16`` is its result byte
  for byte.
- GPTQ: auto-gptq 0.7.1's ``QuantLinear`` (``auto_gptq/nn_modules/qlinear/qlinear_cuda.py``),
  its CPU path (no CUDA extension: it unpacks, applies the v1 zero-point offset and ``g_idx``
  and multiplies in float16), run on the identity so its output is the dequantized weight
  (scales are positive, so no ``-0.0`` arises and the identity product is exact). auto-gptq's
  package ``__init__`` imports transformers 4 names that transformers 5 dropped, so the module
  file is loaded by itself; it needs only torch, numpy and transformers. desc_act on and off,
  symmetric and asymmetric (stored zero points up to 15: the zero point 16), groups of 32 and
  64 (64: a last group part-filled).

Both references are pinned in .ci/reference-nodeps.txt; in the reference step (``-m
reference``) a missing one fails these tests, elsewhere it skips them.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ckptxform import api
from ckptxform.standins.awq_gptq import build_awq_llama, build_gptq_llama
from conftest import read_output, same_bits

pytestmark = pytest.mark.reference
RULES = Path(__file__).resolve().parent.parent / "rules"
INSTALL = "pip install --no-deps -r .ci/reference-nodeps.txt (autoawq==0.2.9, auto-gptq==0.7.1)"


def _require(request: pytest.FixtureRequest, module: str) -> None:
    """Skip without ``module``, except in the reference step (``-m reference``), where it fails."""
    if importlib.util.find_spec(module) is None:
        message = f"the reference {module} is not installed: {INSTALL}"
        if "reference" in (request.config.getoption("markexpr") or ""):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture
def awq_reference(request: pytest.FixtureRequest) -> Any:
    _require(request, "awq")
    from awq.utils.packing_utils import dequantize_gemm

    return dequantize_gemm


@pytest.fixture
def gptq_quant_linear(request: pytest.FixtureRequest) -> Any:
    _require(request, "auto_gptq")
    path = Path(importlib.util.find_spec("auto_gptq").origin).parent / "nn_modules" / "qlinear" / "qlinear_cuda.py"
    spec = importlib.util.spec_from_file_location("auto_gptq_qlinear_cuda_reference", path)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.QuantLinear


def _modules(tensors: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k.removesuffix(".qweight") for k in tensors if k.endswith(".qweight"))


def _gptq_dequant(quant_linear: Any, parts: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    """auto-gptq's dequantized ``[in, out]`` weight of one module (its CPU forward on the identity)."""
    rows, cols = parts["qweight"].shape[0] * 8, parts["qweight"].shape[1]
    layer = quant_linear(4, group, rows, cols, False, weight_dtype=parts["scales"].dtype)
    for name in ("qweight", "qzeros", "scales", "g_idx"):
        getattr(layer, name).copy_(parts[name])
    with torch.no_grad():
        return layer(torch.eye(rows, dtype=parts["scales"].dtype))


@pytest.mark.parametrize("group", [32, 16])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_awq_to_bf16_is_autoawqs_dequantize_gemm(tmp_path: Path, awq_reference: Any, group: int, dtype: str) -> None:
    src = build_awq_llama(tmp_path / "awq", group=group, seed=group)
    out = tmp_path / "out"
    rule = RULES / "awq_to_bf16.yaml"
    if dtype != "bfloat16":
        text = rule.read_text().replace("dequant_awq: {over: T}", f"dequant_awq: {{over: T, dtype: {dtype}}}")
        rule = tmp_path / "awq_to_f16.yaml"
        rule.write_text(text)
    api.apply(rule, out=out, sources={"model": str(src)})
    source, got = load_file(str(src / "model.safetensors")), read_output(out)
    modules = _modules(source)
    assert len(modules) == 14
    for m in modules:
        ref = awq_reference(source[f"{m}.qweight"], source[f"{m}.qzeros"], source[f"{m}.scales"], 4, group)
        assert ref.dtype == torch.float16
        want = ref.T.contiguous().to(getattr(torch, dtype))
        assert same_bits(got[f"{m}.weight"], want), m
    for key, value in source.items():  # every other tensor as it was
        if key.rpartition(".")[0] not in modules:
            assert same_bits(got[key], value), key
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group", [32, 64])
def test_gptq_to_bf16_is_auto_gptqs_quant_linear(tmp_path: Path, gptq_quant_linear: Any, desc_act: bool, sym: bool,
                                                 group: int) -> None:
    src = build_gptq_llama(tmp_path / "gptq", group=group, desc_act=desc_act, sym=sym, zero_max=15,
                           seed=group + 2 * desc_act + sym)
    out = tmp_path / "out"
    api.apply(RULES / "gptq_to_bf16.yaml", out=out, sources={"model": str(src)})
    source, got = load_file(str(src / "model.safetensors")), read_output(out)
    modules = _modules(source)
    assert len(modules) == 14
    saw_16 = False
    for m in modules:
        parts = {p: source[f"{m}.{p}"] for p in ("qweight", "qzeros", "scales", "g_idx")}
        if desc_act:
            assert not bool((parts["g_idx"][1:] >= parts["g_idx"][:-1]).all()), "desc_act: g_idx not monotone"
        saw_16 |= bool(((parts["qzeros"].view(torch.uint8) & 0xF) == 15).any())
        ref = _gptq_dequant(gptq_quant_linear, parts, group)
        assert ref.dtype == torch.float16
        assert same_bits(got[f"{m}.weight"], ref.T.contiguous().to(torch.bfloat16)), m
    assert saw_16 or sym, "the asymmetric stand-in has stored zero points of 15 (the zero point 16)"


# ------------------------------------------------------------ repacking to compressed-tensors


@pytest.mark.parametrize("group", [32, 16])
def test_awq_to_compressed_int4_is_compressed_tensors_autoawq_converter(tmp_path: Path, request: pytest.FixtureRequest,
                                                                        group: int) -> None:
    """compressed-tensors 0.20's ``AutoAWQConverter`` (what its ``convert_checkpoint`` runs on
    each file): the same tensors byte for byte, and the same quantization_config."""
    _require(request, "compressed_tensors")
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
    from compressed_tensors.quantization import QuantizationConfig

    src = build_awq_llama(tmp_path / "awq", group=group, seed=3 * group)
    out = tmp_path / "out"
    api.apply(RULES / "awq_to_compressed_int4.yaml", out=out, sources={"model": str(src)})
    source_config = json.loads((src / "config.json").read_text())["quantization_config"]
    converter = AutoAWQConverter.from_autoawq_config(source_config)
    want = converter.process(dict(load_file(str(src / "model.safetensors"))))
    got = read_output(out)
    assert sorted(got) == sorted(want)
    for key in sorted(want):
        assert same_bits(got[key], want[key]), key
    written = json.loads((out / "config.json").read_text())["quantization_config"]
    assert QuantizationConfig.model_validate(written).model_dump() == converter.update_config(None).model_dump()


@pytest.mark.parametrize("sym", [True, False])
def test_gptq_to_compressed_int4_decompresses_to_auto_gptqs_weights(tmp_path: Path, request: pytest.FixtureRequest,
                                                                    gptq_quant_linear: Any, sym: bool) -> None:
    """compressed-tensors has no GPTQ converter: its ``PackedQuantizationCompressor.decompress``
    of each repacked module, under the quantization_config the rule writes, is auto-gptq's
    dequantized weight bit for bit (float16 both)."""
    _require(request, "compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    src = build_gptq_llama(tmp_path / "gptq", group=32, sym=sym, seed=7 + sym)
    out = tmp_path / "out"
    api.apply(RULES / "gptq_to_compressed_int4.yaml", out=out, sources={"model": str(src)})
    written = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    scheme = written.config_groups["config_group_0"]
    assert scheme.weights.symmetric is sym and scheme.weights.group_size == 32
    source, got = load_file(str(src / "model.safetensors")), read_output(out)
    modules = _modules(source)
    assert len(modules) == 14
    for m in modules:
        state = {p: got[f"{m}.{p}"] for p in ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
                 if f"{m}.{p}" in got}
        assert ("weight_zero_point" in state) is not sym
        parts = {p: source[f"{m}.{p}"] for p in ("qweight", "qzeros", "scales", "g_idx")}
        ref = _gptq_dequant(gptq_quant_linear, parts, 32).T.contiguous()
        assert same_bits(PackedQuantizationCompressor.decompress(state, scheme)["weight"], ref), m
