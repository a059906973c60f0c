"""The fused kernels (numpy's table gathers of quant/tables.py, torch's FP8 bands) against
torch as the reference and against the arithmetic kernels, byte for byte: every code under scales that include NaN,
inf, -0, subnormals and products that overflow; partial edge blocks; bands that split a
block row and bands that span several; and the finite check on a table-made block.

torch's float8 decode times the float32 scale, rounded by ``.to(dtype)``, is DeepSeek's
``weight_dequant`` (the FP8 reference); compressed-tensors' int4 decompression is checked in
test_dequant_kernels.py (it now runs the table kernel for groups of 32 and more)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO

from ckptxform.dtypes import torch_dtype
from ckptxform.errors import CheckpointFormatError
from ckptxform.quant import kernels, numpy_kernels, tables, torch_kernels
from ckptxform.quant.finite import checked
from ckptxform.quant.kernels import (
    Fp4Groups,
    Fp8Block,
    Int4Groups,
    dequant_fp4_rows,
    dequant_fp8_rows,
    dequant_int4_rows,
    dequant_nvfp4_rows,
    nvfp4_scales,
)
from ckptxform.standins.hf_models import LmDims
from ckptxform.standins.scaled import build_scaled_llama

OUT_DTYPES = ["BF16", "F16", "F32"]


#: the kernels that may make a block: numpy's table gather (quant/tables.py), numpy's
#: arithmetic passes, torch's fused bands
PATHS = ("numpy table", "numpy arithmetic", "torch")


def use(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Make ``path`` the kernel dequant_*_rows run (a table wherever one can be made)."""
    monkeypatch.setattr(kernels, "backend", lambda: torch_kernels if path == "torch" else numpy_kernels)
    monkeypatch.setattr(kernels, "SMALL_INT4_VALUES", 0)  # small blocks too: else numpy's whatever the backend
    table = path == "numpy table"
    monkeypatch.setattr(tables, "fp8_worth_it", lambda layout, rows: table)
    monkeypatch.setattr(tables, "int4_worth_it", lambda layout: table)


def every_path(monkeypatch: pytest.MonkeyPatch, run: Callable[[], memoryview]) -> bytes:
    """The bytes ``run`` makes, the same on every path (NaNs included: one quiet NaN)."""
    outs = {}
    for path in PATHS:
        use(monkeypatch, path)
        outs[path] = bytes(run())
    assert outs["numpy arithmetic"] == outs["numpy table"], "numpy's table and arithmetic differ"
    assert outs["torch"] == outs["numpy table"], "torch's kernel and numpy's table differ"
    return outs["torch"]


def as_torch(raw: memoryview, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch_dtype(dtype)).view(shape)


