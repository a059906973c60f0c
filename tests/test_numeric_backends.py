"""numpy (the light install) against torch, the reference: casts and the dequant kernels
give the same bytes on random inputs that include NaN, inf, subnormals and -0.

Casts: every bit pattern a random byte string makes (so every edge value of the narrow
types), for every cast the plan allows; NaN must stay NaN (torch's own NaN payloads
depend on the array's length, see ops/decode.py). Kernels: the numpy and the torch
backend on the same blocks, byte for byte, NaN included (both give one quiet NaN).
"""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest
import torch

from ckptxform.dtypes import DTYPE_SIZES, cast_problem, decodable, torch_dtype
from ckptxform.ops.decode import cast_bytes
from ckptxform.ops.fills import mean_row
from ckptxform.quant import kernels, numpy_kernels, torch_kernels
from ckptxform.quant.kernels import Fp8Block, Int4Groups, dequant_fp8_rows, dequant_int4_rows

DECODABLE = [d for d in DTYPE_SIZES if decodable(d)]
CASTS = [(s, d) for s, d in itertools.permutations(DECODABLE, 2) if cast_problem(s, d) is None]


def random_bytes(dtype: str, n: int, seed: int) -> bytes:
    raw = np.random.default_rng(seed).integers(0, 256, n * DTYPE_SIZES[dtype], dtype=np.uint8)
    return (raw & 1).tobytes() if dtype == "BOOL" else raw.tobytes()


@pytest.mark.parametrize(("src", "dst"), CASTS, ids=[f"{s}-{d}" for s, d in CASTS])
def test_casts_match_torch_bit_for_bit(src: str, dst: str) -> None:
    raw = random_bytes(src, 20000, seed=len(src) * 31 + len(dst))
    want = torch.frombuffer(bytearray(raw), dtype=torch_dtype(src)).to(torch_dtype(dst))
    got = torch.frombuffer(bytearray(cast_bytes(raw, src, dst)), dtype=torch_dtype(dst))
    if want.is_floating_point():
        nan = want.float().isnan()
        assert torch.equal(got.float().isnan(), nan)
        want, got = want[~nan], got[~nan]
    assert bytes(got.view(torch.uint8).numpy()) == bytes(want.contiguous().view(torch.uint8).numpy())


def test_e4m3_casts_saturate_as_torch_does() -> None:
    edges = np.array([448.0, 464.0, 1e6, np.inf, -np.inf, -0.0, 2.0 ** -9, 2.0 ** -10], dtype=np.float32)
    want = torch.from_numpy(edges).to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    assert list(cast_bytes(edges.tobytes(), "F32", "F8_E4M3")) == want


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32", "F64", "F8_E4M3"])
def test_mean_row_matches_torch(dtype: str) -> None:
    rows = torch.randn(37, 6, generator=torch.Generator().manual_seed(3)).to(torch_dtype(dtype))
    raw = bytes(rows.view(torch.uint8).numpy())
    want = (rows.to(torch.float64).sum(0) / 37).to(torch_dtype(dtype))
    split = 10 * 6 * DTYPE_SIZES[dtype]  # two chunks: 10 rows, then 27
    got = mean_row([(raw[:split], 10), (raw[split:], 27)], (6,), dtype)
    assert got == bytes(want.view(torch.uint8).numpy())


