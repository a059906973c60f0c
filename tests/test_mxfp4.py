"""dequant_mxfp4 and its kernel without the reference library (transformers' own check is
tests/test_mxfp4_reference.py):

- the kernel against ml_dtypes' own float4_e2m1fn and float8_e8m0fnu decoders, for every
  byte under every scale but 255 (which ml_dtypes calls NaN and transformers does not);
- the op's block program: any range of dim-0 indices, in chunks of any size, is the slice
  of the whole output;
- every bad input fails the plan with one error naming the key and the fix (missing or
  orphan member, dtypes, shapes, a config that is not mxfp4), and nothing is written;
- an infinite value fails the run naming the tensor and its index, unless allowed;
- the light install (no torch) writes the same bytes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from test_light_install import NO_TORCH

from ckptxform import api
from ckptxform.errors import CheckpointFormatError, PlanError
from ckptxform.ops import OPS
from ckptxform.ops.base import Block, InputTensor, Run, View
from ckptxform.quant.mxfp4 import dequant_mxfp4_groups, first_nonfinite_scale
from ckptxform.standins.gpt_oss import GptOssDims, build_gpt_oss

RULE = Path(__file__).resolve().parents[1] / "rules" / "mxfp4_to_bf16.yaml"
_OUT = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32}


def ml_dtypes_decode(blocks: np.ndarray, scales: np.ndarray, dtype: str) -> np.ndarray:
    """[n, 16] bytes and [n] e8m0 -> [n, 32] values, by ml_dtypes' decoders (float64 product: exact)."""
    codes = np.empty((len(blocks), 32), dtype=np.uint8)
    codes[:, 0::2], codes[:, 1::2] = blocks & 0xF, blocks >> 4
    values = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    scale = scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    with np.errstate(over="ignore"):
        return (values * scale[:, None]).astype(np.float32).astype(_OUT[dtype])


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
def test_every_byte_under_every_scale_is_what_ml_dtypes_decodes(dtype: str) -> None:
    scales = np.repeat(np.arange(255, dtype=np.uint8), 16)  # 255 is NaN to ml_dtypes only
    blocks = np.tile(np.arange(256, dtype=np.uint8).reshape(16, 16), (255, 1))
    got = np.frombuffer(dequant_mxfp4_groups(blocks.tobytes(), scales.tobytes(), out_dtype=dtype),
                        dtype=_OUT[dtype]).reshape(-1, 32)
    want = ml_dtypes_decode(blocks, scales, dtype)
    assert got.tobytes() == want.tobytes()
    negative_zero = (want == 0) & np.signbit(want.astype(np.float32))
    assert negative_zero.sum() > 0 and (np.signbit(got.astype(np.float32)) == np.signbit(want.astype(np.float32))).all()
    # the scan threshold: below it every value is finite, at it some is not
    threshold = first_nonfinite_scale(dtype)
    finite = np.isfinite(got.astype(np.float32)).all(axis=1).reshape(255, 16).all(axis=1)
    assert finite[:threshold].all() and not finite[threshold]


def test_a_block_of_the_wrong_size_is_refused() -> None:
    with pytest.raises(ValueError, match="16 bytes given for 2 scales, 32 expected"):
        dequant_mxfp4_groups(bytes(16), bytes(2))


def _block(blocks: np.ndarray, scales: np.ndarray, dtype: str = "BF16") -> tuple[Block, list[InputTensor]]:
    op = OPS["dequant_mxfp4"]
    b = View(blocks.shape, "U8", (Run(0, 0, blocks.nbytes),))
    s = View(scales.shape, "U8", (Run(1, 0, scales.nbytes),))
    block = Block(op, {"dtype": dtype, "nonfinite": None}, (b, s), (*blocks.shape[:-2], blocks.shape[-2] * 32), dtype)
    raw = [blocks.tobytes(), scales.tobytes()]
    inputs = [InputTensor(view, lambda start, n, data=data: data[start:start + n]) for view, data in zip((b, s), raw)]
    return block, inputs


