"""fp8_to_bf16 and nvfp4_to_bf16 on sources the quantizing libraries made themselves, against
each library's own dequantizer, bit for bit (tests/scaled_sources.py makes both in a
subprocess):

- llm-compressor presets FP8 (static, per tensor, with input_scale), FP8_DYNAMIC (per
  channel; a bf16 and a float32 model, so bf16 and float32 scales), FP8_BLOCK, NVFP4A16 and
  NVFP4 (with input_global_scale), and a mixed checkpoint (FP8_DYNAMIC attention group,
  NVFP4A16 MLP group), against compressed-tensors' CompressedTensorsDequantizer;
- ModelOpt's NVFP4 export (mtq.quantize + export_hf_checkpoint on CPU), against ModelOpt's
  NVFP4QTensor.dequantize (compressed-tensors' converter for that format computes in bf16
  and is not the reference).

Widths not powers of two, GQA, two seeds each; transformers loads every output with no
missing or unexpected keys.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, read_output, same_bits
from safetensors.torch import load_file

from ckptxform import api

pytestmark = pytest.mark.reference

#: [hidden, heads, kv_heads, head_dim, intermediate]: GQA 5:1 and 6:2, every width a multiple of 16 (NVFP4)
NVFP4_DIMS = [([80, 5, 1, 16, 144], 0), ([48, 6, 2, 8, 112], 1)]
#: FP8 has no group: odd widths
FP8_DIMS = [([36, 3, 1, 12, 90], 2), ([80, 5, 1, 16, 144], 3)]
CASES = [("model_free", "FP8_DYNAMIC", "bfloat16", d) for d in FP8_DIMS] + [
    ("model_free", "FP8_DYNAMIC", "float32", FP8_DIMS[0]),
    ("model_free", "FP8_BLOCK", "bfloat16", FP8_DIMS[1]),
    ("oneshot", "FP8", "bfloat16", FP8_DIMS[0]),
    ("oneshot", "FP8", "float32", FP8_DIMS[1]),
] + [("model_free", "NVFP4A16", "bfloat16", d) for d in NVFP4_DIMS] + [
    ("oneshot", "NVFP4", "bfloat16", NVFP4_DIMS[0]),
] + [("mixed", "FP8_DYNAMIC+NVFP4A16", "bfloat16", d) for d in NVFP4_DIMS] + [
    ("modelopt", "NVFP4", "bfloat16", d) for d in NVFP4_DIMS]


def needs(*modules: str) -> None:
    for module in modules:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module}: pip install -e '.[reference]' and --no-deps -r .ci/reference-nodeps.txt")


def made(root: Path, maker: str, scheme: str, dtype: str, dims: list[int], seed: int) -> Path:
    needs(*(["modelopt", "omegaconf", "pulp", "scipy"] if maker == "modelopt" else ["llmcompressor", "datasets"]))
    spec = {"maker": maker, "scheme": scheme, "dtype": dtype, "dims": dims, "seed": seed}
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "scaled_sources.py"), str(root), json.dumps(spec)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def loading_info(out: Path) -> dict[str, Any]:
    transformers = pytest.importorskip("transformers")
    _, info = transformers.LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    return info


@pytest.mark.parametrize(("maker", "scheme", "dtype", "dims"), CASES,
                         ids=[f"{m}-{s}-{t}-{d[0][0]}-s{d[1]}" for m, s, t, d in CASES])
def test_rule_equals_the_library_dequantizer(tmp_path: Path, maker: str, scheme: str, dtype: str,
                                             dims: tuple[list[int], int]) -> None:
    root = made(tmp_path, maker, scheme, dtype, *dims)
    rule = "fp8_to_bf16" if scheme.startswith("FP8") and "NVFP4" not in scheme else "nvfp4_to_bf16"
    api.apply(REPO / "rules" / f"{rule}.yaml", out=tmp_path / "out", sources={"model": str(root / "src")},
              progress=False)
    got, want = read_output(tmp_path / "out"), load_file(str(root / "reference.safetensors"))
    assert set(got) == set(want)
    quantized = {k for k in tensors_keys(root / "src") if k.endswith(".weight_scale")}
    assert len(quantized) == 14  # 7 Linear modules a layer, 2 layers
    for key in sorted(want):
        assert got[key].dtype == torch.bfloat16 or got[key].dtype == want[key].dtype, key
        assert same_bits(got[key], want[key].to(got[key].dtype)), key
    if maker == "modelopt":  # its export has e2m1 code 8, which ModelOpt's table reads as +0.0
        packed = torch.cat([v.flatten() for k, v in read_output(root / "src").items()
                            if k.endswith(".weight") and v.dtype == torch.uint8])
        assert int(((packed & 0xF) == 8).sum() + ((packed >> 4) == 8).sum())
    info = loading_info(tmp_path / "out")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())


def tensors_keys(src: Path) -> set[str]:
    return set(read_output(src))
