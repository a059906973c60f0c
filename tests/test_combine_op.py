"""combine: random expressions over random small shapes, planned and applied by the engine
(in bands of 64 rows: the chunk size is made tiny), each equal to the whole-tensor torch
evaluation of the same expression; and its plan-time errors, each naming the input and
the rule's FILE:LINE."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tensor_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from ckptxform import api
from ckptxform.engine.plan import recipes
from ckptxform.errors import CkptxformError, PlanError

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class Gen:
    """A random expression of a given shape, as text and as a torch function of the inputs."""

    def __init__(self, draw: Any, rows: int, cols: int) -> None:
        self.draw, self.rows, self.cols = draw, rows, cols
        self.inputs: dict[str, tuple[torch.Tensor, str]] = {}  # name -> (tensor, source)

    def tensor(self, shape: tuple[int, ...]) -> str:
        name = f"I{len(self.inputs)}"
        dtype = self.draw(st.sampled_from(sorted(DTYPES)))
        seed = self.draw(st.integers(0, 1 << 16))
        values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 4
        self.inputs[name] = (values.to(DTYPES[dtype]), self.draw(st.sampled_from(["model", "other"])))
        return name

    def expr(self, shape: tuple[int, ...], depth: int) -> tuple[str, Any]:
        choices = ["leaf"] + (["matmul", "T", "ew", "ew", "neg"] if depth > 0 else [])
        if len(shape) != 2:
            choices = [c for c in choices if c not in ("matmul", "T")]
        kind = self.draw(st.sampled_from(choices))
        if kind == "leaf":
            if shape == (self.rows, self.cols) and self.draw(st.booleans()):
                return "x", lambda env: env["x"]
            name = self.tensor(shape)
            return name, lambda env: env[name]
        if kind == "neg":
            text, fn = self.expr(shape, depth - 1)
            return f"-{text}", lambda env: -fn(env)
        if kind == "T":
            text, fn = self.expr((shape[1], shape[0]), depth - 1)
            return f"({text}).T", lambda env: fn(env).T
        if kind == "matmul":
            k = self.draw(st.integers(1, 9))
            lt, lf = self.expr((shape[0], k), depth - 1)
            rt, rf = self.expr((k, shape[1]), depth - 1)
            return f"({lt} @ {rt})", lambda env: torch.matmul(lf(env), rf(env))
        op = self.draw(st.sampled_from(["+", "-", "*", "/"]))
        lt, lf = self.expr(shape, depth - 1)
        other = self.draw(st.sampled_from(["same", "row", "col", "scalar", "ref"]))
        if other == "scalar":
            value = self.draw(st.sampled_from([0.5, 3.0, 1.25]))
            rt, rf = repr(value), (lambda env, v=value: v)
        elif other == "ref":
            rt, rf = "${config.scale * 2}", (lambda env: env["scale"] * 2)
        else:
            sub = {"same": shape, "row": shape[-1:], "col": (*shape[:-1], 1)}[other]
            rt, rf = self.expr(sub, depth - 1)
        fn = {"+": torch.add, "-": torch.sub, "*": torch.mul, "/": torch.div}[op]
        return f"({lt} {op} {rt})", lambda env: fn(lf(env), rf(env))


@st.composite
def cases(draw: Any) -> dict[str, Any]:
    rows, cols = draw(st.integers(1, 150)), draw(st.integers(1, 12))
    gen = Gen(draw, rows, cols)
    text, fn = gen.expr((rows, cols), draw(st.integers(1, 4)))
    x_dtype = draw(st.sampled_from(sorted(DTYPES)))
    x = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(draw(st.integers(0, 99)))) * 4)
    return {"text": text, "fn": fn, "inputs": gen.inputs, "x": x.to(DTYPES[x_dtype]),
            "compute": draw(st.sampled_from(["float32", "float64"])),
            "dtype": draw(st.sampled_from([None, *NAMES])), "scale": draw(st.sampled_from([0.25, 1.5, 3]))}


def _write(case: dict[str, Any], root: Path) -> Path:
    model, other = {"m.x": case["x"]}, {}
    for name, (tensor, source) in case["inputs"].items():
        (model if source == "model" else other)[f"m.{name}"] = tensor.contiguous()
    for name, tensors in (("model", model), ("other", other or {"unused": torch.zeros(1)})):
        (root / name).mkdir()
        save_file(tensors, str(root / name / "model.safetensors"))
        (root / name / "config.json").write_text(json.dumps({"scale": case["scale"]}))
    inputs = {n: {"key": "{N}." + n, **({"source": "other"} if s == "other" else {})}
              for n, (_, s) in case["inputs"].items()}
    args = {"inputs": inputs, "expr": case["text"], "compute": case["compute"],
            **({"dtype": case["dtype"]} if case["dtype"] else {})}
    rule = root / "rule.yaml"
    rule.write_text("\n".join([
        "version: 1", "name: t", "sources:", "  model: {path: model}", "  other: {path: other}", "convert: model",
        "tensors:", "  - key: '{N}.x'", "    ops:", f"      - combine: {json.dumps(args)}",
        "  - match: 'm\\.I\\d+'", "    skip: read by combine", "    optional: true", ""]))
    return rule


def _reference(case: dict[str, Any]) -> torch.Tensor:
    compute = NAMES[case["compute"]]
    env = {"x": case["x"].to(compute), "scale": case["scale"],
           **{n: t.to(compute) for n, (t, _) in case["inputs"].items()}}
    # a Python scalar in torch is rounded to the tensor's dtype, as combine rounds ${...}
    value = case["fn"](env)
    out = NAMES[case["dtype"]] if case["dtype"] else case["x"].dtype
    return value.broadcast_to(case["x"].shape).to(out)


@settings(derandomize=True, max_examples=120, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_random_expressions_equal_torch_whole_tensor(case: dict[str, Any], tmp_path_factory: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recipes, "CHUNK_BYTES", 1)  # bands of 64 rows
    root = tmp_path_factory.mktemp("combine")
    rule = _write(case, root)
    api.apply(rule, out=root / "out", progress=False)
    got = load_file(str(root / "out" / "model.safetensors"))["m.x"]
    want = _reference(case)
    assert (got.dtype, got.shape) == (want.dtype, want.shape), case["text"]
    assert tensor_bytes(got) == tensor_bytes(want), case["text"]


def _plan_error(tmp_path: Path, args: dict[str, Any], extra: dict[str, torch.Tensor] | None = None) -> str:
    case = {"x": torch.ones(4, 6), "inputs": {}, "scale": 1}
    root = tmp_path
    (root / "model").mkdir()
    save_file({"m.x": case["x"], **(extra or {})}, str(root / "model" / "model.safetensors"))
    (root / "model" / "config.json").write_text("{}")
    rule = root / "rule.yaml"
    rule.write_text("\n".join(["version: 1", "name: t", "sources:", "  model: {path: model}", "convert: model",
                               "tensors:", "  - key: '{N}.x'", "    ops:", f"      - combine: {json.dumps(args)}",
                               "  - match: 'm\\.[A-Z]\\w*'", "    skip: read by combine", "    optional: true", ""]))
    with pytest.raises(CkptxformError) as failure:
        api.plan(rule)
    message = str(failure.value)
    assert re.search(r"tensors\[0\]\.ops\[0\] combine \(.*rule\.yaml:9\)", message), message
    assert not (root / "out").exists()
    return message


@pytest.mark.parametrize(("args", "extra", "says"), [
    ({"expr": "x + A", "inputs": {"A": {"key": "{N}.A"}}}, {"m.A": torch.ones(5, 6)},
     "A [5, 6]: the shapes do not broadcast"),
    ({"expr": "x + B @ A", "inputs": {"A": {"key": "{N}.A"}, "B": {"key": "{N}.B"}}},
     {"m.A": torch.ones(3, 6), "m.B": torch.ones(4, 2)}, "B [4, 2] @ A [3, 6]"),
    ({"expr": "x + y", "inputs": {}}, None, "names 'y', which is neither x"),
    ({"expr": "x", "inputs": {"A": {"key": "{N}.A"}}}, {"m.A": torch.ones(1)}, "inputs.A is never used"),
    ({"expr": "x + A", "inputs": {"A": {"key": "{N}.lora"}}}, None, "combine input A: source 'model' has no tensor "
     "'m.lora'"),
    ({"expr": "x + A * B", "inputs": {"A": {"key": "{N}.A"}, "B": {"key": "{N}.B"}}, "absent": "keep"},
     {"m.A": torch.ones(4, 6)}, "combine input B: source 'model' has no tensor 'm.B', while A ('m.A') exists"),
    ({"expr": "x + A", "inputs": {"A": {"key": "{N}.A"}}}, {"m.A": torch.ones(4, 6, dtype=torch.int32)},
     "input A ('m.A') is I32"),
    ({"expr": "x + A.T", "inputs": {"A": {"key": "{N}.A"}}}, {"m.A": torch.ones(6)}, ".T transposes a 2-D"),
    ({"expr": "x + (A", "inputs": {"A": {"key": "{N}.A"}}}, {"m.A": torch.ones(6)}, "never closed"),
    ({"expr": "x + A", "inputs": {"A": {"key": "{M}.A"}}}, {"m.A": torch.ones(6)}, "names {M}, a variable"),
    ({"expr": "x + A", "inputs": {"A": {"key": "{N}.A", "source": "nope"}}}, {"m.A": torch.ones(6)},
     "no source named 'nope'"),
])
def test_plan_errors_name_the_input_and_the_place(tmp_path: Path, args: dict[str, Any],
                                                  extra: dict[str, torch.Tensor] | None, says: str) -> None:
    assert says in _plan_error(tmp_path, args, extra)


def test_absent_inputs_keep_the_tensor_unchanged(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    x = torch.randn(4, 6, dtype=torch.bfloat16)
    save_file({"m.x": x}, str(tmp_path / "model" / "model.safetensors"))
    rule = tmp_path / "rule.yaml"
    args = {"expr": "x + A", "inputs": {"A": {"key": "{N}.A"}}, "absent": "keep"}
    rule.write_text("\n".join(["version: 1", "name: t", "sources:", "  model: {path: model}", "convert: model",
                               "tensors:", "  - key: '{N}.x'", "    ops:", f"      - combine: {json.dumps(args)}", ""]))
    api.apply(rule, out=tmp_path / "out", progress=False)
    assert tensor_bytes(load_file(str(tmp_path / "out" / "model.safetensors"))["m.x"]) == tensor_bytes(x)


def test_a_band_reads_rows_of_the_row_inputs_only(tmp_path: Path) -> None:
    """x and B are read a band of rows at a time; A (the right factor) whole, once."""
    from ckptxform.ops import OPS
    from ckptxform.ops.base import Block, InputTensor, Run, View

    rows, rank, cols = 1000, 4, 96
    tensors = [torch.randn(rows, cols), torch.randn(rows, rank), torch.randn(rank, cols)]
    reads: list[tuple[int, int]] = []

    def reader(i: int, data: bytes) -> Any:
        def read(start: int, length: int) -> bytes:
            reads.append((i, length))
            return data[start:start + length]
        return read

    views = [View(tuple(t.shape), "F32", (Run(i, 0, t.numel() * 4),)) for i, t in enumerate(tensors)]
    tree = ("+", ("in", 0), ("*", ("@", ("in", 1), ("in", 2)), ("num", 0.5)))
    block = Block(OPS["combine"], {"expr": tree, "names": ("x", "B", "A"), "compute": "F32", "dtype": "BF16",
                                   "what": "t"}, tuple(views), (rows, cols), "BF16")
    inputs = [InputTensor(v, reader(i, tensor_bytes(t))) for i, (v, t) in enumerate(zip(views, tensors))]
    got = b"".join(bytes(b) for b in OPS["combine"].blocks(block, inputs, 64 * cols * 8))
    want = (tensors[0] + (tensors[1] @ tensors[2]) * 0.5).to(torch.bfloat16)
    assert got == tensor_bytes(want)
    assert max(n for i, n in reads if i == 0) == 64 * cols * 4  # x: bands of 64 rows
    assert max(n for i, n in reads if i == 1) == 64 * rank * 4
    assert [n for i, n in reads if i == 2] == [rank * cols * 4]  # A: once, whole