@pytest.mark.parametrize("chunk", [64, 640, 1 << 20])
def test_any_range_of_rows_in_any_chunks_is_the_slice_of_the_whole(chunk: int) -> None:
    rng = np.random.default_rng(11)
    blocks = rng.integers(0, 256, (5, 3, 2, 16), dtype=np.uint8)
    scales = rng.integers(100, 140, (5, 3, 2), dtype=np.uint8)
    block, inputs = _block(blocks, scales)
    whole = dequant_mxfp4_groups(blocks.tobytes(), scales.tobytes())
    row = 3 * 64 * 2
    assert b"".join(block.op.blocks(block, inputs, chunk)) == bytes(whole)
    for rows in (range(1), range(2, 5), range(4, 5), range(1, 3)):
        got = b"".join(block.op.blocks(block, inputs, chunk, rows))
        assert got == bytes(whole)[rows.start * row:rows.stop * row], (rows, chunk)


# ------------------------------------------------------------------ plans and runs


def _write(root: Path, tensors: dict[str, np.ndarray], config: dict | None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps({"model_type": "gpt_oss", **({} if config is None else config)}))
    return root


MXFP4 = {"quantization_config": {"quant_method": "mxfp4"}}
PREFIX = "model.layers.0.mlp.experts."


def _expert_tensors(rows: int = 4, groups: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"{PREFIX}down_proj_blocks": rng.integers(0, 256, (2, rows, groups, 16), dtype=np.uint8),
            f"{PREFIX}down_proj_scales": rng.integers(110, 130, (2, rows, groups), dtype=np.uint8),
            f"{PREFIX}down_proj_bias": rng.standard_normal((2, rows), dtype=np.float32)}


@pytest.mark.parametrize("change, config, message", [
    (lambda t: t.pop(f"{PREFIX}down_proj_scales"), MXFP4,
     f"missing scales: '{PREFIX}down_proj_blocks' holds MXFP4 codes but the source has no '{PREFIX}down_proj_scales'"),
    (lambda t: t.pop(f"{PREFIX}down_proj_blocks"), MXFP4,
     f"orphan scales: '{PREFIX}down_proj_scales' has no '{PREFIX}down_proj_blocks' to scale"),
    (lambda t: t.update({f"{PREFIX}down_proj_scales": t[f"{PREFIX}down_proj_scales"].astype(np.float32)}), MXFP4,
     "is U8 and '" + PREFIX + "down_proj_scales' F32: MXFP4 blocks are U8 and scales U8 or F8_E8M0"),
    (lambda t: t.update({f"{PREFIX}down_proj_scales": t[f"{PREFIX}down_proj_scales"][:, :3]}), MXFP4,
     "[2, 4, 2, 16] with '" + PREFIX + "down_proj_scales' [2, 3, 2]: MXFP4 needs blocks [..., G, 16]"),
    (lambda t: t.update({f"{PREFIX}down_proj_blocks": t[f"{PREFIX}down_proj_blocks"][..., :8].copy()}), MXFP4,
     "[2, 4, 2, 8] with"),
    (lambda t: None, {"quantization_config": {"quant_method": "fp8"}},
     "quantization_config.quant_method is 'fp8', not 'mxfp4'; this rule dequantizes MXFP4 checkpoints (gpt-oss)"),
    (lambda t: None, None, "the converted source's config has no quantization_config"),
])
def test_a_bad_source_fails_the_plan_naming_the_key_and_writes_nothing(tmp_path: Path, change, config,
                                                                       message: str) -> None:
    tensors = _expert_tensors()
    change(tensors)
    src = _write(tmp_path / "src", tensors, config)
    with pytest.raises(PlanError) as failure:
        api.apply(RULE, out=tmp_path / "out", sources={"model": str(src)}, progress=False)
    text = str(failure.value)
    assert message in text and "dequant_mxfp4" in text and str(RULE) in text, text
    assert not (tmp_path / "out").exists()


