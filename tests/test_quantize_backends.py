"""FP8 quantization gives the same bytes on torch and on numpy (the light install): codes
and scales of every weight dtype, partial edge blocks, all-zero blocks, signed zeros,
subnormals, values whose quotient ties in the weight's dtype, F16 quotients that overflow,
and the refusal of NaN and infinity. tests/test_quantize_reference.py holds the default
backend to compressed-tensors itself; this file holds the other one to it."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ckptxform.quant import quantize_kernels as qk
from ckptxform.quant.layouts import Fp8Block

pytest.importorskip("torch")

NUMPY_DTYPES = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32}
SHAPES = [(128, 1000, 128, 128), (37, 300, 128, 128), (5, 64, 1, 64), (256, 256, 128, 128), (3, 7, 2, 3),
          (130, 129, 128, 128), (9, 5, 1, 5)]


def _both(monkeypatch: pytest.MonkeyPatch, weight: bytes, dtype: str, layout: Fp8Block) -> tuple[tuple[bytes, bytes], ...]:
    out = []
    for numeric in ("numpy", "torch"):
        monkeypatch.setenv("CKPTXFORM_NUMERIC", numeric)
        out.append((bytes(qk.fp8_rows(weight, dtype, layout)), bytes(qk.fp8_scale_rows(weight, dtype, layout))))
    return tuple(out)


def _weight(rng: np.random.Generator, rows: int, cols: int, dtype: str) -> np.ndarray:
    top = 100.0 if dtype == "F16" else 1e4
    x = rng.standard_normal((rows, cols)) * rng.choice([1e-7, 1e-3, 0.02, 3.0, top], (rows, 1))
    x = x.astype(np.float32)
    x[0, : min(cols, 200)] = 0.0  # a whole zero block where the shape allows: the scale becomes eps
    if rows > 1:
        x[1, 0] = -0.0
    if rows > 2 and cols > 3:
        x[2, :3] = [np.float32(2.0 ** -130), -np.float32(2.0 ** -133), np.float32(1e-40)]  # subnormals
    return x


@pytest.mark.parametrize("dtype", sorted(NUMPY_DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_torch_and_numpy_quantize_to_the_same_codes_and_scales(monkeypatch: pytest.MonkeyPatch, dtype: str,
                                                                shape: tuple[int, int, int, int], seed: int) -> None:
    rows, cols, bh, bw = shape
    weight = _weight(np.random.default_rng(seed), rows, cols, dtype).astype(NUMPY_DTYPES[dtype])
    layout = Fp8Block(cols=cols, block_rows=bh, block_cols=bw)
    on_numpy, on_torch = _both(monkeypatch, weight.tobytes(), dtype, layout)
    assert on_numpy == on_torch


@pytest.mark.parametrize("dtype", ["BF16", "F16"])
def test_quotients_on_every_tie_of_the_weights_dtype_round_alike(monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    # a block whose absmax is 448 has scale 1: x / 1 is x, so every representable value of
    # the dtype within +-448 is cast to e4m3 as it is, ties between e4m3 codes included
    np_dtype = NUMPY_DTYPES[dtype]
    bits = np.arange(1 << 16, dtype=np.uint16)
    values = bits.view(np_dtype).astype(np.float32)
    values = values[np.isfinite(values) & (np.abs(values) <= 448.0)]
    cols = 128
    values = np.concatenate([values, np.zeros((-len(values)) % (cols - 1), np.float32)]).reshape(-1, cols - 1)
    weight = np.concatenate([np.full((len(values), 1), 448.0, np.float32), values], axis=1).astype(np_dtype)
    layout = Fp8Block(cols=cols, block_rows=1, block_cols=cols)
    on_numpy, on_torch = _both(monkeypatch, weight.tobytes(), dtype, layout)
    assert on_numpy == on_torch


def test_an_f16_quotient_that_overflows_saturates_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    # the scale of a block of tiny values is F16's eps (2**-10): 60000 / eps overflows F16
    weight = np.zeros((1, 4), np.float16)
    weight[0] = [60000.0, -60000.0, 1.0, 0.0]
    layout = Fp8Block(cols=4, block_rows=1, block_cols=2)
    tiny = np.array([[1e-7, 0.0, 1e-7, 0.0]], np.float16)
    for w in (weight, tiny):
        on_numpy, on_torch = _both(monkeypatch, w.tobytes(), "F16", layout)
        assert on_numpy == on_torch


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("numeric", ["numpy", "torch"])
@pytest.mark.parametrize("part", [qk.fp8_rows, qk.fp8_scale_rows])
def test_a_non_finite_weight_is_refused_on_both(monkeypatch: pytest.MonkeyPatch, bad: float, numeric: str,
                                                part: object) -> None:
    monkeypatch.setenv("CKPTXFORM_NUMERIC", numeric)
    weight = np.ones((4, 8), ml_dtypes.bfloat16)
    weight[2, 5] = bad
    with pytest.raises(qk.NonFiniteWeight):
        part(weight.tobytes(), "BF16", Fp8Block(cols=8, block_rows=2, block_cols=4))  # type: ignore[operator]


def test_no_rows_give_no_codes_and_no_scales_on_both(monkeypatch: pytest.MonkeyPatch) -> None:
    layout = Fp8Block(cols=8, block_rows=128, block_cols=128)
    assert _both(monkeypatch, b"", "BF16", layout) == ((b"", b""), (b"", b""))