def fp8_case(rows: int, cols: int, seed: int) -> tuple[bytes, bytes]:
    rng = np.random.default_rng(seed)
    w = rng.integers(0, 256, rows * cols, dtype=np.uint8)  # every e4m3 pattern, NaN 0x7F/0xFF included
    s = rng.standard_normal((-(-rows // 128), -(-cols // 128)), dtype=np.float32) * 0.01
    s.flat[:4] = [2.0 ** -130, -0.0, np.inf, 300.0]  # subnormal, -0, inf (NaN * 0 and inf), a big scale
    return w.tobytes(), s.tobytes()


@pytest.mark.parametrize("out_dtype", ["BF16", "F16", "F32"])
@pytest.mark.parametrize(("rows", "cols"), [(256, 384), (200, 300), (576, 7168)])
def test_fp8_backends_give_the_same_bytes(rows: int, cols: int, out_dtype: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    w, s = fp8_case(rows, cols, seed=rows + cols)
    layout = Fp8Block(cols=cols, block_rows=128, block_cols=128)
    outs = []
    for module in (numpy_kernels, torch_kernels):
        monkeypatch.setattr(kernels, "backend", lambda m=module: m)
        outs.append(bytes(dequant_fp8_rows(w, s, layout, out_dtype=out_dtype)))
    assert outs[0] == outs[1]
    # and against the reference: torch's float8 decode times the scale
    ref = (torch.frombuffer(bytearray(w), dtype=torch.float8_e4m3fn).view(rows, cols).float()
           * torch.frombuffer(bytearray(s), dtype=torch.float32).view(-1, -(-cols // 128))
           .repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]).to(torch_dtype(out_dtype))
    got = torch.frombuffer(bytearray(outs[0]), dtype=torch_dtype(out_dtype)).view(rows, cols)
    nan = ref.float().isnan()
    assert torch.equal(got.float().isnan(), nan)
    assert torch.equal(got[~nan], ref[~nan])


@pytest.mark.parametrize("scale_dtype", ["BF16", "F16", "F32"])
@pytest.mark.parametrize("out_dtype", ["BF16", "F16", "F32"])
@pytest.mark.parametrize("asymmetric", [False, True])
def test_int4_backends_give_the_same_bytes(scale_dtype: str, out_dtype: str, asymmetric: bool,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    rows, cols, group = 24, 256, 32
    rng = np.random.default_rng(7)
    packed = rng.integers(0, 2 ** 32, rows * cols // 8, dtype=np.uint32).tobytes()
    scale = torch.from_numpy(rng.standard_normal((rows, cols // group), dtype=np.float32) * 100)
    scale.view(-1)[:3] = torch.tensor([float("nan"), -0.0, 1e-40])
    scale_raw = bytes(scale.to(torch_dtype(scale_dtype)).view(torch.uint8).numpy())
    zp = rng.integers(0, 2 ** 32, rows // 8 * cols // group, dtype=np.uint32).tobytes() if asymmetric else None
    layout = Int4Groups(cols=cols, group_size=group, scale_dtype=scale_dtype)
    monkeypatch.setattr(kernels, "SMALL_INT4_VALUES", 0)  # a block this small runs on numpy's otherwise
    outs = []
    for module in (numpy_kernels, torch_kernels):
        monkeypatch.setattr(kernels, "backend", lambda m=module: m)
        outs.append(bytes(dequant_int4_rows(packed, scale_raw, layout, zero_point=zp, out_dtype=out_dtype)))
    assert outs[0] == outs[1]


@pytest.mark.parametrize("out_dtype", ["BF16", "F16", "F32"])
@pytest.mark.parametrize("signed_zero", [True, False])
@pytest.mark.parametrize(("rows", "cols"), [(37, 16), (64, 208)])
def test_fp4_backends_give_the_same_bytes(rows: int, cols: int, signed_zero: bool, out_dtype: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Every byte (so every e2m1 code pair, -0 included) times scales that include NaN, inf,
    -0, subnormals and values that overflow the output; and against torch as the reference."""
    rng = np.random.default_rng(rows + cols)
    packed = rng.integers(0, 256, rows * cols // 2, dtype=np.uint8).tobytes()
    e4m3 = rng.integers(0, 256, rows * cols // 16, dtype=np.uint8)
    e4m3[:4] = [0x7F, 0x80, 0x01, 0x7E]  # NaN, -0, the smallest subnormal, 448
    global_scale = float(rng.uniform(1e-3, 1e4))
    scale = kernels.nvfp4_scales(e4m3.tobytes(), global_scale, divide=signed_zero)
    scale_f32 = np.frombuffer(scale, dtype=np.float32).copy()
    scale_f32[4:6] = [np.inf, 1e38]
    layout = kernels.Fp4Groups(cols=cols, group_size=16, signed_zero=signed_zero)
    outs = []
    for module in (numpy_kernels, torch_kernels):
        monkeypatch.setattr(kernels, "backend", lambda m=module: m)
        outs.append(bytes(kernels.dequant_fp4_rows(packed, scale_f32.tobytes(), layout, out_dtype=out_dtype)))
    assert outs[0] == outs[1]
    raw = torch.frombuffer(bytearray(packed), dtype=torch.uint8).view(rows, cols // 2)
    codes = torch.stack((raw & 0xF, raw >> 4), dim=-1).flatten(-2).long()
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    values = torch.where(codes >= 8, -table[codes & 7], table[codes & 7])
    if not signed_zero:
        values = values + 0.0  # -0.0 + 0.0 is +0.0: ModelOpt's table
    s = torch.from_numpy(scale_f32).view(rows, cols // 16).repeat_interleave(16, dim=1)
    ref = (values * s).to(torch_dtype(out_dtype))
    got = torch.frombuffer(bytearray(outs[0]), dtype=torch_dtype(out_dtype)).view(rows, cols)
    nan = ref.float().isnan()
    assert torch.equal(got.float().isnan(), nan)
    assert bytes(got[~nan].view(torch.uint8).numpy()) == bytes(ref[~nan].view(torch.uint8).numpy())


def test_nvfp4_group_scales_are_the_libraries() -> None:
    """compressed-tensors divides the e4m3 scale by its reciprocal global scale, ModelOpt
    multiplies by weight_scale_2, both in float32 (torch as the reference)."""
    e4m3 = np.arange(256, dtype=np.uint8)
    s = torch.from_numpy(e4m3.copy()).view(torch.float8_e4m3fn).float()
    for g in (35840.0, 1.0 / 3.0, 2.0 ** -20):
        g32 = torch.tensor([g], dtype=torch.float32)
        for divide, want in ((True, s / g32), (False, s * g32)):
            got = torch.frombuffer(bytearray(kernels.nvfp4_scales(e4m3.tobytes(), float(g32), divide=divide)),
                                   dtype=torch.float32)
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~want.isnan()], want[~want.isnan()])


def test_a_small_int4_block_runs_on_numpy_without_importing_torch() -> None:
    """A MoE expert of a few thousand values: torch's per-op cost was 3x the kernel's."""
    code = ("import sys, numpy as np\n"
            "from ckptxform.quant.kernels import Int4Groups, dequant_int4_rows, SMALL_INT4_VALUES\n"
            "rows, cols = 224, 16\n"
            "assert rows * cols <= SMALL_INT4_VALUES\n"
            "out = dequant_int4_rows(bytes(rows * cols // 2), np.ones(rows, np.float32).tobytes(),\n"
            "                        Int4Groups(cols=cols, group_size=16, scale_dtype='F32'))\n"
            "assert len(out) == rows * cols * 2\n"
            "print('torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_an_fp8_block_runs_on_the_table_gather_without_importing_torch() -> None:
    """DeepSeek-V3's 128x128 blocks: one gather a block on every install, the same bytes as
    torch's bands (tests/test_table_kernels.py); torch's import was 1.5 CPU-seconds and
    250 MB of a 1 GB FP8 dequant."""
    code = ("import sys, numpy as np\n"
            "from ckptxform.quant.kernels import Fp8Block, dequant_fp8_rows\n"
            "rows, cols = 256, 300\n"
            "out = dequant_fp8_rows(bytes(range(256)) * (rows * cols // 256), np.ones((2, 3), np.float32).tobytes(),\n"
            "                       Fp8Block(cols=cols, block_rows=128, block_cols=128))\n"
            "assert len(out) == rows * cols * 2\n"
            "print('torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
