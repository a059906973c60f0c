"""The elementwise affine ops (add, multiply, divide) and the view ops (reshape,
deinterleave/interleave, split_heads/merge_heads) of issue 25, against torch's own
arithmetic and indexing; their refusals and their inverses through ``ckptxform invert``.

tests/test_op_chains.py runs every op after every other op; this file pins what that
random search cannot: bit-exactness on many values of every float dtype, a block program
asked for any range of rows, the overflow and plan-time refusals word for word, and the
inverse rules.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tensor_bytes
from safetensors.torch import load_file, save_file

from ckptxform import api
from ckptxform.errors import CheckpointFormatError, PlanError
from ckptxform.ops import OPS
from ckptxform.ops.base import Block, InputTensor, Run, View
from ckptxform.rules.expr import ExpressionError, parse_expression

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64"}


def convert(tmp_path: Path, tensors: dict[str, torch.Tensor], body: str, config: dict[str, Any] | None = None,
            ) -> dict[str, torch.Tensor]:
    """Apply a rule (``tensors:`` and what follows) to a source of ``tensors``; the output."""
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    save_file(tensors, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"model_type": "test", **(config or {})}))
    rule = tmp_path / "rule.yaml"
    rule.write_text("version: 1\nsources: {model: {path: ./src}}\nconvert: model\n" + textwrap.dedent(body))
    api.apply(rule, out=tmp_path / "out", sources={"model": str(src)}, progress=False)
    out: dict[str, torch.Tensor] = {}
    for file in sorted((tmp_path / "out").glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


# ------------------------------------------------------------------ the expression grammar


@pytest.mark.parametrize(("text", "value"), [
    ("2 ** 10", 1024), ("2 ** -1", 0.5), ("-2 ** 2", -4), ("2 ** 3 ** 2", 512), ("sqrt(16)", 4.0),
    ("sqrt(2048) * 1.5e-1", math.sqrt(2048) * 0.15), ("1.0 + 7 // 2", 4.0), ("(1 + 1) ** 0.5", 2 ** 0.5),
    ("1e3", 1000.0),
])
def test_expressions_compute_floats_powers_and_square_roots_as_python_does(text: str, value: Any) -> None:
    got = parse_expression("${" + text + "}").evaluate(lambda ref: 0)
    assert got == value and type(got) is type(value)


def test_a_config_float_reaches_the_arithmetic() -> None:
    got = parse_expression("${sqrt(config.hidden_size) * config.scale}").evaluate(
        lambda ref: {"config.hidden_size": 3072, "config.scale": 0.5}[ref.text()])
    assert got == math.sqrt(3072) * 0.5


@pytest.mark.parametrize(("text", "message"), [
    ("${sqrt(0 - 4)}", "${sqrt(0 - 4)}: sqrt of -4, a negative number"),
    ("${7.5 // 2}", "${7.5 // 2}: // takes integers, and 7.5 // 2 has a float"),
    ("${0 ** -1}", "${0 ** -1}: division by zero"),
    ("${2 ** 65}", "${2 ** 65}: 2 ** 65 has more than 64 bits"),
    ("${1e308 * 10.0}", "${1e308 * 10.0}: the result is inf, not a finite number"),
    ("${(0 - 8) ** 0.5}", "${(0 - 8) ** 0.5}: -8 ** 0.5 is not a real number"),
])
def test_arithmetic_that_has_no_finite_answer_is_an_error(text: str, message: str) -> None:
    with pytest.raises(ExpressionError) as err:
        parse_expression(text).evaluate(lambda ref: 0)
    assert str(err.value) == message


def test_sqrt_must_be_called() -> None:
    with pytest.raises(ExpressionError) as err:
        parse_expression("${sqrt(2}")
    assert str(err.value) == "'(' at column 5 of '${sqrt(2}' is never closed"


# ------------------------------------------------------------------ affine: values


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("verb", "constant"), [("add", 1.0), ("add", -0.3), ("multiply", 45.254833995939045),
                                                ("multiply", 1e-3), ("divide", 3.3)])
def test_affine_ops_are_bit_exact_with_torch_in_float32(tmp_path: Path, dtype: torch.dtype, verb: str,
                                                       constant: float) -> None:
    """``(w.float() OP c).to(w.dtype)``, the constant a float32 (float64 for F64 tensors), on
    random values of every exponent, signed zeros and subnormals."""
    gen = torch.Generator().manual_seed(len(verb) * 7 + int(constant * 10))
    low, high = (-14, 6) if dtype == torch.float16 else (-30, 30)  # no overflow of float16
    values = torch.randn(61, 37, generator=gen, dtype=torch.float64) * torch.exp2(
        torch.randint(low, high, (61, 37), generator=gen).to(torch.float64))
    values[0, :4] = torch.tensor([0.0, -0.0, 1e-40, -1e-45], dtype=torch.float64)
    w = values.to(dtype)
    got = convert(tmp_path, {"w": w}, f"tensors:\n  - key: w\n    ops: [{{{verb}: {constant!r}}}]\n")["w"]
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    x, c = w.to(compute), torch.tensor(constant, dtype=compute)
    want = (x + c if verb == "add" else x * c if verb == "multiply" else x / c).to(dtype)
    assert got.dtype == dtype and tensor_bytes(got) == tensor_bytes(want)


def test_gemma_normalizer_is_rounded_to_the_tensor_dtype_before_the_product(tmp_path: Path) -> None:
    """round_value_to: tensor is what Gemma does (``torch.tensor(hidden_size**0.5, dtype=x.dtype)``);
    without it the float32 constant gives other values."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 48, generator=gen).to(torch.bfloat16)
    body = """\
        tensors:
          - key: '{N:a,b}'
            ops: [{multiply: {value: '${sqrt(config.hidden_size)}', round_value_to: tensor}}]
        """
    got = convert(tmp_path, {"a": w, "b": w.clone()}, body, {"hidden_size": 3072})
    normalizer = torch.tensor(3072 ** 0.5, dtype=torch.bfloat16)
    assert tensor_bytes(got["a"]) == tensor_bytes(w * normalizer)
    assert tensor_bytes(got["a"]) != tensor_bytes((w.float() * 3072 ** 0.5).to(torch.bfloat16))


