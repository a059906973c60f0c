"""The block kernels against independent references: plain loops over FP8 blocks written
here from DeepSeek's definition, and compressed-tensors itself for int4 (it packs the
source and decompresses the expected weight). Blocks are fed in several row chunks, so
chunking cannot change a bit."""

from __future__ import annotations

import math

import pytest
import torch

from ckptxform.quant.kernels import (
    Fp8Block,
    Int4Groups,
    dequant_fp8_rows,
    dequant_int4_rows,
)

OUT_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def tensor_view(out: memoryview, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A kernel's output bytes as a torch tensor, to compare with the torch references."""
    return torch.frombuffer(bytearray(out), dtype=OUT_DTYPES[dtype]).view(shape)


def raw(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).numpy())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and raw(a) == raw(b)


# ------------------------------------------------------------------------------ FP8


def fp8_weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Every finite e4m3fn bit pattern, in random places (0x7F/0xFF are NaN)."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.int32)
    bits[(bits & 0x7F) == 0x7F] = 0x3C  # 1.5
    return bits.to(torch.uint8).view(torch.float8_e4m3fn)


def fp8_scales(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.exp(4 * torch.randn(rows, cols, generator=gen, dtype=torch.float32))


def fp8_reference(w: torch.Tensor, s: torch.Tensor, block: tuple[int, int],
                  dtype: torch.dtype) -> torch.Tensor:
    """DeepSeek's definition, block by block: the float32 product, then the output dtype."""
    bh, bw = block
    out = torch.empty(w.shape, dtype=dtype)
    for bi in range(math.ceil(w.shape[0] / bh)):
        for bj in range(math.ceil(w.shape[1] / bw)):
            rows, cols = slice(bi * bh, (bi + 1) * bh), slice(bj * bw, (bj + 1) * bw)
            product = w[rows, cols].to(torch.float32) * s[bi, bj].item()
            assert product.dtype == torch.float32
            out[rows, cols] = product.to(dtype)
    return out


def fp8_kernel(w: torch.Tensor, s: torch.Tensor, block: tuple[int, int], out_dtype: str,
               chunk_blocks: int) -> torch.Tensor:
    """The kernel over chunks of ``chunk_blocks`` block rows, concatenated."""
    layout = Fp8Block(cols=w.shape[1], block_rows=block[0], block_cols=block[1])
    parts = []
    step = chunk_blocks * block[0]
    for first in range(0, w.shape[0], step):
        rows = w[first:first + step]
        scale_rows = s[first // block[0]:first // block[0] + layout.scale_rows(rows.shape[0])]
        out = dequant_fp8_rows(raw(rows), raw(scale_rows), layout, out_dtype=out_dtype)
        parts.append(tensor_view(out, out_dtype, tuple(rows.shape)))
    return torch.cat(parts)


@pytest.mark.parametrize("shape, block, chunk_blocks", [
    ((576, 7168), (128, 128), 2),   # DeepSeek-V3 kv_a_proj_with_mqa: scale [5, 56]
    ((72, 896), (16, 16), 1),       # the same grid scaled down
    ((100, 77), (16, 16), 3),       # neither dim divisible by the block
    ((130, 129), (128, 128), 1),    # one row and one column past a full block
    ((1, 1), (128, 128), 1),
    ((64, 48), (32, 16), 8),        # rectangular blocks, one chunk for the whole tensor
])
def test_fp8_blocks_match_the_plain_loop(shape: tuple[int, int], block: tuple[int, int],
                                         chunk_blocks: int) -> None:
    scale_shape = (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
    w, s = fp8_weight(*shape, seed=sum(shape)), fp8_scales(*scale_shape, seed=sum(shape))
    got = fp8_kernel(w, s, block, "BF16", chunk_blocks)
    assert same_bits(got, fp8_reference(w, s, block, torch.bfloat16))


@pytest.mark.parametrize("out_dtype", ["F16", "F32"])
def test_fp8_other_output_dtypes(out_dtype: str) -> None:
    w, s = fp8_weight(40, 70, seed=3), fp8_scales(3, 5, seed=3) * 1e-3
    got = fp8_kernel(w, s, (16, 16), out_dtype, 2)
    assert same_bits(got, fp8_reference(w, s, (16, 16), OUT_DTYPES[out_dtype]))


def test_fp8_outputs_stay_valid_after_the_next_block() -> None:
    """Blocks are made ahead of the writer (several in flight: quant/pipeline.py), so a
    block's bytes must stay as they are after the kernel has produced the next one."""
    layout = Fp8Block(cols=8, block_rows=4, block_cols=4)
    w = [fp8_weight(4, 8, seed=i) for i in (1, 2)]
    s = fp8_scales(1, 2, seed=0)
    for out_dtype in OUT_DTYPES:
        first = dequant_fp8_rows(raw(w[0]), raw(s), layout, out_dtype=out_dtype)
        kept = bytes(first)
        dequant_fp8_rows(raw(w[1]), raw(s), layout, out_dtype=out_dtype)
        assert bytes(first) == kept


def test_fp8_rounds_the_product_to_nearest_even() -> None:
    w = torch.tensor([[1.5, 1.0]], dtype=torch.float32).to(torch.float8_e4m3fn)
    s = torch.tensor([[1 + 2**-8]], dtype=torch.float32)
    out = tensor_view(dequant_fp8_rows(raw(w), raw(s), Fp8Block(2, 128, 128)), "BF16", (1, 2))
    # 1.0 * s = 1.00390625 lies exactly halfway between bf16 1.0 and 1.0078125: even wins
    assert out[0, 1].item() == 1.0
    # 1.5 * s = 1.505859375 is nearer 1.5078125 than 1.5
    assert out[0, 0].item() == 1.5078125


def test_fp8_refuses_sizes_that_are_not_whole_rows_and_scales() -> None:
    layout = Fp8Block(cols=10, block_rows=4, block_cols=4)
    with pytest.raises(ValueError, match="15 bytes are not whole rows of 10 bytes"):
        dequant_fp8_rows(bytes(15), bytes(12), layout)
    with pytest.raises(ValueError, match="F32 scale_inv rows: 8 bytes given, 12 expected"):
        dequant_fp8_rows(bytes(20), bytes(8), layout)


# ----------------------------------------------------------------------------- int4


def int4_case(rows: int, cols: int, group: int, seed: int, *, symmetric: bool = True,
              scale_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """A compressed module state dict, packed by compressed-tensors itself."""
    pack = pytest.importorskip(
        "compressed_tensors.compressors.pack_quantized.helpers",
        reason="needs the 'reference' extra: pip install torch==2.13.0 -e '.[test,reference]'")
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (rows, cols), generator=gen, dtype=torch.int8)
    scale = torch.exp(torch.randn(rows, cols // group, generator=gen)).to(scale_dtype)
    state = {"weight_packed": pack.pack_to_int32(q, 4), "weight_scale": scale,
             "weight_shape": torch.tensor([rows, cols])}
    if not symmetric:
        zp = torch.randint(-8, 8, (rows, cols // group), generator=gen, dtype=torch.int8)
        state["weight_zero_point"] = pack.pack_to_int32(zp, 4, packed_dim=0)
    return state


def int4_reference(state: dict[str, torch.Tensor], group: int, symmetric: bool) -> torch.Tensor:
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group))
    return PackedQuantizationCompressor.decompress(dict(state), scheme)["weight"]


def int4_kernel(state: dict[str, torch.Tensor], group: int, chunk_rows: int,
                out_dtype: str | None = None) -> torch.Tensor:
    from ckptxform.dtypes import from_torch_dtype

    rows, cols = state["weight_shape"].tolist()
    sdtype = from_torch_dtype(state["weight_scale"].dtype)
    layout = Int4Groups(cols=cols, group_size=group, scale_dtype=sdtype)
    out_dtype = out_dtype or sdtype
    parts = []
    for first in range(0, rows, chunk_rows):
        last = min(rows, first + chunk_rows)
        zp = state.get("weight_zero_point")
        zp_rows = None if zp is None else raw(zp[first // 8:-(-last // 8)])
        out = dequant_int4_rows(raw(state["weight_packed"][first:last]),
                                raw(state["weight_scale"][first:last]), layout,
                                zero_point=zp_rows, out_dtype=out_dtype)
        parts.append(tensor_view(out, out_dtype, (last - first, cols)))
    return torch.cat(parts)


@pytest.mark.reference
@pytest.mark.parametrize("rows, cols, group, chunk_rows", [
    (7168 // 8, 2048 // 8, 32, 64),  # a Kimi-K2.5 down_proj scaled down: [896, 256]
    (64, 96, 32, 16),
    (24, 36, 12, 8),                 # 36 columns: the last word is half padding
    (5, 8, 8, 5),
    (1, 32, 32, 1),
])
def test_int4_matches_compressed_tensors(rows: int, cols: int, group: int,
                                         chunk_rows: int) -> None:
    state = int4_case(rows, cols, group, seed=rows * cols)
    assert same_bits(int4_kernel(state, group, chunk_rows), int4_reference(state, group, True))


@pytest.mark.reference
@pytest.mark.parametrize("rows, cols, group, chunk_rows", [(64, 96, 32, 16), (20, 36, 12, 8)])
def test_int4_asymmetric_matches_compressed_tensors(rows: int, cols: int, group: int,
                                                    chunk_rows: int) -> None:
    state = int4_case(rows, cols, group, seed=7, symmetric=False)
    assert same_bits(int4_kernel(state, group, chunk_rows), int4_reference(state, group, False))


@pytest.mark.reference
@pytest.mark.parametrize("scale_dtype, out_dtype", [
    (torch.float16, "F16"), (torch.float32, "F32"), (torch.bfloat16, "F32")])
def test_int4_other_scale_and_output_dtypes(scale_dtype: torch.dtype, out_dtype: str) -> None:
    state = int4_case(16, 64, 32, seed=1, scale_dtype=scale_dtype)
    want = int4_reference(state, 32, True).to(OUT_DTYPES[out_dtype])
    assert same_bits(int4_kernel(state, 32, 8, out_dtype), want)


def test_int4_refuses_sizes_that_do_not_fit() -> None:
    layout = Int4Groups(cols=16, group_size=8, scale_dtype="BF16")
    with pytest.raises(ValueError, match="6 bytes are not whole rows of 8 bytes"):
        dequant_int4_rows(bytes(6), bytes(4), layout)
    with pytest.raises(ValueError, match="BF16 weight_scale rows: 2 bytes given, 8 expected"):
        dequant_int4_rows(bytes(16), bytes(2), layout)
    with pytest.raises(ValueError, match="out_dtype 'I8' is not one of"):
        dequant_int4_rows(bytes(8), bytes(4), layout, out_dtype="I8")
