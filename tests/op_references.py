"""The torch reference of each op of a rule's ``ops:`` chain, written from its semantics in
the design notes (structural-ops.md), not by calling ckptxform: tests/test_op_chains.py
evaluates random chains with them. Each raises ``Invalid`` where the op has no meaning
(a transpose of a vector, heads that do not divide the rows, a mean of integers...)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


class Invalid(Exception):
    """The chain has no meaning on these tensors: the planner must refuse it."""


# ------------------------------------------------------------------ the reference, op by op


def ref_transpose(t: torch.Tensor, d0: int, d1: int) -> torch.Tensor:
    rank = t.dim()
    if rank < 2 or not (-rank <= d0 < rank and -rank <= d1 < rank) or d0 % rank == d1 % rank:
        raise Invalid("transpose needs two different dims")
    return t.transpose(d0, d1).contiguous()


def rows_of(t: torch.Tensor) -> int:
    if t.dim() < 1:
        raise Invalid("a scalar has no rows")
    return t.shape[0]


def ref_rope(t: torch.Tensor, heads: int, inverse: bool) -> torch.Tensor:
    """w.view(n, hd//2, 2, in).transpose(1, 2); the inverse views (n, 2, hd//2, in)."""
    rows = rows_of(t)
    if heads <= 0 or rows % heads or (rows // heads) % 2:
        raise Invalid("heads do not make an even head size")
    rest, half = t.shape[1:], rows // heads // 2
    shape = (heads, 2, half) if inverse else (heads, half, 2)
    return t.reshape(*shape, *rest).transpose(1, 2).reshape(rows, *rest).contiguous()


def ref_qkv(t: torch.Tensor, heads: int, kv: int, inverse: bool) -> torch.Tensor:
    """Per kv group g: [its heads/kv q heads; k_g; v_g] (Megatron's linear_qkv)."""
    rows = rows_of(t)
    if kv <= 0 or heads % kv or rows % (heads + 2 * kv):
        raise Invalid("not q, k and v of these heads")
    rest, hd, per = t.shape[1:], rows // (heads + 2 * kv), heads // kv
    if not inverse:
        q = t[:heads * hd].reshape(kv, per * hd, *rest)
        k = t[heads * hd:(heads + kv) * hd].reshape(kv, hd, *rest)
        v = t[(heads + kv) * hd:].reshape(kv, hd, *rest)
        return torch.cat([q, k, v], dim=1).reshape(rows, *rest).contiguous()
    g = t.reshape(kv, (per + 2) * hd, *rest)
    parts = [g[:, :per * hd], g[:, per * hd:(per + 1) * hd], g[:, (per + 1) * hd:]]
    return torch.cat([p.reshape(-1, *rest) for p in parts]).contiguous()


def ref_resize(t: torch.Tensor, rows: int, fill: str, std: float, seed: int) -> torch.Tensor:
    have = rows_of(t)
    if rows <= have:
        return t[:rows].contiguous()
    rest, new = t.shape[1:], rows - have
    if fill == "zeros":
        extra = torch.zeros((new, *rest), dtype=t.dtype)
    elif not t.dtype.is_floating_point or (fill == "mean" and have == 0):
        raise Invalid(f"fill {fill} of {t.dtype} / no rows")
    elif fill == "mean":  # summed in float64
        extra = (t.to(torch.float64).sum(0) / have).to(t.dtype).expand(new, *rest)
    else:
        gen = torch.Generator().manual_seed(seed)
        extra = (torch.randn((new, *rest), generator=gen, dtype=torch.float32) * std).to(t.dtype)
    return torch.cat([t, extra]).contiguous()


def ref_stack(members: list[torch.Tensor]) -> torch.Tensor:
    if len({(m.shape, m.dtype) for m in members}) > 1:
        raise Invalid("stack of different shapes or dtypes")
    return torch.stack(members)


def ref_concat(members: list[torch.Tensor], dim: int) -> torch.Tensor:
    first = members[0]
    rank = first.dim()
    if rank < 1 or not -rank <= dim < rank or len({m.dtype for m in members}) > 1:
        raise Invalid("concat: no such dim, or dtypes differ")
    d = dim % rank
    if any(m.dim() != rank or m.shape[:d] + m.shape[d + 1:] != first.shape[:d] + first.shape[d + 1:]
           for m in members):
        raise Invalid("concat: shapes differ outside dim")
    return torch.cat(members, d)


def ref_concat_shards(t: torch.Tensor, dim: int, first: bool) -> torch.Tensor:
    """The pieces of a source tensor in every shard file, concatenated: on a one-file source
    (the chain test's), the tensor itself; only the first op of a chain reads source tensors."""
    rank = t.dim()
    if not first or rank < 1 or not -rank <= dim < rank:
        raise Invalid("concat_shards: not the first op, or no such dim")
    return t


def ref_split(t: torch.Tensor, dim: int, names: list[str]) -> list[tuple[str, torch.Tensor]]:
    rank = t.dim()
    if rank < 1 or not -rank <= dim < rank or t.shape[dim] % len(names):
        raise Invalid("split: no such dim, or not equal parts")
    return [(n, p.contiguous()) for n, p in zip(names, torch.tensor_split(t, len(names), dim))]


def fp8_dequant(w: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """DeepSeek's weight_dequant, block by block: float32 product, then bfloat16."""
    bh, bw = block
    out = torch.empty(w.shape, dtype=torch.bfloat16)
    for bi in range(math.ceil(w.shape[0] / bh)):
        for bj in range(math.ceil(w.shape[1] / bw)):
            rows, cols = slice(bi * bh, (bi + 1) * bh), slice(bj * bw, (bj + 1) * bw)
            out[rows, cols] = (w[rows, cols].to(torch.float32) * s[bi, bj].item()).to(torch.bfloat16)
    return out


def ref_dequant(members: dict[str, torch.Tensor], block: tuple[int, int]) -> torch.Tensor:
    w, s = members.get("weight"), members.get("weight_scale_inv")
    if w is None or s is None or w.dtype != torch.float8_e4m3fn or w.dim() != 2 or s.dtype != torch.float32:
        raise Invalid("dequant: not an FP8 weight with its float32 scale")
    if tuple(s.shape) != (-(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])):
        raise Invalid("dequant: the block size does not explain the scale")
    return fp8_dequant(w, s, block)


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """[n, k] integers in [0, 15] -> int32 [n, ceil(k / 8)]: nibble j of word w is element 8w + j."""
    n, k = values.shape
    padded = torch.zeros(n, -(-k // 8) * 8, dtype=torch.int64)
    padded[:, :k] = values
    words = sum(padded[:, j::8] << (4 * j) for j in range(8))
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


@dataclass(frozen=True)
class Int4Module:
    """What the int4 source was made from: stored nibbles (q + 8), zero-point nibbles (zp + 8,
    None when symmetric), the scales, the group size."""

    q: torch.Tensor
    zp: torch.Tensor | None
    scale: torch.Tensor
    group: int


def ref_int4(members: dict[str, torch.Tensor], modules: dict[int, Int4Module], group: int) -> torch.Tensor:
    """compressed-tensors' dequantize: (q - zp) times the group's scale, in the scale's dtype, then bfloat16."""
    packed, shape = members.get("weight_packed"), members.get("weight_shape")
    if packed is None or shape is None or packed.dim() != 2:
        raise Invalid("int4: no packed weight")
    module = modules[id(packed)]  # the chain starts at dequant_int4: members are the source's
    zp = module.zp if module.zp is not None else torch.full((module.q.shape[0], module.scale.shape[1]), 8)
    diff = (module.q - zp.repeat_interleave(group, dim=1)).to(module.scale.dtype)
    return (diff * module.scale.repeat_interleave(group, dim=1)).to(torch.bfloat16)


def ref_permute(t: torch.Tensor, source_ids: list[int], target_ids: list[int], fill: str, std: float,
                seed: int) -> torch.Tensor:
    """Row j: the row of ``t`` (indexed by ``source_ids``' tokens) holding ``target_ids[j]``; a
    token ``source_ids`` lacks gets zeros, the mean of the rows carried (float64 sum), or
    seeded normal values in the order the missing rows come."""
    if rows_of(t) != len(source_ids):
        raise Invalid("the rows are not the source vocabulary's")
    rest = t.shape[1:]
    missing = [tok for tok in target_ids if tok not in source_ids]
    carried = [source_ids.index(tok) for tok in target_ids if tok in source_ids]
    if missing and fill != "zeros" and not t.dtype.is_floating_point:
        raise Invalid(f"fill {fill} of {t.dtype}")
    if fill == "mean" and missing:
        present = t[sorted(set(carried))].to(torch.float64)
        made = (present.sum(0) / max(1, len(set(carried)))).to(t.dtype).expand(len(missing), *rest)
    elif fill == "normal" and missing:
        gen = torch.Generator().manual_seed(seed)
        made = (torch.randn((len(missing), *rest), generator=gen, dtype=torch.float32) * std).to(t.dtype)
    else:
        made = torch.zeros((len(missing), *rest), dtype=t.dtype)
    rows, k = [], 0
    for tok in target_ids:
        if tok in source_ids:
            rows.append(t[source_ids.index(tok)])
        else:
            rows.append(made[k])
            k += 1
    return torch.stack(rows).contiguous() if rows else torch.zeros((0, *rest), dtype=t.dtype)


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def ref_mxfp4(members: dict[str, torch.Tensor]) -> torch.Tensor:
    """OCP MX: 32 e2m1 codes a group (two a byte, low nibble first) times 2**(scale - 127),
    exact (float64), then bfloat16; [..., G, 16] and [..., G] -> [..., 32 G]."""
    blocks, scales = members.get("blocks"), members.get("scales")
    if blocks is None or scales is None or blocks.dim() < 3 or blocks.shape[-1] != 16 \
            or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise Invalid("mxfp4: not blocks [..., G, 16] with scales [..., G]")
    codes = torch.stack((blocks & 0xF, blocks >> 4), dim=-1).flatten(-2).long()
    values = torch.tensor(E2M1, dtype=torch.float64)[codes] * torch.exp2(scales.double() - 127)[..., None]
    return values.to(torch.bfloat16).flatten(-2)


# ------------------------------------------------------------------ affine and view ops (issue 25)


def ref_affine(t: torch.Tensor, verb: str, value: float, round_to: torch.dtype | None) -> torch.Tensor:
    """``(w.float() + c).to(w.dtype)`` (float64 for float64 tensors), the constant a float32
    (first rounded to ``round_to`` when given, as a model storing it as a tensor does)."""
    if not t.dtype.is_floating_point or t.dtype.itemsize == 1:
        raise Invalid(f"{verb} of {t.dtype}")
    compute = torch.float64 if t.dtype == torch.float64 else torch.float32
    c = torch.tensor(value, dtype=round_to or compute).to(compute)
    if verb == "divide" and c.item() == 0:
        raise Invalid("divide by 0")
    x = t.to(compute)
    out = x + c if verb == "add" else x * c if verb == "multiply" else x / c
    return out.to(t.dtype)


#: combine expressions over its input alone, and what each computes (in float32)
COMBINE_EXPRESSIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "x * 0.5 - x / 3": lambda x: x * 0.5 - x / 3,
    "-x + ${config.k * 2}": lambda x: -x + 3.0,
    "(x @ x.T) / 4": lambda x: torch.matmul(x, x.T) / 4,
    "x.T * x.T": lambda x: x.T * x.T,
}


def ref_combine(t: torch.Tensor, expr: str) -> torch.Tensor:
    """``expr`` computed in float32 from ``t`` widened, rounded once to ``t``'s dtype."""
    if not t.dtype.is_floating_point or t.dtype.itemsize == 1:
        raise Invalid(f"combine of {t.dtype}")
    if (".T" in expr or "@" in expr) and t.dim() != 2:
        raise Invalid(f"{expr} of a rank-{t.dim()} tensor")
    return COMBINE_EXPRESSIONS[expr](t.to(torch.float32)).to(t.dtype)


def ref_reshape(t: torch.Tensor, shape: list[int]) -> torch.Tensor:
    if shape.count(-1) > 1 or any(d < -1 for d in shape):
        raise Invalid("reshape: more than one -1")
    known = math.prod(d for d in shape if d != -1)
    if (-1 in shape and (known == 0 or t.numel() % known)) or (-1 not in shape and known != t.numel()):
        raise Invalid("reshape: another element count")
    return t.reshape(shape).contiguous()


def _dim_of(t: torch.Tensor, dim: int) -> int:
    rank = t.dim()
    if rank < 1 or not -rank <= dim < rank:
        raise Invalid("no such dim")
    return dim % rank


def ref_deinterleave(t: torch.Tensor, dim: int, names: list[str]) -> list[tuple[str, torch.Tensor]]:
    """Part i of n is ``t[..., i::n, ...]`` along dim."""
    d, n = _dim_of(t, dim), len(names)
    if t.shape[d] % n:
        raise Invalid("deinterleave: dim does not split into n parts")
    picked = t.movedim(d, 0)
    return [(name, picked[i::n].movedim(0, d).contiguous()) for i, name in enumerate(names)]


def ref_interleave(members: list[torch.Tensor], dim: int) -> torch.Tensor:
    first = members[0]
    d = _dim_of(first, dim)
    if len({(m.shape, m.dtype) for m in members}) > 1:
        raise Invalid("interleave of different shapes or dtypes")
    return torch.stack(members, d + 1).flatten(d, d + 1).contiguous()


def ref_split_heads(t: torch.Tensor, heads: int, names: list[str]) -> list[tuple[str, torch.Tensor]]:
    """Rows [heads, n, head_dim] -> n tensors of rows [heads, head_dim]."""
    rows, n = rows_of(t), len(names)
    if heads <= 0 or rows % (heads * n):
        raise Invalid("split_heads: rows are not heads x parts")
    rest = t.shape[1:]
    grouped = t.reshape(heads, n, rows // (heads * n), *rest)
    return [(name, grouped[:, p].reshape(rows // n, *rest).contiguous()) for p, name in enumerate(names)]


def ref_merge_heads(members: list[torch.Tensor], heads: int) -> torch.Tensor:
    first = members[0]
    rows = rows_of(first)
    if len({(m.shape, m.dtype) for m in members}) > 1 or heads <= 0 or rows % heads:
        raise Invalid("merge_heads: shapes differ or rows are not heads")
    rest = first.shape[1:]
    per = [m.reshape(heads, rows // heads, *rest) for m in members]
    return torch.stack(per, 1).reshape(rows * len(members), *rest).contiguous()


# ------------------------------------------------------------------ quantize (compressed-tensors' CPU path)

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def _quantizable(t: torch.Tensor) -> None:
    if t.dim() != 2 or t.dtype not in _FLOATS or t.shape[1] == 0:
        raise Invalid("quantize: not a 2-D floating-point weight with columns")


def ref_quantize_fp8(t: torch.Tensor, block: tuple[int, int] | None) -> list[tuple[str, torch.Tensor]]:
    """e4m3 codes and a scale per block (per row when ``block`` is None), the scale
    absmax / 448 in the weight's dtype (its epsilon when 0), the quotient rounded to the
    weight's dtype, clamped, then cast."""
    _quantizable(t)
    rows, cols = t.shape
    bh, bw = block or (1, max(cols, 1))
    padded = torch.nn.functional.pad(t, (0, -cols % bw, 0, -rows % bh))
    blocks = padded.unflatten(0, (-1, bh)).unflatten(2, (-1, bw))
    if blocks.numel():
        scale = blocks.abs().amax(dim=(1, 3)) / torch.tensor(448.0, dtype=t.dtype)
    else:
        scale = torch.zeros(blocks.shape[0], blocks.shape[2], dtype=t.dtype)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(t.dtype).eps, dtype=t.dtype), scale)
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return [("weight", q.flatten(2, 3).flatten(0, 1)[:rows, :cols].contiguous()), ("weight_scale", scale)]


def ref_quantize_nvfp4(t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """e2m1 codes two a byte, an e4m3 scale per 16 columns, one float32 global scale."""
    _quantizable(t)
    rows, cols = t.shape
    if cols % 16:
        raise Invalid("nvfp4: the row is not whole groups of 16")
    amax = t.abs().amax() if t.numel() else torch.tensor(0.0, dtype=t.dtype)
    glob = torch.nan_to_num(amax.clamp(min=torch.finfo(t.dtype).tiny).reciprocal() * 2688.0, nan=1.0, posinf=1.0,
                            neginf=1.0).float().reshape(1)
    if glob.item() == 1.0 and amax.item() != 0 and t.dtype == torch.float16:  # F16 overflowed: in float32
        glob = (amax.float().reciprocal() * 2688.0).reshape(1)
    groups = t.unflatten(-1, (-1, 16))
    local = (groups.abs().amax(-1) if groups.numel() else torch.zeros(rows, cols // 16, dtype=t.dtype)) \
        / torch.tensor(6.0, dtype=t.dtype)
    scale = (glob * local.float()).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.where(scale.float() == 0, torch.tensor(0.125), scale.float()).to(torch.float8_e4m3fn)
    q = (groups.float() / (scale.float() / glob)[..., None]).clamp(-6, 6).reshape(rows, cols)
    a = q.abs()
    codes = sum(((a >= b) if up else (a > b)).to(torch.uint8) for b, up in
                ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False)))
    codes = codes | ((q < 0).to(torch.uint8) << 3)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return [("weight_packed", packed.contiguous()), ("weight_scale", scale), ("weight_global_scale", glob)]
def e2m1_values(packed: torch.Tensor, signed_zero: bool) -> torch.Tensor:
    """float32 [rows, 2 * bytes] of packed e2m1 codes, low nibble first. ``signed_zero``:
    code 8 is -0.0 (compressed-tensors' unpack computes -1.0 * 0.0); else +0.0 (ModelOpt's table)."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).long()
    magnitude = torch.tensor(E2M1[:8])[codes & 7]
    negative = (codes & 8).bool()
    if signed_zero:
        return magnitude * torch.where(negative, -1.0, 1.0)
    return torch.where(negative, -magnitude, magnitude) + 0.0  # -0.0 + 0.0 is +0.0


def ref_scaled(members: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """compressed-tensors' decompress of FP8 (weight in the scale's dtype times the scale) and
    NVFP4 (codes times scale / global scale in float32), ModelOpt's NVFP4QTensor.dequantize
    (codes times scale * weight_scale_2); then ``dtype``."""
    scale = members["weight_scale"]
    if "weight_packed" in members:
        per_group = scale.float() / members["weight_global_scale"]
        values = e2m1_values(members["weight_packed"], signed_zero=True)
    elif "weight_scale_2" in members:
        per_group = scale.float() * members["weight_scale_2"]
        values = e2m1_values(members["weight"], signed_zero=False)
    else:
        return (members["weight"].to(scale.dtype) * scale).to(dtype)
    rows, cols = values.shape
    return (values.view(rows, cols // 16, 16) * per_group[:, :, None]).view(rows, cols).to(dtype)
