"""rules/mxfp4_to_bf16.yaml against transformers, the reference: on gpt-oss stand-ins of
sizes, seeds and shard counts the rule was not written for (odd group counts, GQA, 3 to 5
experts), ``GptOssForCausalLM.from_pretrained(src,
quantization_config=Mxfp4Config(dequantize=True))`` on CPU holds exactly our output, every
tensor bit for bit (the -0 codes included), and transformers loads our output, now without
any quantizer, with no missing or unexpected keys. The stand-ins' codes and scales are
quantized from seeded random weights (standins/gpt_oss.py), not picked by the tests.

And every scale byte under every code byte, through the whole rule (the overflowing scales
allowed), against ``convert_moe_packed_tensors``, the function that from_pretrained calls.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import read_output, same_bits
from safetensors.numpy import save_file

from ckptxform import api
from ckptxform.standins.gpt_oss import GptOssDims, build_gpt_oss, gpt_oss_config

RULE = Path(__file__).resolve().parents[1] / "rules" / "mxfp4_to_bf16.yaml"
REFERENCE = "needs the 'reference' extra: pip install torch==2.13.0 -e '.[test,reference]'"

pytestmark = pytest.mark.reference


def from_pretrained(path: Path, **kwargs):
    transformers = pytest.importorskip("transformers", reason=REFERENCE)
    model, info = transformers.GptOssForCausalLM.from_pretrained(path, output_loading_info=True,
                                                                 dtype=torch.bfloat16, **kwargs)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set()), info
    return model.state_dict()


@pytest.mark.parametrize("dims, seed, shards", [
    (GptOssDims(), 3, 3),
    (GptOssDims(hidden=160, intermediate=64, layers=3, experts=5, heads=6, kv_heads=2, head_dim=24), 8, 4),
    (GptOssDims(hidden=32, intermediate=224, experts=3, heads=2, kv_heads=1, head_dim=8, vocab=130), 21, 1),
])
def test_the_output_is_what_transformers_dequantizes_and_loads_strictly(tmp_path: Path, dims: GptOssDims,
                                                                        seed: int, shards: int) -> None:
    transformers = pytest.importorskip("transformers", reason=REFERENCE)
    src = build_gpt_oss(tmp_path / "src", dims, seed=seed, num_shards=shards).path
    api.apply(RULE, out=tmp_path / "out", sources={"model": str(src)}, progress=False)
    got = read_output(tmp_path / "out")
    want = from_pretrained(src, quantization_config=transformers.Mxfp4Config(dequantize=True))
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert same_bits(got[key], value), key
    gate_up = got["model.layers.0.mlp.experts.gate_up_proj"]
    assert tuple(gate_up.shape) == (dims.experts, dims.hidden, 2 * dims.intermediate)
    negative_zero = (gate_up == 0) & gate_up.signbit()
    assert negative_zero.any()  # -0 codes are there, and kept (same bits as the reference)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config
    reloaded = from_pretrained(tmp_path / "out")  # no quantizer now: a plain bf16 gpt-oss
    assert all(same_bits(reloaded[key], value) for key, value in got.items())


@pytest.mark.parametrize("dtype, torch_dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                                ("float32", torch.float32)])
def test_every_code_under_every_scale_is_convert_moe_packed_tensors(tmp_path: Path, dtype: str,
                                                                   torch_dtype: torch.dtype) -> None:
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4", reason=REFERENCE)
    dims = GptOssDims(hidden=1024, intermediate=32, layers=1, experts=2)
    rng = np.random.default_rng(5)
    # gate_up [E = 2, 2I = 64, G = 32, 16]: 4,096 groups, 16 under each scale byte holding
    # every code byte once, in a shuffled order (so that the layout matters); down_proj random
    order = rng.permutation(4096)
    blocks = np.tile(np.arange(256, dtype=np.uint8).reshape(16, 16), (256, 1))[order]
    scales = np.repeat(np.arange(256, dtype=np.uint8), 16)[order]
    src = tmp_path / "src"
    src.mkdir()
    p = "model.layers.0.mlp.experts."
    tensors = {f"{p}gate_up_proj_blocks": blocks.reshape(2, 64, 32, 16),
               f"{p}gate_up_proj_scales": scales.reshape(2, 64, 32),
               f"{p}down_proj_blocks": rng.integers(0, 256, (2, 1024, 1, 16), dtype=np.uint8),
               f"{p}down_proj_scales": rng.integers(0, 256, (2, 1024, 1), dtype=np.uint8)}
    save_file(tensors, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps(gpt_oss_config(dims)))
    rule = tmp_path / "rule.yaml"
    rule.write_text(RULE.read_text().replace("dequant_mxfp4: {over: T}",
                                             f"dequant_mxfp4: {{over: T, dtype: {dtype}, allow_nonfinite: true}}"))
    api.apply(rule, out=tmp_path / "out", sources={"model": str(src)}, progress=False)
    got = read_output(tmp_path / "out")
    for proj in ("gate_up_proj", "down_proj"):
        want = mxfp4.convert_moe_packed_tensors(torch.from_numpy(tensors[f"{p}{proj}_blocks"]),
                                                torch.from_numpy(tensors[f"{p}{proj}_scales"]), dtype=torch_dtype)
        assert same_bits(got[f"{p}{proj}"], want), proj
        assert want.isinf().any() and not want.isnan().any()  # the overflows are in, and no scale is NaN