def same_values(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit-equal where the reference is a number, NaN where it is NaN."""
    nan = want.float().isnan()
    return bool(torch.equal(got.float().isnan(), nan)) and bytes(got[~nan].view(torch.uint8).numpy()) == bytes(
        want[~nan].contiguous().view(torch.uint8).numpy())


# ------------------------------------------------------------------------------ FP8


def fp8_case(rows: int, cols: int, block: tuple[int, int], seed: int) -> tuple[bytes, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = rng.integers(0, 256, rows * cols, dtype=np.uint8)  # every e4m3 byte, NaN 0x7F/0xFF included
    s = np.exp2(rng.uniform(-20, 12, (-(-rows // block[0]), -(-cols // block[1])))).astype(np.float32)
    s *= rng.choice(np.array([-1, 1], dtype=np.float32), s.shape)
    edges = [2.0 ** -140, -0.0, np.inf, np.nan, 2.0 ** 120, 0.0, -np.inf]  # subnormal .. overflow of bf16/f16
    s.flat[:min(s.size, len(edges))] = edges[:s.size]
    return w.tobytes(), s


def fp8_reference(w: bytes, s: np.ndarray, rows: int, cols: int, block: tuple[int, int], dtype: str) -> torch.Tensor:
    scale = torch.from_numpy(s).repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    weight = torch.frombuffer(bytearray(w), dtype=torch.float8_e4m3fn).view(rows, cols).float()
    return (weight * scale).to(torch_dtype(dtype))


FP8_SHAPES = [
    (512, 7168, (128, 128)),   # a Kimi-K2 expert's band: bands split each block row
    (576, 7168, (128, 128)),   # kv_a_proj_with_mqa: the last block row is partial (64 rows)
    (130, 300, (128, 128)),    # partial edge blocks both ways, a band holds several block rows
    (37, 4096, (1, 4096)),     # per channel (dequant_scaled): one table a row
    (100, 2100, (32, 64)),     # short blocks: a band of several block rows, a partial column block
]


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize(("rows", "cols", "block"), FP8_SHAPES)
def test_fp8_every_kernel_is_the_reference(rows: int, cols: int, block: tuple[int, int], out_dtype: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    layout = Fp8Block(cols=cols, block_rows=block[0], block_cols=block[1])
    assert tables.fp8_worth_it(layout, rows)  # numpy runs its table here, as it does by default
    w, s = fp8_case(rows, cols, block, seed=rows + cols)
    got = every_path(monkeypatch, lambda: dequant_fp8_rows(w, s.tobytes(), layout, out_dtype=out_dtype))
    assert same_values(as_torch(memoryview(got), out_dtype, (rows, cols)),
                       fp8_reference(w, s, rows, cols, block, out_dtype))


@pytest.mark.parametrize("band", [1, 7168 * 3 + 5, 1 << 20])
def test_fp8_band_size_changes_no_bit(band: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rows, cols, block = 300, 7168, (128, 128)
    layout = Fp8Block(cols, *block)
    w, s = fp8_case(rows, cols, block, seed=5)
    want = every_path(monkeypatch, lambda: dequant_fp8_rows(w, s.tobytes(), layout))
    monkeypatch.setattr(tables, "BAND_ELEMENTS", band)
    monkeypatch.setattr(torch_kernels, "FUSED_BAND", band)
    assert every_path(monkeypatch, lambda: dequant_fp8_rows(w, s.tobytes(), layout)) == want


@pytest.mark.parametrize("path", PATHS)
def test_fp8_outputs_stay_valid_after_the_next_block(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks are made ahead of the writer: a block's bytes must outlive the next block."""
    use(monkeypatch, path)
    layout = Fp8Block(cols=4096, block_rows=128, block_cols=128)
    (w1, s), (w2, _) = fp8_case(128, 4096, (128, 128), 1), fp8_case(128, 4096, (128, 128), 2)
    first = dequant_fp8_rows(w1, s.tobytes(), layout)
    kept = bytes(first)
    dequant_fp8_rows(w2, s.tobytes(), layout)
    assert first.readonly and bytes(first) == kept


@pytest.mark.parametrize("path", PATHS)
def test_a_nan_byte_is_refused_at_its_index(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    use(monkeypatch, path)
    layout = Fp8Block(cols=256, block_rows=128, block_cols=128)
    w = np.full((130, 256), 0x38, dtype=np.uint8)  # 1.0
    w[129, 200] = 0x7F
    s = np.ones((2, 2), dtype=np.float32).tobytes()
    run = checked(lambda: dequant_fp8_rows(w.tobytes(), s, layout), dtype="BF16", cols=256, first_row=1000,
                  what="'m.weight' dequantized", scale=s, scale_dtype="F32", largest_code=448.0,
                  e4m3_codes=w.tobytes())
    with pytest.raises(CheckpointFormatError, match=r"^'m.weight' dequantized gives nan at \[1129, 200\]"):
        run()


# ----------------------------------------------------------------------------- int4


def int4_case(rows: int, cols: int, group: int, scale_dtype: str, asymmetric: bool,
              seed: int) -> tuple[bytes, bytes, bytes | None]:
    rng = np.random.default_rng(seed)
    words = -(-cols // 8)
    packed = rng.integers(0, 2 ** 32, rows * words, dtype=np.uint32).tobytes()
    scale = torch.from_numpy(rng.standard_normal((rows, cols // group), dtype=np.float32) * 100)
    scale.view(-1)[:5] = torch.tensor([float("nan"), -0.0, 1e-40, float("inf"), 3e38])
    scale_raw = bytes(scale.to(torch_dtype(scale_dtype)).view(torch.uint8).numpy())
    zp = rng.integers(0, 2 ** 32, -(-rows // 8) * (cols // group), dtype=np.uint32).tobytes() if asymmetric else None
    return packed, scale_raw, zp


@pytest.mark.parametrize("asymmetric", [False, True])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("scale_dtype", ["BF16", "F16", "F32"])
@pytest.mark.parametrize(("rows", "cols", "group"), [(24, 7168, 32), (16, 1024, 128), (9, 108, 36)])
def test_int4_table_is_the_arithmetic_kernels(rows: int, cols: int, group: int, scale_dtype: str, out_dtype: str,
                                              asymmetric: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """(9, 108, 36): the last word of a row is half padding; 9 rows: a partial zero-point
    word. numpy makes a table by default from groups of 128 only; here on every group."""
    layout = Int4Groups(cols=cols, group_size=group, scale_dtype=scale_dtype)
    packed, scale, zp = int4_case(rows, cols, group, scale_dtype, asymmetric, seed=rows * cols)
    every_path(monkeypatch, lambda: dequant_int4_rows(packed, scale, layout, zero_point=zp, out_dtype=out_dtype))


def test_int4_band_size_changes_no_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    layout = Int4Groups(cols=1024, group_size=128, scale_dtype="BF16")
    packed, scale, _ = int4_case(40, 1024, 128, "BF16", False, seed=3)
    use(monkeypatch, "numpy table")
    want = bytes(dequant_int4_rows(packed, scale, layout))
    for band in (1, 1024 * 3 + 1):
        monkeypatch.setattr(tables, "BAND_ELEMENTS", band)
        assert bytes(dequant_int4_rows(packed, scale, layout)) == want


# ---------------------------------------------------------------------------- NVFP4


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("divide", [True, False])  # compressed-tensors' and ModelOpt's global scale
@pytest.mark.parametrize("global_scale", [2688.0, 1e-30, 3e37])
def test_nvfp4_table_is_every_pair_under_every_scale_byte(global_scale: float, divide: bool, out_dtype: str) -> None:
    """Every code byte under every e4m3 scale byte (NaN 0x7F/0xFF, -0 and subnormals
    included), against dequant_fp4_rows of the group scales and against torch."""
    rows, cols = 256, 512
    layout = Fp4Groups(cols=cols, group_size=16, signed_zero=divide)
    packed = np.random.default_rng(1).permuted(np.tile(np.arange(256, dtype=np.uint8), (rows, 1)), axis=1)
    e4m3 = np.repeat(np.arange(256, dtype=np.uint8), cols // 16)  # each row under one scale byte
    got = bytes(dequant_nvfp4_rows(packed.tobytes(), e4m3.tobytes(), global_scale, layout, divide=divide,
                                   out_dtype=out_dtype))
    scales = nvfp4_scales(e4m3.tobytes(), global_scale, divide=divide)
    assert got == bytes(dequant_fp4_rows(packed.tobytes(), scales, layout, out_dtype=out_dtype))
    raw = torch.from_numpy(packed)
    codes = torch.stack((raw & 0xF, raw >> 4), dim=-1).flatten(-2).long()
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    values = torch.where(codes >= 8, -table[codes & 7], table[codes & 7])
    if not divide:
        values = values + 0.0  # ModelOpt's table: code 8 is +0.0
    s = torch.frombuffer(bytearray(scales), dtype=torch.float32).view(rows, cols // 16).repeat_interleave(16, dim=1)
    assert same_values(as_torch(memoryview(got), out_dtype, (rows, cols)), (values * s).to(torch_dtype(out_dtype)))


def test_nvfp4_refuses_sizes_that_do_not_fit() -> None:
    layout = Fp4Groups(cols=32, group_size=16)
    with pytest.raises(ValueError, match="F8_E4M3 group scale rows: 1 bytes given, 2 expected"):
        dequant_nvfp4_rows(bytes(16), bytes(1), 1.0, layout, divide=True)
    with pytest.raises(ValueError, match="15 bytes are not whole rows of 16 bytes"):
        dequant_nvfp4_rows(bytes(15), bytes(2), 1.0, layout, divide=True)


@pytest.mark.parametrize("divide", [True, False])
@pytest.mark.parametrize("global_scale", [2688.0, -3.0, 0.0, float("inf")])
def test_the_largest_nvfp4_scale_is_the_largest_of_all_group_scales(global_scale: float, divide: bool) -> None:
    """What the finite check reads instead of every group scale: the same magnitude, and
    not finite where any group scale is not (a NaN byte, 0/0, 0 * inf, an overflow)."""
    rng = np.random.default_rng(7)
    for trial in range(200):
        e4m3 = rng.integers(0, 256, int(rng.integers(1, 40)), dtype=np.uint8)
        if trial % 3 == 0:
            e4m3 &= np.uint8(0x8F)  # small magnitudes, negative ones: the max is not the last byte
        every = np.abs(np.frombuffer(nvfp4_scales(e4m3.tobytes(), global_scale, divide=divide), dtype=np.float32))
        got = abs(float(np.frombuffer(kernels.nvfp4_largest_scale(e4m3.tobytes(), global_scale, divide=divide),
                                      dtype=np.float32)[0]))
        if np.isfinite(every).all():
            assert got == float(every.max()), (e4m3, every)
        else:
            assert not np.isfinite(got), (e4m3, every)
    assert kernels.nvfp4_largest_scale(b"", 1.0, divide=True) == b""


#: runs ckptxform's CLI in this process, then names the heavy modules it imported
_IMPORTED = """
import runpy, sys
sys.argv = ["ckptxform", *sys.argv[1:]]
try:
    runpy.run_module("ckptxform", run_name="__main__")
except SystemExit as exit:
    assert not exit.code, exit.code
print(sorted(m for m in ("torch", "ml_dtypes") if m in sys.modules))
"""


@pytest.mark.parametrize("scheme", ["nvfp4", "nvfp4-modelopt"])
def test_an_nvfp4_conversion_imports_neither_torch_nor_ml_dtypes(tmp_path: Path, scheme: str) -> None:
    """The NVFP4 table kernel needs numpy only: importing torch or ml_dtypes (1-1.8 s each
    here) would be most of a small conversion's time."""
    src = build_scaled_llama(tmp_path / "src", scheme, LmDims(hidden=48, heads=3, kv_heads=3, intermediate=112,
                                                              layers=1, vocab=64), seed=1)
    proc = subprocess.run([sys.executable, "-c", _IMPORTED, "-q", "apply", str(REPO / "rules" / "nvfp4_to_bf16.yaml"),
                           f"--source=model={src}", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[-2] == "[]", proc.stdout
    assert (tmp_path / "out" / "model.safetensors").exists()
