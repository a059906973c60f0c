"""fp8_block_to_nvfp4 and fp8_block_to_w4a16 against the two-step reference (issue 40 item 3).

On FP8 block-scaled Kimi-K2 stand-ins (the real 128x128 blocks, kv_a_proj's 144 rows a
partial block, MoE experts, a 301-row vocabulary, two seeds), each rule's output must be,
byte for byte and with config.json (its quantization_config included) equal:

- two steps: compressed-tensors 0.20's ``FP8BlockDequantizer`` (its checkpoint converter:
  float32 product per block, then bfloat16) writes a bf16 checkpoint, and llm-compressor
  0.14's ``model_free_ptq`` (scheme NVFP4A16 or W4A16, the rule's ignore list, on the CPU)
  quantizes it;
- one call: ``model_free_ptq`` given that dequantizer as its ``converter`` (llm-compressor's
  own requantizing path).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, assert_same_checkpoint, read_output
from safetensors.torch import save_file

from ckptxform import api
from ckptxform.standins import build_kimi_k2
from ckptxform.standins.for_rules import KIMI_K2_REQUANT

pytestmark = pytest.mark.reference
pytest.importorskip("compressed_tensors", reason="the reference extra (compressed-tensors) is not installed")

RULES = REPO / "rules"
SCHEMES = {"fp8_block_to_nvfp4": "NVFP4A16", "fp8_block_to_w4a16": "W4A16"}


@pytest.fixture(scope="module", params=[1, 6], ids=lambda seed: f"seed{seed}")
def fp8_source(request: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_kimi_k2(tmp_path_factory.mktemp("fp8") / "Kimi-K2-Instruct", KIMI_K2_REQUANT, block=(128, 128),
                         num_shards=2, seed=request.param).path


def _ignore(stem: str) -> list[str]:
    import yaml

    base = yaml.safe_load((RULES / f"{stem}.yaml").read_text())["extends"]
    return yaml.safe_load((RULES / f"{base}.yaml").read_text())["config"]["set"]["quantization_config"]["ignore"]


def _dequantizer(source: Path) -> Any:
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer

    block = json.loads((source / "config.json").read_text())["quantization_config"]["weight_block_size"]
    return FP8BlockDequantizer.from_pretrained(str(source), weight_block_size=tuple(block), dtype=torch.bfloat16)


def _dequantized_by_compressed_tensors(source: Path, out: Path) -> Path:
    """Step one: the bf16 checkpoint compressed-tensors' FP8 block dequantizer makes."""
    tensors = _dequantizer(source).validate(read_output(source))
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out


def _model_free(source: Path, out: Path, stem: str, converter: Any = None) -> Path:
    model_free = pytest.importorskip("llmcompressor.entrypoints.model_free",
                                     reason="llm-compressor (installed --no-deps) is not installed")
    model_free.model_free_ptq(str(source), str(out), scheme=SCHEMES[stem], ignore=_ignore(stem), max_workers=1,
                              device="cpu", converter=converter)
    return out


@pytest.mark.parametrize("stem", sorted(SCHEMES))
def test_one_rule_is_the_reference_dequantizer_then_model_free_ptq(stem: str, fp8_source: Path,
                                                                  tmp_path: Path) -> None:
    ours = tmp_path / "ours"
    api.apply(RULES / f"{stem}.yaml", out=ours, sources={"model": str(fp8_source)}, progress=False)
    bf16 = _dequantized_by_compressed_tensors(fp8_source, tmp_path / "bf16")
    assert_same_checkpoint(ours, _model_free(bf16, tmp_path / "two_steps", stem))
    one_call = _model_free(fp8_source, tmp_path / "one_call", stem, converter=_dequantizer(fp8_source))
    shutil.rmtree(bf16)
    assert_same_checkpoint(ours, one_call)