def _input(raw: bytes, view: View) -> InputTensor:
    return InputTensor(view, lambda start, length: raw[start:start + length])


@pytest.mark.parametrize("verb", ["add", "multiply", "divide", "deinterleave", "interleave"])
def test_block_programs_make_any_range_of_rows_in_pieces_of_the_chunk(verb: str) -> None:
    """What a later op (or a shard boundary) asks of a block program: rows ``a..b``, made
    a bounded block at a time; they must be the same bytes as the whole output's."""
    gen = torch.Generator().manual_seed(11)
    t = torch.randn(13, 6, 4, generator=gen).to(torch.bfloat16)
    raw = tensor_bytes(t)
    view = View(tuple(t.shape), "BF16", (Run(0, 0, len(raw)),))
    op = OPS[verb]
    if verb in ("add", "multiply", "divide"):
        block = Block(op, {"value": 0.7, "compute": "F32", "what": "test"}, (view,), view.shape, "BF16")
        inputs = [_input(raw, view)]
    elif verb == "deinterleave":
        block = Block(op, {"dim": 1, "parts": 3, "part": 1}, (view,), (13, 2, 4), "BF16")
        inputs = [_input(raw, view)]
    else:
        block = Block(op, {"dim": 2}, (view, view), (13, 6, 8), "BF16")
        inputs = [_input(raw, view), _input(raw, view)]
    whole = b"".join(bytes(p) for p in op.blocks(block, inputs, 1 << 20))
    row = len(whole) // 13
    for rows, chunk in [(range(13), 1), (range(4, 9), 100), (range(12, 13), 7), (range(3, 3), 1)]:
        pieces = [bytes(p) for p in op.blocks(block, inputs, chunk, rows)]
        assert b"".join(pieces) == whole[rows.start * row:rows.stop * row]
        assert all(len(p) <= max(chunk, row * (2 if verb == "interleave" else 1)) for p in pieces)


