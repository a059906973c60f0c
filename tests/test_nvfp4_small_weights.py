"""Issue 37 item 3: NVFP4 global scales of small weights.

``2688 / absmax`` overflows F16 for an absmax below about 0.041; compressed-tensors'
``generate_gparam`` then falls back to 1.0 (what llm-compressor's model-free path writes for
an F16 model), and a third of such a weight dequantizes to 0. bf16_to_nvfp4 computes that
quotient in float32 instead, as ``generate_gparam`` does from float32 statistics, and
refuses a nonzero weight whose quotient overflows float32 too.

- Reference (compressed-tensors 0.20): on F16 and BF16 weights of small, tiny and subnormal
  magnitudes, a zero group beside a group of tiny values, and normal ones, every output
  tensor is what ``generate_gparam`` + ``calculate_qparams`` + ``NVFP4PackedCompressor``
  give (the global scale from the weight's own statistics, or from float32 ones where the
  weight's dtype overflows); decompressed, the issue's weight keeps its nonzero values;
  where F16 does not overflow, the output is llm-compressor's model_free_ptq output.
- A BF16 weight too small for a float32 scale (a subnormal one, or a normal one below
  about 7.9e-36) fails apply with one line naming it, exit 1,
  no output.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, assert_clean_failure, error_lines, read_output, same_bits
from safetensors.torch import save_file

RULE = REPO / "rules" / "bf16_to_nvfp4.yaml"
DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16}


def _weights(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One module per case, 48 columns (three NVFP4 groups), odd row counts."""
    g = torch.Generator().manual_seed(7)
    tiny = torch.finfo(dtype).tiny

    def spread(rows: int, top: float) -> torch.Tensor:
        return (torch.randn(rows, 48, generator=g) * top / 3).clamp(-top, top)

    zero_beside_tiny = spread(5, 1e-4)
    zero_beside_tiny[:, :16] = 0.0                                   # an all-zero group ...
    zero_beside_tiny[:, 16:32] = spread(5, 1e-6)[:, :16]              # ... beside a group of tiny values
    subnormal = spread(3, tiny * 0.5)                                  # below the dtype's smallest normal
    subnormal[0, 0] = tiny * 0.25
    cases = {"issue": spread(17, 0.011), "small": spread(9, 2e-3), "tiny": spread(7, 3e-5),
             "zero_beside_tiny": zero_beside_tiny, "normal": spread(11, 0.5), "zeros": torch.zeros(3, 48)}
    if dtype == torch.float16:  # BF16's subnormals are below any float32 scale: refused (the last test)
        cases["subnormal"] = subnormal
    return {f"model.layers.{i}.mlp.down_proj.weight": w.to(dtype) for i, w in enumerate(cases.values())}


def _checkpoint(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    return folder


def _compressed_tensors(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], Any]:
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    a = w.abs().amax().reshape(1)
    glob = generate_gparam(-a, a)
    if glob.item() == 1.0 and a.item() != 0.0:  # the weight's dtype overflowed: float32 statistics
        glob = generate_gparam(-a.float(), a.float())
    groups = w.unflatten(-1, (-1, 16))
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=glob)
    state = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": glob}, scheme)
    return state, scheme


@pytest.mark.reference
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_small_weights_are_what_compressed_tensors_computes_in_float32(dtype: str, tmp_path: Path) -> None:
    pytest.importorskip("compressed_tensors", reason="the reference extra (compressed-tensors) is not installed")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor

    from ckptxform import api

    weights = _weights(DTYPES[dtype])
    src = _checkpoint(tmp_path / "src", weights)
    api.apply(RULE, out=tmp_path / "out", sources={"model": str(src)}, progress=False)
    got = read_output(tmp_path / "out")
    for key, w in weights.items():
        module = key.removesuffix(".weight")
        want, scheme = _compressed_tensors(w)
        for part, value in want.items():
            assert same_bits(got[f"{module}.{part}"], value), (key, part)
        if key == "model.layers.0.mlp.down_proj.weight":  # the weight: absmax 0.011
            assert got[f"{module}.weight_global_scale"].item() > 1e5
            back = NVFP4PackedCompressor.decompress({p: got[f"{module}.{p}"] for p in want}, scheme)["weight"]
            lost = int(((back == 0) & (w != 0)).sum())  # e2m1 rounds |x| < max/24 of a group to 0: ~7%
            assert lost < w.numel() // 8, f"{lost} of {w.numel()} nonzero values dequantize to 0"


@pytest.mark.reference
def test_f16_weights_whose_quotient_fits_are_llm_compressors_output(tmp_path: Path) -> None:
    """Where F16 holds 2688 / absmax the scale is llm-compressor's, computed in F16; where it
    does not, llm-compressor writes 1.0 and the rule the float32 scale."""
    model_free = pytest.importorskip("llmcompressor.entrypoints.model_free",
                                     reason="llm-compressor (installed --no-deps) is not installed")
    from ckptxform import api

    weights = _weights(torch.float16)
    src = _checkpoint(tmp_path / "src", weights)
    model_free.model_free_ptq(str(src), str(tmp_path / "theirs"), scheme="NVFP4A16", max_workers=1, device="cpu")
    api.apply(RULE, out=tmp_path / "ours", sources={"model": str(src)}, progress=False)
    ours, theirs = read_output(tmp_path / "ours"), read_output(tmp_path / "theirs")
    assert sorted(ours) == sorted(theirs)
    differ = sorted({k.rsplit(".", 1)[0] for k in theirs if not same_bits(ours[k], theirs[k].contiguous())})
    overflowed = sorted(k.removesuffix(".weight") for k, w in weights.items()
                        if 0 < w.abs().max().item() < 2688 / 65504)
    assert differ == overflowed
    assert all(theirs[f"{m}.weight_global_scale"].item() == 1.0 for m in overflowed)


@pytest.mark.parametrize("top", [1e-37, 5e-39], ids=["normal", "subnormal"])
def test_a_weight_too_small_for_any_global_scale_is_refused(top: float, tmp_path: Path, run_cli: Any) -> None:
    """2688 / absmax overflows float32 (compressed-tensors would write 1.0: every value 0)."""
    w = torch.full((2, 16), top, dtype=torch.bfloat16)
    w[1, 3] = 0.0
    src = _checkpoint(tmp_path / "src", {"model.layers.0.mlp.down_proj.weight": w,
                                         "model.norm.weight": torch.ones(16, dtype=torch.bfloat16)})
    before = (src / "model.safetensors").read_bytes()
    proc = run_cli("apply", RULE, "--source", f"model={src}", "--out", tmp_path / "out")
    lines = error_lines(assert_clean_failure(proc))
    assert len(lines) == 1, lines
    assert "'model.layers.0.mlp.down_proj.weight'" in lines[0] and "too small for an NVFP4 global scale" in lines[0]
    assert "add its module to ignore" in lines[0]
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    assert (src / "model.safetensors").read_bytes() == before