def test_an_overflowing_scale_fails_the_run_naming_the_index_unless_allowed(tmp_path: Path) -> None:
    tensors = _expert_tensors()
    blocks, scales = tensors[f"{PREFIX}down_proj_blocks"], tensors[f"{PREFIX}down_proj_scales"]
    blocks[1, 2, 1, :] = 0x11  # every code 0.5 ...
    blocks[1, 2, 1, 5] = 0x71  # ... but element 11 of the group, 6.0
    scales[1, 2, 1] = 254  # 6 * 2**127 overflows
    src = _write(tmp_path / "src", tensors, MXFP4)
    with pytest.raises(CheckpointFormatError) as failure:
        api.apply(RULE, out=tmp_path / "out", sources={"model": str(src)}, progress=False)
    # [expert 1, row 2, column 32 + 11] of blocks' layout, reported in the dequantized tensor's indices
    assert (f"'{PREFIX}down_proj_blocks' dequantized gives inf at [1, 2, 43]: its e8m0 scale byte 254 makes "
            "2**127 times the code, beyond BF16") in str(failure.value)
    assert not (tmp_path / "out").exists()
    allowed = tmp_path / "allowed.yaml"
    allowed.write_text(RULE.read_text().replace("dequant_mxfp4: {over: T}", "dequant_mxfp4: {over: T, allow_nonfinite: true}")
                       .replace("repo: openai/gpt-oss-20b", "path: unused"))
    api.apply(allowed, out=tmp_path / "out", sources={"model": str(src)}, progress=False)
    down = load_file(str(next((tmp_path / "out").glob("*.safetensors"))))[f"{PREFIX}down_proj"]
    assert down.shape == (2, 64, 4)  # [E, I, H] after the transpose
    assert np.isinf(down.astype(np.float32)[1, 43, 2]) and np.isfinite(down.astype(np.float32)).sum() == down.size - 1


def test_the_light_install_writes_the_same_bytes(tmp_path: Path) -> None:
    src = build_gpt_oss(tmp_path / "src", GptOssDims(hidden=64, intermediate=96, experts=3), seed=2).path
    api.apply(RULE, out=tmp_path / "torch", sources={"model": str(src)}, progress=False)
    proc = subprocess.run([sys.executable, "-c", NO_TORCH, "-q", "apply", str(RULE), f"--source=model={src}",
                           "--out", str(tmp_path / "numpy")], check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    names = sorted(p.name for p in (tmp_path / "torch").glob("*.safetensors"))
    assert names and names == sorted(p.name for p in (tmp_path / "numpy").glob("*.safetensors"))
    for name in names:
        assert (tmp_path / "torch" / name).read_bytes() == (tmp_path / "numpy" / name).read_bytes()


def test_a_cast_of_mxfp4_blocks_is_refused_naming_the_op(tmp_path: Path) -> None:
    """Casting the codes' bytes to bf16 writes numbers that mean nothing: refused at plan time."""
    src = _write(tmp_path / "src", _expert_tensors(), MXFP4)
    rule = tmp_path / "cast.yaml"
    rule.write_text("version: 1\nsources: {model: {path: unused}}\nconvert: model\ntensors:\n"
                    "  - match: '.+'\n    cast: bfloat16\n")
    with pytest.raises(PlanError) as failure:
        api.apply(rule, out=tmp_path / "out", sources={"model": str(src)}, progress=False)
    assert (f"cast U8 -> BF16 of '{PREFIX}down_proj_blocks' would drop its scale: the source's quantization_config "
            f"(quant_method 'mxfp4') declares it quantized and '{PREFIX}down_proj_scales' scales it; dequantize it "
            "with dequant_mxfp4") in str(failure.value)
    assert not (tmp_path / "out").exists()


def test_scales_stored_as_f8_e8m0_are_the_same_bytes(tmp_path: Path) -> None:
    """Some exports name the scales' dtype F8_E8M0 instead of U8: the same exponents."""
    from test_light_install import write_raw

    tensors = _expert_tensors(seed=4)
    outs = []
    for dtype in ("U8", "F8_E8M0"):
        src = tmp_path / dtype
        src.mkdir()
        write_raw(src / "model.safetensors", {
            key: (dtype if key.endswith("_scales") else {"uint8": "U8", "float32": "F32"}[str(value.dtype)],
                  list(value.shape), value.tobytes()) for key, value in tensors.items()})
        (src / "config.json").write_text(json.dumps(MXFP4))
        api.apply(RULE, out=tmp_path / f"out-{dtype}", sources={"model": str(src)}, progress=False)
        outs.append(load_file(str(next((tmp_path / f"out-{dtype}").glob("*.safetensors")))))
    assert outs[0].keys() == outs[1].keys() and all(outs[0][k].tobytes() == outs[1][k].tobytes() for k in outs[0])