@pytest.mark.parametrize(("dtype", "factor", "shown"), [
    (torch.float32, 2, "3e+38 becomes inf"),
    (torch.float16, 3, "30000.0 becomes inf"),      # finite in float32, beyond float16's 65504
    (torch.bfloat16, 2, "2.897717e+38 becomes inf")])  # bf16(2.9e38), doubled
def test_an_overflow_is_an_error_naming_the_tensor_and_index(tmp_path: Path, dtype: torch.dtype, factor: int,
                                                             shown: str) -> None:
    big = {torch.float32: 3e38, torch.float16: 30000.0, torch.bfloat16: 2.9e38}[dtype]
    w = torch.tensor([[1.0, 2.0], [big, float("inf")]]).to(dtype)
    with pytest.raises(CheckpointFormatError) as err:
        convert(tmp_path, {"w": w}, f"tensors:\n  - key: w\n    ops: [{{multiply: {factor}}}]\n")
    rule = tmp_path / "rule.yaml"
    assert str(err.value) == (f"tensors[0].ops[0] multiply ({rule}:6): {shown} at [1, 0]: the result overflows "
                              f"{NAMES[dtype]}; cast to a wider dtype first, or use a smaller constant")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("dtype", "ops", "message"), [
    (torch.int32, "[{add: 1}]", "add takes BF16, F16, F32, F64 tensors, and this one is I32"),
    (torch.float32, "[{divide: '${config.zero * 1.0}'}]",
     "divide by '${config.zero * 1.0}': the constant is 0 in F32; nothing can be divided by it"),
    (torch.float32, "[{add: '${config.name}'}]", "add.value: '${config.name}' is 'gemma', not a finite number"),
    (torch.float32, "[{reshape: [5, -1]}]",
     "reshape.shape [5, -1]: 12 elements do not fill the other dims (5 elements each) a whole number of times"),
    (torch.float32, "[{reshape: [5, 2]}]",
     "reshape to [5, 2] makes 10 elements, and the tensor (shape [3, 4]) has 12: a reshape keeps every element"),
    (torch.float32, "[{reshape: {shape: [12], from: [4, 3]}}]",
     "reshape: from is [4, 3] but the tensor has shape [3, 4]"),
])
def test_a_chain_the_op_cannot_run_is_refused_at_plan_time(tmp_path: Path, dtype: torch.dtype, ops: str,
                                                           message: str) -> None:
    w = torch.arange(12).reshape(3, 4).to(dtype)
    with pytest.raises(PlanError) as err:
        convert(tmp_path, {"w": w}, f"tensors:\n  - key: w\n    ops: {ops}\n", {"zero": 0, "name": "gemma"})
    verb = ops.split("{")[1].split(":")[0]
    assert str(err.value) == f"tensors[0].ops[0] {verb} ({tmp_path / 'rule.yaml'}:6): {message}"


def test_reshape_moves_no_byte_and_reads_back_through_later_ops(tmp_path: Path) -> None:
    """GPT-NeoX's fused qkv viewed [heads, 3, head_dim, hidden] is a relabelling; after a
    transpose (a block op) it still reads the transposed bytes."""
    w = torch.randn(24, 5).to(torch.bfloat16)
    got = convert(tmp_path, {"w": w, "v": w.clone()}, """\
        tensors:
          - key: w
            ops: [{reshape: [4, 3, 2, 5]}]
          - key: v
            ops: [{transpose: [0, 1]}, {reshape: {shape: [-1, 8], from: [5, 24]}}]
        """)
    assert tensor_bytes(got["w"]) == tensor_bytes(w) and tuple(got["w"].shape) == (4, 3, 2, 5)
    assert tensor_bytes(got["v"]) == tensor_bytes(w.t().reshape(-1, 8)) and tuple(got["v"].shape) == (15, 8)


