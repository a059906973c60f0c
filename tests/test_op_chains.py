"""The op contract, checked: random chains of every op after every other op, on random small
shapes and dtypes (hypothesis, derandomized, a bounded budget).

For each chain the test evaluates the same chain whole in torch, with each op written here
from its semantics in the design notes (structural-ops.md), not by calling ckptxform. The
reference also says when a chain is meaningless (a transpose of a vector, heads that do not
divide the rows, a mean of integers, a scale the block size does not explain...). Then:

- a chain the reference can evaluate plans, applies, and its output is bit for bit the
  reference's (keys, shapes, dtypes, bytes);
- any other chain fails at plan time with a PlanError naming the op (its verb and the
  rule's FILE:LINE), never at apply and never with an internal error.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tensor_bytes
from hypothesis import HealthCheck, event, find, given, settings
from hypothesis import strategies as st
from op_references import (
    Int4Module,
    Invalid,
    fp8_dequant,
    pack_nibbles,
    ref_affine,
    COMBINE_EXPRESSIONS,
    ref_combine,
    ref_concat,
    ref_concat_shards,
    ref_deinterleave,
    ref_dequant,
    ref_int4,
    ref_interleave,
    ref_merge_heads,
    ref_mxfp4,
    ref_permute,
    ref_quantize_fp8,
    ref_quantize_nvfp4,
    ref_qkv,
    ref_reshape,
    ref_resize,
    ref_rope,
    ref_scaled,
    ref_split,
    ref_split_heads,
    ref_stack,
    ref_transpose,
    rows_of,
)
from safetensors.torch import load_file, save_file

from ckptxform import api
from ckptxform.errors import PlanError

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I32": torch.int32}
Binding = tuple[tuple[str, str], ...]


# ------------------------------------------------------------------ chains


@dataclass
class Case:
    tensors: dict[str, torch.Tensor]
    key: str
    block: tuple[int, int] | None
    ops: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    kind: str = "plain"
    int4: dict[int, Int4Module] = field(default_factory=dict)
    #: the chain's reference output (key -> tensor), None once the chain is meaningless
    items: dict[Binding, torch.Tensor] | None = None
    free: list[str] = field(default_factory=list)
    #: how the template variable each split made names its parts (None: 0, 1, ...)
    split_names: dict[str, list[str] | None] = field(default_factory=dict)
    #: the vocabulary maps permute_rows ops read: name -> (target ids, vocabulary size)
    vocabs: dict[str, tuple[list[int], int]] = field(default_factory=dict)

    def to(self) -> str:
        parts = []
        for var in self.free:
            names = self.split_names.get(var)
            parts.append("{" + var + (":" + ",".join(names) if names else "") + "}")
        return ".".join(["y", *parts, "w"])

    def expected(self) -> dict[str, torch.Tensor]:
        assert self.items is not None
        out = {}
        for binding, value in self.items.items():
            names = dict(binding)
            out[".".join(["y", *(names[v] for v in self.free), "w"])] = value
        return out


def _order(var: str, present: list[str], case: Case) -> list[str]:
    names = case.split_names.get(var)
    if var == "T":
        return sorted(present)
    if names:
        return [m for m in names if m in present]
    return sorted(present, key=int)


def _reduce(case: Case, var: str, combine: Callable[[list[torch.Tensor], list[str]], torch.Tensor]) -> None:
    assert case.items is not None
    groups: dict[Binding, dict[str, torch.Tensor]] = {}
    for binding, value in case.items.items():
        bound = dict(binding)
        member = bound.pop(var)
        groups.setdefault(tuple(sorted(bound.items())), {})[member] = value
    out = {}
    for rest, members in groups.items():
        order = _order(var, list(members), case)
        out[rest] = combine([members[m] for m in order], order)
    case.items = out


def _map(case: Case, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    assert case.items is not None
    case.items = {b: fn(v) for b, v in case.items.items()}


def _split(case: Case, var: str, fn: Callable[[torch.Tensor], list[tuple[str, torch.Tensor]]]) -> None:
    assert case.items is not None
    case.items = {tuple(sorted((*b, (var, name)))): part for b, v in case.items.items() for name, part in fn(v)}


@st.composite
def cases(draw: Any, kinds: tuple[str, ...] = ("plain", "fp8", "int4", "mxfp4", "scaled"),
          quantize: bool = False) -> Case:
    seed = draw(st.integers(0, 2 ** 16))
    gen = torch.Generator().manual_seed(seed)
    experts = draw(st.integers(1, 3))
    kind = draw(st.sampled_from(list(kinds)))
    fp8 = kind == "fp8"
    tensors: dict[str, torch.Tensor] = {}
    if kind == "int4":
        case = _int4_case(draw, gen, experts, [16, 4, 8] if quantize else [4, 8, 16])  # NVFP4: 16s
    elif kind == "mxfp4":
        case = _mxfp4_case(draw, gen, experts)
    elif kind == "scaled":
        case = _scaled_case(draw, gen, experts)
    elif fp8:
        rows = draw(st.integers(1, 12))
        cols = draw(st.sampled_from([16, 32, 5])) if quantize else draw(st.integers(1, 12))  # NVFP4: 16s
        block = (draw(st.integers(1, 8)), draw(st.integers(1, 8)))
        srows, scols = -(-rows // block[0]), -(-cols // block[1])
        for e in range(experts):
            w = (torch.randn(rows, cols, generator=gen) * 4).to(torch.float8_e4m3fn)
            tensors[f"x.{e}.weight"] = w
            tensors[f"x.{e}.weight_scale_inv"] = torch.rand(srows, scols, generator=gen) + 0.25
        case = Case(tensors, "x.{E}.{T:weight,weight_scale_inv}", block, free=["E", "T"],
                    config={"quantization_config": {"quant_method": "fp8", "weight_block_size": list(block)}})
    elif kind == "bf16":  # floating-point weights, quantized by the last op
        rows, cols = draw(st.integers(1, 12)), draw(st.sampled_from([3, 16, 32]))
        dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
        for e in range(experts):
            tensors[f"x.{e}.weight"] = (torch.randn(rows, cols, generator=gen) * 4).to(dtype)
        case = Case(tensors, "x.{E}.weight", None, free=["E"])
    else:
        shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
        dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
        for e in range(experts):
            values = torch.randn(shape, generator=gen) * 8
            tensors[f"x.{e}.w"] = values.to(dtype)
        case = Case(tensors, "x.{E}.w", None, free=["E"])
    case.kind = kind
    case.items = {}
    for key, value in case.tensors.items():
        parts = key.split(".")
        binding = [("E", parts[1])] + ([("T", parts[2])] if kind not in ("plain", "bf16") else [])
        case.items[tuple(sorted(binding))] = value
    if kind == "int4":
        # dequant_int4 first: it reads weight_shape's two integers when it runs (a plan reads
        # headers only), so ops before it that resize its inputs alike are not decided at plan time
        group = case.config["quantization_config"]["config_groups"]["g"]["weights"]["group_size"]
        _apply(case, {"dequant_int4": {"over": "T"}}, lambda: _reduce(
            case, "T", lambda ms, names: ref_int4(dict(zip(names, ms)), case.int4, group)))
        case.free.remove("T")
    if kind == "mxfp4":  # its members are uint8: no op before it would keep them MXFP4
        _apply(case, {"dequant_mxfp4": {"over": "T"}}, lambda: _reduce(
            case, "T", lambda ms, names: ref_mxfp4(dict(zip(names, ms)))))
        case.free.remove("T")
    if kind == "scaled":  # dequant_scaled first too: it reads the global scale when it runs
        _apply(case, {"dequant_scaled": {"over": "T"}}, lambda: _reduce(
            case, "T", lambda ms, names: ref_scaled(dict(zip(names, ms)))))
        case.free.remove("T")
    for _ in range(draw(st.sampled_from([0, 0, 1, 2]) if quantize else st.integers(1, 4))):
        _draw_op(draw, case)
    if "T" in case.free:  # the FP8 members are consumed by a dequant, at the end if not before
        _apply(case, {"dequant_fp8_block": {"over": "T"}}, lambda: _reduce(
            case, "T", lambda ms, names: ref_dequant(dict(zip(names, ms)), case.block or (1, 1))))
        case.free.remove("T")
    if kind == "bf16" or quantize:  # after a dequant: dequantize -> quantize in one rule
        _draw_quantize(draw, case)
    return case


def _draw_quantize(draw: Any, case: Case) -> None:
    """A quantize op last (its parts are block outputs in e4m3 / packed bytes), into Q."""
    verb = draw(st.sampled_from(["quantize_fp8_block", "quantize_fp8_channel", "quantize_nvfp4"]))
    args: dict[str, Any] = {"into": "Q"}
    block = None
    if verb == "quantize_fp8_block":
        block = (draw(st.integers(1, 5)), draw(st.integers(1, 5)))
        args["block"] = list(block)
    nvfp4 = verb == "quantize_nvfp4"
    case.split_names["Q"] = ["weight", "weight_packed", "weight_scale", "weight_global_scale"] if nvfp4 \
        else ["weight", "weight_scale"]
    case.free.append("Q")

    def reference() -> None:
        if case.kind == "mxfp4":  # gpt-oss's X_blocks/X_scales: no member is the weight a quantize takes
            raise Invalid("quantize: the key after dequant_mxfp4 names no parameter")
        _split(case, "Q", ref_quantize_nvfp4 if nvfp4 else lambda t: ref_quantize_fp8(t, block))

    _apply(case, {verb: args}, reference)


def _int4_case(draw: Any, gen: torch.Generator, experts: int, group_sizes: list[int]) -> Case:
    """compressed-tensors pack-quantized int4 modules x.E (symmetric or not, scales bf16 or f32)."""
    rows, group, groups = draw(st.integers(1, 12)), draw(st.sampled_from(group_sizes)), draw(st.integers(1, 2))
    symmetric, sdtype = draw(st.booleans()), draw(st.sampled_from([torch.bfloat16, torch.float32]))
    cols = group * groups
    tensors: dict[str, torch.Tensor] = {}
    case = Case(tensors, "x.{E}.{T:weight_packed,weight_scale,weight_shape,weight_zero_point}", None,
                free=["E", "T"])
    for e in range(experts):
        q = torch.randint(0, 16, (rows, cols), generator=gen)
        scale = (torch.rand(rows, groups, generator=gen) + 0.01).to(sdtype)
        zp = None if symmetric else torch.randint(0, 16, (rows, groups), generator=gen)
        tensors[f"x.{e}.weight_packed"] = packed = pack_nibbles(q)
        tensors[f"x.{e}.weight_scale"] = scale
        tensors[f"x.{e}.weight_shape"] = torch.tensor([rows, cols], dtype=torch.int64)
        if zp is not None:  # 8 rows per word: nibble k of word [w, g] is row 8w + k
            tensors[f"x.{e}.weight_zero_point"] = pack_nibbles(zp.t().contiguous()).t().contiguous()
        case.int4[id(packed)] = Int4Module(q, zp, scale, group)
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": group, "symmetric": symmetric}
    case.config = {"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                           "config_groups": {"g": {"targets": ["Linear"], "weights": weights}}}}
    return case


def _mxfp4_case(draw: Any, gen: torch.Generator, experts: int) -> Case:
    """MXFP4 modules x.E: blocks [*lead, G, 16] uint8 and scales [*lead, G] (finite products)."""
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
    groups = draw(st.integers(1, 2))
    tensors: dict[str, torch.Tensor] = {}
    for e in range(experts):
        tensors[f"x.{e}.blocks"] = torch.randint(0, 256, (*lead, groups, 16), generator=gen, dtype=torch.uint8)
        tensors[f"x.{e}.scales"] = torch.randint(100, 150, (*lead, groups), generator=gen, dtype=torch.uint8)
    return Case(tensors, "x.{E}.{T:blocks,scales}", None, free=["E", "T"],
                config={"quantization_config": {"quant_method": "mxfp4"}})


def _scaled_case(draw: Any, gen: torch.Generator, experts: int) -> Case:
    """Modules x.E in one of the dequant_scaled schemes: compressed-tensors FP8 per tensor or
    channel (a float32 or bf16 scale), NVFP4 (compressed-tensors or ModelOpt)."""
    scheme = draw(st.sampled_from(["tensor", "channel", "nvfp4", "modelopt"]))
    rows, cols = draw(st.integers(1, 12)), 16 * draw(st.integers(1, 2))
    sdtype = draw(st.sampled_from([torch.bfloat16, torch.float32]))
    tensors: dict[str, torch.Tensor] = {}
    for e in range(experts):
        x = f"x.{e}."
        if scheme in ("tensor", "channel"):
            tensors[x + "weight"] = (torch.randn(rows, cols, generator=gen) * 4).to(torch.float8_e4m3fn)
            shape = (1,) if scheme == "tensor" else (rows, 1)
            tensors[x + "weight_scale"] = (torch.rand(shape, generator=gen) + 0.01).to(sdtype)
            tensors[x + "input_scale"] = torch.ones(1, dtype=sdtype)
            continue
        packed = torch.randint(0, 256, (rows, cols // 2), generator=gen, dtype=torch.uint8)
        scale = (torch.rand(rows, cols // 16, generator=gen) * 400).to(torch.float8_e4m3fn)
        tensors[x + "weight_scale"] = scale
        if scheme == "nvfp4":
            tensors[x + "weight_packed"] = packed
            tensors[x + "weight_global_scale"] = torch.rand(1, generator=gen) * 3e4 + 1
        else:
            tensors[x + "weight"] = packed
            tensors[x + "weight_scale_2"] = torch.rand((), generator=gen) * 1e-4
    if scheme == "modelopt":
        config: dict[str, Any] = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
    else:
        weights = ({"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
                   if scheme == "nvfp4" else {"num_bits": 8, "type": "float", "strategy": scheme})
        fmt = "nvfp4-pack-quantized" if scheme == "nvfp4" else "float-quantized"
        config = {"quant_method": "compressed-tensors", "format": fmt,
                  "config_groups": {"g": {"targets": ["Linear"], "weights": weights}}}
    return Case(tensors, "x.{E}.{T:weight,weight_packed,weight_scale,weight_global_scale,weight_scale_2,input_scale}",
                None, free=["E", "T"], config={"quantization_config": config})


def _apply(case: Case, op: dict[str, Any], reference: Callable[[], None]) -> None:
    case.ops.append(op)
    if case.items is None:
        return
    try:
        reference()
    except Invalid:
        case.items = None


def _shape(case: Case) -> tuple[int, ...]:
    if case.items:
        return tuple(next(iter(case.items.values())).shape)
    return (4, 4)


def _draw_op(draw: Any, case: Case) -> None:
    """One op the variables allow, with arguments that mostly fit the current shape."""
    shape = _shape(case)
    rank, rows = len(shape), (shape[0] if shape else 0)
    wild = draw(st.integers(0, 9)) == 0
    choices = ["transpose", "rope_permute", "rope_unpermute", "qkv_interleave", "qkv_deinterleave", "resize_rows",
               "permute_rows", "add", "multiply", "divide", "reshape", "concat_shards", "combine"]
    reducible = [v for v in case.free if v != "T"]
    choices += [f"{verb} {v}" for v in reducible for verb in ("stack", "concat", "interleave", "merge_heads")]
    if "T" in case.free:
        choices.append("dequant_fp8_block T")
    if "P" not in case.split_names:
        choices += ["unstack", "split", "deinterleave", "split_heads"]
    rope_fits = [h for h in range(1, rows + 1) if rows % h == 0 and (rows // h) % 2 == 0]
    qkv_fits = [(h, k) for k in range(1, 4) for h in range(k, 7, k) if rows and rows % (h + 2 * k) == 0]
    if not wild:  # mostly ops that fit, so that most chains get far
        unfit = {"transpose": rank < 2, "rope_permute": not rope_fits, "rope_unpermute": not rope_fits,
                 "qkv_interleave": not qkv_fits, "qkv_deinterleave": not qkv_fits, "permute_rows": rows == 0}
        choices = [c for c in choices if not unfit.get(c)]
    choice = draw(st.sampled_from(choices))
    verb, _, var = choice.partition(" ")

    def dim() -> int:
        return draw(st.integers(-3, 3)) if wild or rank == 0 else draw(st.integers(-rank, rank - 1))

    if verb in ("stack", "concat", "interleave", "merge_heads") and case.split_names.get(var):
        case.items = None  # a split names its parts by the enumeration in 'to', which P then leaves
    if verb == "concat_shards":
        d, first = dim(), not case.ops
        _apply(case, {"concat_shards": {"dim": d}}, lambda: _map(case, lambda t: ref_concat_shards(t, d, first)))
    elif verb == "transpose":
        d0, d1 = dim(), dim()
        _apply(case, {"transpose": [d0, d1]}, lambda: _map(case, lambda t: ref_transpose(t, d0, d1)))
    elif verb.startswith("rope"):
        heads = draw(st.sampled_from(rope_fits)) if rope_fits and not wild else draw(st.integers(1, 4))
        inverse = verb == "rope_unpermute"
        if draw(st.booleans()):  # the same permutation named by its head size
            size = rows // heads if rows % heads == 0 and rows else draw(st.integers(1, 4))
            _apply(case, {verb: {"head_dim": size}},
                   lambda: _map(case, lambda t: ref_rope(t, rows_of(t) // size if rows_of(t) % size == 0 else 0,
                                                         inverse)))
        else:
            _apply(case, {verb: {"heads": heads}}, lambda: _map(case, lambda t: ref_rope(t, heads, inverse)))
    elif verb.startswith("qkv"):
        heads, kv = (draw(st.sampled_from(qkv_fits)) if qkv_fits and not wild
                     else (draw(st.integers(1, 4)), draw(st.integers(1, 2))))
        inverse = verb == "qkv_deinterleave"
        _apply(case, {verb: {"heads": heads, "kv_heads": kv}},
               lambda: _map(case, lambda t: ref_qkv(t, heads, kv, inverse)))
    elif verb == "resize_rows":
        new = draw(st.integers(0, 9))
        fill = draw(st.sampled_from(["zeros", "mean", "normal"]))
        std, seed = draw(st.sampled_from([0.02, 1.5])), draw(st.integers(0, 5))
        args: dict[str, Any] = {"rows": new, "fill": fill}
        if fill == "normal":
            args.update(std=std, seed=seed)
        _apply(case, {"resize_rows": args}, lambda: _map(case, lambda t: ref_resize(t, new, fill, std, seed)))
    elif verb == "permute_rows":
        _draw_permutation(draw, case, rows + (1 if wild else 0))
    elif verb == "stack":
        case.free.remove(var)
        _apply(case, {"stack": {"over": var}}, lambda: _reduce(case, var, lambda ms, _: ref_stack(ms)))
    elif verb == "concat":
        case.free.remove(var)
        d = dim()
        _apply(case, {"concat": {"over": var, "dim": d}}, lambda: _reduce(case, var, lambda ms, _: ref_concat(ms, d)))
    elif verb in ("add", "multiply", "divide"):
        _draw_affine(draw, case, verb)
    elif verb == "combine":
        expr = draw(st.sampled_from(sorted(COMBINE_EXPRESSIONS)))
        case.config["k"] = 1.5
        _apply(case, {"combine": {"expr": expr}}, lambda: _map(case, lambda t: ref_combine(t, expr)))
    elif verb == "reshape":
        _draw_reshape(draw, case, shape, wild)
    elif verb == "interleave":
        case.free.remove(var)
        d = dim()
        _apply(case, {"interleave": {"over": var, "dim": d}},
               lambda: _reduce(case, var, lambda ms, _: ref_interleave(ms, d)))
    elif verb == "merge_heads":
        case.free.remove(var)
        heads = _fitting(draw, wild, [h for h in range(1, 5) if rows and rows % h == 0])
        _apply(case, {"merge_heads": {"over": var, "heads": heads}},
               lambda: _reduce(case, var, lambda ms, _: ref_merge_heads(ms, heads)))
    elif verb in ("deinterleave", "split_heads"):
        names = ["a", "b", "c"][:draw(st.integers(1, 3))]
        case.split_names["P"] = names
        case.free.append("P")
        if verb == "deinterleave":
            fits = [d for d in range(-rank, rank) if shape[d] % len(names) == 0]
            d = draw(st.sampled_from(fits)) if fits and not wild else dim()
            _apply(case, {"deinterleave": {"into": "P", "dim": d}},
                   lambda: _split(case, "P", lambda t: ref_deinterleave(t, d, names)))
        else:
            heads = _fitting(draw, wild, [h for h in range(1, 5) if rows and rows % (h * len(names)) == 0])
            _apply(case, {"split_heads": {"into": "P", "heads": heads}},
                   lambda: _split(case, "P", lambda t: ref_split_heads(t, heads, names)))
    elif verb == "dequant_fp8_block":
        case.free.remove("T")
        _apply(case, {"dequant_fp8_block": {"over": "T"}}, lambda: _reduce(
            case, "T", lambda ms, names: ref_dequant(dict(zip(names, ms)), case.block or (1, 1))))
    elif verb == "unstack":
        case.split_names["P"] = None
        case.free.append("P")
        _apply(case, {"unstack": {"into": "P"}}, lambda: _split(
            case, "P", lambda t: [(str(i), t[i].contiguous()) for i in range(rows_of(t))]))
    else:
        names = ["a", "b", "c"][:draw(st.integers(1, 3))]
        case.split_names["P"] = names
        case.free.append("P")
        d = dim()
        _apply(case, {"split": {"into": "P", "dim": d}}, lambda: _split(case, "P", lambda t: ref_split(t, d, names)))


def _draw_permutation(draw: Any, case: Case, rows: int) -> None:
    """Two maps over one vocabulary, the first drafting ``rows`` tokens, in any order."""
    vocab = rows + draw(st.integers(0, 4))
    source = draw(st.permutations(range(vocab)))[:rows]
    target = draw(st.permutations(range(vocab)))[:draw(st.integers(1, vocab))]
    n = len(case.vocabs)
    case.vocabs[f"v{n}"], case.vocabs[f"v{n + 1}"] = (list(source), vocab), (list(target), vocab)
    fill = draw(st.sampled_from(["zeros", "mean", "normal"]))
    std, seed = draw(st.sampled_from([0.02, 1.5])), draw(st.integers(0, 5))
    missing: dict[str, Any] = {"init": fill}
    if fill == "normal":
        missing.update(std=std, seed=seed)
    _apply(case, {"permute_rows": {"from": f"v{n}", "to": f"v{n + 1}", "missing_rows": missing}},
           lambda: _map(case, lambda t: ref_permute(t, list(source), list(target), fill, std, seed)))


def _fitting(draw: Any, wild: bool, fits: list[int]) -> int:
    """A head count that divides the rows (any of 1..4 when none does, or in a wild draw)."""
    return draw(st.sampled_from(fits)) if fits and not wild else draw(st.integers(1, 4))


def _draw_affine(draw: Any, case: Case, verb: str) -> None:
    """A constant (a literal, or an expression of the config) and its rounding."""
    value = draw(st.sampled_from([1, -0.5, 3.3, 1e-3, 0]))
    round_to = draw(st.sampled_from([None, "bfloat16", "float16", "tensor"]))
    args: Any = value if round_to is None and draw(st.booleans()) else {"value": value}
    if draw(st.booleans()):  # the same constant from the config, through the grammar
        field = f"c{len(case.ops)}"  # one field per op: each draws its own constant
        case.config[field] = value
        args = {"value": f"${{config.{field} * 1.0 + sqrt(0) ** 2}}"}
    if round_to is not None:
        args = {**(args if isinstance(args, dict) else {"value": args}), "round_value_to": round_to}
    torch_dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16}

    def reference(t: torch.Tensor) -> torch.Tensor:
        to = t.dtype if round_to == "tensor" else torch_dtypes.get(round_to or "")
        return ref_affine(t, verb, value, to)

    _apply(case, {verb: args}, lambda: _map(case, reference))


def _draw_reshape(draw: Any, case: Case, shape: tuple[int, ...], wild: bool) -> None:
    count = math.prod(shape)
    if wild:
        new = draw(st.lists(st.integers(-2, 6), min_size=1, max_size=3))
    else:  # a factorisation of the element count, one dim maybe -1
        new = [draw(st.sampled_from([d for d in range(1, count + 1) if count % d == 0] or [0]))]
        new.append(count // new[0] if new[0] else 0)
        if draw(st.booleans()):
            new[draw(st.integers(0, 1))] = -1
    _apply(case, {"reshape": new}, lambda: _map(case, lambda t: ref_reshape(t, new)))


# ------------------------------------------------------------------ the run


def _rule(case: Case) -> str:
    lines = ["version: 1", "sources: {model: {path: ./src}" + (", maps: {path: ./maps}}" if case.vocabs else "}"),
             "convert: model"]
    if case.vocabs:
        lines.append("vocab:")
        lines += [f"  {name}: {{source: maps, d2t: {name}.d2t, t2d: {name}.t2d, encoding: absolute}}"
                  for name in case.vocabs]
    lines += ["tensors:", f"  - key: '{case.key}'", f"    to: '{case.to()}'", "    ops:"]
    lines += [f"      - {json.dumps(op)}" for op in case.ops]
    return "\n".join(lines) + "\n"


def write_case(case: Case, root: Path) -> tuple[Path, Path]:
    """The source checkpoint (root/src) and the rule file of ``case``: (rule, src)."""
    src = root / "src"
    src.mkdir()
    save_file(case.tensors, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"model_type": "test", **case.config}))
    if case.vocabs:
        maps = root / "maps"
        maps.mkdir()
        vocab_tensors = {}
        for name, (ids, size) in case.vocabs.items():
            vocab_tensors[f"{name}.d2t"] = torch.tensor(ids, dtype=torch.int64)
            vocab_tensors[f"{name}.t2d"] = torch.zeros(size, dtype=torch.bool).index_fill_(0, torch.tensor(ids), True)
        save_file(vocab_tensors, str(maps / "model.safetensors"))
    rule = root / "rule.yaml"
    rule.write_text(_rule(case))
    return rule, src


def run_case(case: Case, root: Path) -> str:
    """Plan and apply ``case``; what happened (for the statistics)."""
    rule, src = write_case(case, root)
    text = _rule(case)
    if case.items is None:
        with pytest.raises(PlanError) as failure:
            api.apply(rule, out=root / "out", sources={"model": str(src)}, progress=False)
        message = str(failure.value)
        at = re.search(r"tensors\[0\]\.ops\[(\d+)\] (\w+) \(" + re.escape(str(rule)) + r":(\d+)\)", message)
        assert at, f"{message}\n{text}"
        index, verb, line = int(at[1]), at[2], int(at[3])
        assert verb == next(iter(case.ops[index])), f"{message}\n{text}"
        assert verb in text.splitlines()[line - 1], f"{message}\n{text}"
        assert not (root / "out").exists()
        return f"refused at {verb}"
    try:
        api.apply(rule, out=root / "out", sources={"model": str(src)}, progress=False)
    except PlanError as err:
        raise AssertionError(f"a chain the reference evaluates did not plan: {err}\n{text}") from None
    got: dict[str, torch.Tensor] = {}
    for file in sorted((root / "out").glob("*.safetensors")):
        got.update(load_file(str(file)))
    want = case.expected()
    assert sorted(got) == sorted(want), text
    for key, value in want.items():
        assert (got[key].dtype, tuple(got[key].shape)) == (value.dtype, tuple(value.shape)), f"{key}\n{text}"
        assert tensor_bytes(got[key]) == tensor_bytes(value), f"{key}\n{text}"
    return f"applied, {len(case.ops)} ops"


@settings(derandomize=True, max_examples=400, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_a_chain_that_plans_applies_and_equals_the_torch_reference(case: Case) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        permuted = " (permute_rows in the chain)" if any("permute_rows" in op for op in case.ops) else ""
        event(f"{case.kind}: {run_case(case, Path(tmp))}{permuted}")


@settings(derandomize=True, max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases(kinds=("bf16",)))
def test_a_chain_ending_in_a_quantize_op_equals_the_torch_reference(case: Case) -> None:
    """bf16/f16/f32 weights through random ops, then quantize_fp8_block / _channel / _nvfp4
    (its own search, so the chains above are drawn as before)."""
    with tempfile.TemporaryDirectory() as tmp:
        event(f"{case.ops[-1] and next(iter(case.ops[-1]))}: {run_case(case, Path(tmp))}")


@settings(derandomize=True, max_examples=100, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases(kinds=("fp8", "int4", "scaled", "mxfp4"), quantize=True))
def test_a_dequantize_then_quantize_chain_writes_what_the_quantize_declares(case: Case) -> None:
    """Every dequant op, random ops, then every quantize op, in one rule: the parts the
    quantize writes, bit for bit the reference's (once a rule of dequant_fp8_block then
    quantize_nvfp4 wrote the bf16 weights under an NVFP4 config: the quantize saw 'X.{T}')."""
    with tempfile.TemporaryDirectory() as tmp:
        event(f"{case.kind} -> {next(iter(case.ops[-1]))}: {run_case(case, Path(tmp))}")


@pytest.mark.parametrize("kind", ["fp8", "int4", "scaled"])
@pytest.mark.parametrize("verb", ["quantize_fp8_block", "quantize_fp8_channel", "quantize_nvfp4"])
def test_every_dequant_then_every_quantize_applies(kind: str, verb: str) -> None:
    """Each pair at least once where the reference evaluates it (the search above may miss one)."""
    case = find(cases(kinds=(kind,), quantize=True),
                lambda c: c.items is not None and verb in c.ops[-1] and len(c.ops) == 2,
                settings=settings(derandomize=True, database=None, max_examples=2000,
                                  suppress_health_check=list(HealthCheck)))
    with tempfile.TemporaryDirectory() as tmp:
        assert run_case(case, Path(tmp)) == "applied, 2 ops"


# ------------------------------------------------------------------ chains the search once failed on


def _chain(case: Case, steps: list[tuple[dict[str, Any], Callable[[], None]]]) -> None:
    """``case`` through ``steps`` (from its tensors, bound to E = 0 and T = the last key segment, at first)."""
    if not case.ops:
        case.items = {tuple(sorted([("E", "0")] + ([("T", k.split(".")[2])] if "T" in case.free else []))): v
                      for k, v in case.tensors.items()}
    for op, reference in steps:
        _apply(case, op, reference)


def test_a_mean_row_rounds_through_float32_as_torch_does(tmp_path: Path) -> None:
    """One bf16 column of the dequantized experts is -2048, 2 and -2**-26 after the transpose:
    their float64 mean, -682.000000005, is -682 in float32, a bf16 tie (torch: -680), while
    rounding it once gives -684."""
    gen = torch.Generator().manual_seed(1)
    tensors = {"x.0.blocks": torch.randint(0, 256, (2, 3, 1, 16), generator=gen, dtype=torch.uint8),
               "x.0.scales": torch.randint(100, 150, (2, 3, 1), generator=gen, dtype=torch.uint8)}
    case = Case(tensors, "x.{E}.{T:blocks,scales}", None, free=["E", "T"], kind="mxfp4",
                config={"quantization_config": {"quant_method": "mxfp4"}})
    _chain(case, [({"dequant_mxfp4": {"over": "T"}},
                   lambda: _reduce(case, "T", lambda ms, names: ref_mxfp4(dict(zip(names, ms)))))])
    case.free.remove("T")
    _chain(case, [({"transpose": [0, 1]}, lambda: _map(case, lambda t: ref_transpose(t, 0, 1))),
                  ({"qkv_interleave": {"heads": 1, "kv_heads": 1}},
                   lambda: _map(case, lambda t: ref_qkv(t, 1, 1, False))),
                  ({"resize_rows": {"rows": 9, "fill": "mean"}},
                   lambda: _map(case, lambda t: ref_resize(t, 9, "mean", 0.02, 0)))])
    assert case.items is not None
    assert case.expected()["y.0.w"][3, 0, 30].item() == -680.0
    assert run_case(case, tmp_path) == "applied, 4 ops"


_NO_ROWS = {"resize_rows": {"rows": 0}}


def test_a_transpose_of_a_tensor_with_no_rows_writes_an_empty_tensor(tmp_path: Path) -> None:
    case = Case({"x.0.w": torch.ones(3, 4, dtype=torch.bfloat16)}, "x.{E}.w", None, free=["E"])
    _chain(case, [(_NO_ROWS, lambda: _map(case, lambda t: ref_resize(t, 0, "zeros", 0.02, 0))),
                  ({"transpose": [0, 1]}, lambda: _map(case, lambda t: ref_transpose(t, 0, 1)))])
    assert run_case(case, tmp_path) == "applied, 2 ops"
    assert case.expected()["y.0.w"].shape == (4, 0)


def test_a_dequant_of_an_fp8_weight_with_no_columns_writes_an_empty_tensor(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = {"x.0.weight": (torch.randn(4, 5, generator=gen) * 4).to(torch.float8_e4m3fn),
               "x.0.weight_scale_inv": torch.rand(2, 3, generator=gen) + 0.25}
    case = Case(tensors, "x.{E}.{T:weight,weight_scale_inv}", (2, 2), free=["E", "T"], kind="fp8",
                config={"quantization_config": {"quant_method": "fp8", "weight_block_size": [2, 2]}})
    _chain(case, [(_NO_ROWS, lambda: _map(case, lambda t: ref_resize(t, 0, "zeros", 0.02, 0))),
                  ({"transpose": [0, 1]}, lambda: _map(case, lambda t: ref_transpose(t, 0, 1))),
                  ({"dequant_fp8_block": {"over": "T"}},
                   lambda: _reduce(case, "T", lambda ms, names: ref_dequant(dict(zip(names, ms)), (2, 2))))])
    case.free.remove("T")
    assert run_case(case, tmp_path) == "applied, 3 ops"
    assert case.expected()["y.0.w"].shape == (5, 0)


def test_dequant_fp8_block_then_quantize_nvfp4_writes_nvfp4_under_its_config(tmp_path: Path) -> None:
    """Issue 37 item 4: the one-rule chain writes what the two steps write (the e4m3 x
    scale product in bf16, then NVFP4), every module quantized, under the NVFP4 config it sets."""
    case = _fp8_case(24, 48, (16, 16), [])
    case.key, case.free, case.split_names["Q"] = case.key, ["E", "Q"], \
        ["weight", "weight_packed", "weight_scale", "weight_global_scale"]
    case.ops.append({"quantize_nvfp4": {"into": "Q"}})
    _split(case, "Q", ref_quantize_nvfp4)
    rule, src = write_case(case, tmp_path)
    rule.write_text(rule.read_text() + "config:\n  from: model\n  set:\n    quantization_config:\n"
                    "      {quant_method: compressed-tensors, format: nvfp4-pack-quantized, ignore: [],\n"
                    "       config_groups: {g: {targets: [Linear]}}}\n")
    api.apply(rule, out=tmp_path / "out", sources={"model": str(src)}, progress=False)
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    want = case.expected()
    assert sorted(got) == sorted(want) == [f"y.0.{part}.w" for part in ("weight_global_scale", "weight_packed",
                                                                          "weight_scale")]
    for key, value in want.items():
        assert tensor_bytes(got[key]) == tensor_bytes(value), key
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"]["format"] == "nvfp4-pack-quantized"
    audit = [json.loads(line) for line in (tmp_path / "out" / "ckptxform_audit.jsonl").read_text().splitlines()]
    assert {r["key"]: r["action"] for r in audit if r.get("key", "").startswith("m.0.")} == \
        {"m.0.weight": "transformed", "m.0.weight_scale_inv": "transformed"}


def test_a_quantize_after_a_dequant_naming_no_weight_is_refused(tmp_path: Path) -> None:
    """gpt-oss's X_blocks/X_scales: after dequant_mxfp4 nothing says which parameter the tensor
    is, so a quantize refuses it at plan time instead of keeping it unquantized."""
    tensors = {"x.0.blocks": torch.zeros(2, 1, 16, dtype=torch.uint8), "x.0.scales": torch.full((2, 1), 127, dtype=torch.uint8)}
    case = Case(tensors, "x.{E}.{T:blocks,scales}", None, free=["E", "Q"], kind="mxfp4",
                ops=[{"dequant_mxfp4": {"over": "T"}}, {"quantize_nvfp4": {"into": "Q"}}],
                split_names={"Q": ["weight", "weight_packed", "weight_scale", "weight_global_scale"]},
                config={"quantization_config": {"quant_method": "mxfp4"}})
    assert run_case(case, tmp_path) == "refused at quantize_nvfp4"


# ------------------------------------------------------------------ the chains of issue 21


def _fp8_case(rows: int, cols: int, block: tuple[int, int], ops: list[dict[str, Any]]) -> Case:
    gen = torch.Generator().manual_seed(rows * 31 + cols)
    w = (torch.randn(rows, cols, generator=gen) * 4).to(torch.float8_e4m3fn)
    s = torch.rand(-(-rows // block[0]), -(-cols // block[1]), generator=gen) + 0.25
    case = Case({"m.0.weight": w, "m.0.weight_scale_inv": s}, "m.{E}.{T:weight,weight_scale_inv}", block,
                ops=[{"dequant_fp8_block": {"over": "T"}}, *ops], free=["E"],
                config={"quantization_config": {"quant_method": "fp8", "weight_block_size": list(block)}})
    case.items = {(("E", "0"),): fp8_dequant(w, s, block)}
    return case


@pytest.mark.parametrize("rows, cols, block", [(37, 21, (8, 8)), (300, 40, (128, 16)), (16, 16, (16, 16))])
def test_dequant_then_transpose_is_dequantize_then_transpose_in_torch(tmp_path: Path, rows: int, cols: int,
                                                                       block: tuple[int, int]) -> None:
    case = _fp8_case(rows, cols, block, [{"transpose": [0, 1]}])
    assert case.items is not None
    case.items = {b: v.t().contiguous() for b, v in case.items.items()}
    assert run_case(case, tmp_path) == "applied, 2 ops"


@pytest.mark.parametrize("rows, heads, block", [(32, 2, (8, 8)), (48, 4, (5, 7)), (256, 1, (128, 128))])
def test_dequant_then_rope_permute_is_dequantize_then_permute_in_torch(tmp_path: Path, rows: int, heads: int,
                                                                       block: tuple[int, int]) -> None:
    case = _fp8_case(rows, 24, block, [{"rope_permute": {"heads": heads}}])
    assert case.items is not None
    case.items = {b: ref_rope(v, heads, inverse=False) for b, v in case.items.items()}
    assert run_case(case, tmp_path) == "applied, 2 ops"


def test_an_op_given_what_it_does_not_take_is_refused_naming_it(tmp_path: Path) -> None:
    """unstack makes scalars; rope_permute takes rows (it once planned and wrote 0 bytes)."""
    case = Case({"x.0.w": torch.ones(4)}, "x.{E}.w", None,
                ops=[{"unstack": {"into": "P"}}, {"rope_permute": {"heads": 1}}], free=["E", "P"],
                split_names={"P": None})
    rule, src = write_case(case, tmp_path)
    with pytest.raises(PlanError) as failure:
        api.apply(rule, out=tmp_path / "out", sources={"model": str(src)}, progress=False)
    assert str(failure.value) == (f"tensors[0].ops[1] rope_permute ({rule}:9): rope_permute takes tensors of "
                                  "rank at least 1, and this one has shape []")
    assert not (tmp_path / "out").exists()


def test_a_block_op_that_cannot_make_a_range_of_rows_is_refused_before_an_op_reading_it(tmp_path: Path) -> None:
    """The other half of the contract: an op reads a block op's output by rows, so a block op
    that can only make its whole output (``row_sliced = False``) must end its chain."""
    from dataclasses import replace

    from ckptxform.ops.base import Step
    from ckptxform.ops.transpose import Transpose
    from ckptxform.rules.loader import load_rules

    class WholeOnly(Transpose):
        verb = "whole_only"
        row_sliced = False

    case = Case({"x.0.w": torch.ones(4, 6)}, "x.{E}.w", None,
                ops=[{"transpose": [0, 1]}, {"rope_permute": {"heads": 1}}], free=["E"])
    rule_file, src = write_case(case, tmp_path)
    rules = load_rules(rule_file)
    rule = rules.tensors[0]
    first = rule.ops[0]
    rules = replace(rules, tensors=(replace(rule, ops=(Step(WholeOnly(), first.args, first.where), rule.ops[1])),))
    with pytest.raises(PlanError) as failure:
        api.plan(rules, sources={"model": str(src)})
    assert str(failure.value) == (f"tensors[0].ops[1] rope_permute ({rule_file}:9): rope_permute reads its input by "
                                  "rows, and the output of whole_only cannot be made a range of rows at a time; "
                                  "whole_only must be the last op of the chain")
    # the same chain with the real transpose (row-sliced) plans
    api.plan(rule_file, sources={"model": str(src)}).close()