# ------------------------------------------------------------------ inverses


def invert(rule: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptxform", "invert", str(rule)], check=False, capture_output=True,
                          text=True, timeout=120)


def test_invert_refuses_a_rounding_op_naming_it_and_its_line(tmp_path: Path) -> None:
    rule = tmp_path / "r.yaml"
    rule.write_text("version: 1\nsources: {model: {path: ./src}}\nconvert: model\ntensors:\n"
                    "  - key: '{X*}.norm.weight'\n    ops:\n      - add: 1\n  - match: '.+'\n")
    done = invert(rule)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (f"{rule}:5: tensors[0] has no inverse: ops[0] add: add rounds each "
                           "value to the tensor's dtype, so the opposite op gives it back only to within one "
                           "rounding (in bfloat16, 0.001 + 1 - 1 is 0); add inverse_lossy: accept to the op if "
                           "that is close enough\n")


def test_accepted_lossy_inverses_and_view_inverses_undo_the_forward(tmp_path: Path) -> None:
    """add <-> add of the negated constant, multiply <-> divide, reshape (with from) <->
    reshape, deinterleave <-> interleave, split_heads <-> merge_heads: the inverse rule
    written by ``invert`` turns the output back into the source (the affine ops to within
    one rounding, here exactly, on values the rounding keeps)."""
    gen = torch.Generator().manual_seed(4)
    src = {"a.norm": torch.randint(-64, 64, (8,), generator=gen).to(torch.bfloat16) / 8,
           "b.embed": torch.randint(-64, 64, (6, 4), generator=gen).to(torch.float32) / 4,
           "c.qkv": torch.randn(18, 4, generator=gen).to(torch.bfloat16),
           "d.gate_up": torch.randn(3, 4, 10, generator=gen).to(torch.bfloat16),
           "e.w": torch.randn(6, 4, generator=gen),
           "f.bias": torch.randint(-64, 64, (5,), generator=gen).to(torch.float32) / 4}
    (tmp_path / "src").mkdir()
    save_file(src, str(tmp_path / "src" / "model.safetensors"))
    (tmp_path / "src" / "config.json").write_text(json.dumps({"hidden_size": 64}))
    rule = tmp_path / "fwd.yaml"
    rule.write_text(textwrap.dedent("""\
        version: 1
        sources: {model: {path: ./src}}
        convert: model
        tensors:
          - key: a.norm
            ops: [{add: {value: 1, inverse_lossy: accept}}]
          - key: b.embed
            ops: [{multiply: {value: '${sqrt(config.hidden_size)}', inverse_lossy: accept}}]
          - key: c.qkv
            to: 'c.{P:q,k,v}'
            ops: [{split_heads: {into: P, heads: 3}}]
          - key: d.gate_up
            to: 'd.{P:gate,up}'
            ops: [{deinterleave: {into: P, dim: -1}}]
          - key: e.w
            ops: [{reshape: {shape: [2, 3, 4], from: [6, 4]}}]
          - key: f.bias
            ops: [{add: {value: '${config.hidden_size // 16 * 1.5}', inverse_lossy: accept}}]
        config: {from: model}
        """))
    api.apply(rule, out=tmp_path / "fwd", sources={"model": str(tmp_path / "src")}, progress=False)
    done = invert(rule)
    assert done.returncode == 0, done.stderr
    assert "'${-(1)}'" not in done.stdout and "value: -1" in done.stdout
    assert "${-(config.hidden_size // 16 * 1.5)}" in done.stdout
    (tmp_path / "inv.yaml").write_text(done.stdout)
    api.apply(tmp_path / "inv.yaml", out=tmp_path / "back", sources={"model": str(tmp_path / "fwd")},
              progress=False)
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(back) == sorted(src)
    for key, value in src.items():
        assert back[key].dtype == value.dtype and back[key].shape == value.shape and tensor_bytes(back[key]) == tensor_bytes(value), key
