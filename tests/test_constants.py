"""Constants: an ``add`` entry that makes a tensor no source has (issue 34 item 2).

Its values are checked against ``torch.full`` (the reference: what a model's own zeros or
ones are), for every dtype and for values that round (0.1, a third, a subnormal); a key
with template variables is written once per output its ``for_each`` matches; the audit
says the tensor was created and ``require.loaded`` does not count it; every bad entry is
one error at its FILE:LINE; the run plan's codec carries the recipe; and the bytes stream
in bounded chunks however large the tensor.
"""

from __future__ import annotations

import json
import re
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import read_audit, read_output, same_bits
from safetensors.torch import save_file

from ckptxform import api
from ckptxform.engine.plan.recipes import CHUNK_BYTES, Constant
from ckptxform.engine.output.verify import verify
from ckptxform.engine.run.execute import layout_of
from ckptxform.engine.run.shard_plan import CODEC, slice_plan
from ckptxform.engine.run.tasks import first_etags
from ckptxform.errors import OutputError, PlanError, RequirementError, RuleError
from ckptxform.rules.loader import load_rules

LAYERS = 3
HIDDEN = 7


def write_source(path: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A tiny Qwen2-like source: o_proj weights of three layers, a norm; its config."""
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    tensors = {f"model.layers.{i}.self_attn.o_proj.weight": torch.randn(HIDDEN, 6, generator=gen).to(dtype)
               for i in range(LAYERS)}
    tensors["model.norm.weight"] = torch.randn(HIDDEN, generator=gen).to(dtype)
    save_file(tensors, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps({"hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
                                                  "torch_dtype": "float16", "scale": 0.25}))
    return path


def rule_file(tmp_path: Path, add: str, tensors: str = "  - match: '.+'\n", extra: str = "") -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text("version: 1\nsources:\n  model: {path: src}\nconvert: model\ntensors:\n" + tensors
                    + "add:\n" + textwrap.indent(textwrap.dedent(add), "  ") + extra)
    return path


def apply(tmp_path: Path, rule: Path) -> Path:
    out = tmp_path / "out"
    api.apply(rule, out=out, sources={"model": str(tmp_path / "src")}, progress=False, force=True)
    return out


BIAS = """\
model.layers.{L}.self_attn.o_proj.bias:
  fill: 0
  shape: ['${config.hidden_size}']
  for_each: model.layers.{L}.self_attn.o_proj.weight
"""


def test_a_per_layer_bias_is_written_for_every_layer_the_source_has(tmp_path: Path) -> None:
    write_source(tmp_path / "src")
    got = read_output(apply(tmp_path, rule_file(tmp_path, BIAS)))
    biases = sorted(k for k in got if k.endswith(".bias"))
    assert biases == [f"model.layers.{i}.self_attn.o_proj.bias" for i in range(LAYERS)]
    for key in biases:  # the dtype of the output it stands beside
        assert same_bits(got[key], torch.zeros(HIDDEN, dtype=torch.bfloat16)), key
    assert len(got) == 2 * LAYERS + 1


def test_for_each_matches_output_keys_after_renames_and_binds_shape_references(tmp_path: Path) -> None:
    write_source(tmp_path / "src", torch.float32)
    rule = rule_file(tmp_path, """\
        layers.{L}.attn.out.bias:
          fill: '${config.scale * 4}'
          shape: ['${shape.model.layers.{L}.self_attn.o_proj.weight[0]}', 2]
          for_each: layers.{L}.attn.out.weight
        """, tensors="  - key: 'model.layers.{L}.self_attn.o_proj.weight'\n    to: layers.{L}.attn.out.weight\n"
                     "  - match: '.+'\n")
    got = read_output(apply(tmp_path, rule))
    for i in range(LAYERS):
        assert same_bits(got[f"layers.{i}.attn.out.bias"], torch.ones(HIDDEN, 2))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64"])
@pytest.mark.parametrize("value", ["0", "1", "-2.5", "0.1", "0.3333333333333333", "1.0e-40", "3.0000001", "65504",
                                   "'${config.scale * 3 - 0.001}'"])
def test_a_float_fill_is_torch_full_bit_for_bit(tmp_path: Path, dtype: str, value: str) -> None:
    write_source(tmp_path / "src")
    rule = rule_file(tmp_path, f"c: {{fill: {value}, shape: [3, 5], dtype: {dtype}}}\n")
    got = read_output(apply(tmp_path, rule))["c"]
    number = 0.25 * 3 - 0.001 if "config" in value else float(value)
    assert same_bits(got, torch.full((3, 5), number, dtype=getattr(torch, dtype)))


@pytest.mark.parametrize(("dtype", "value"), [("int64", -3), ("int32", 2**31 - 1), ("int8", -128), ("uint8", 255),
                                              ("bool", 1), ("bool", 0), ("int16", 7.0)])
def test_an_integer_fill_is_torch_full(tmp_path: Path, dtype: str, value: int) -> None:
    write_source(tmp_path / "src")
    got = read_output(apply(tmp_path, rule_file(tmp_path, f"c: {{fill: {value}, shape: [4], dtype: {dtype}}}\n")))
    assert same_bits(got["c"], torch.full((4,), value, dtype=getattr(torch, dtype)))


def test_a_scalar_and_an_empty_constant(tmp_path: Path) -> None:
    write_source(tmp_path / "src")
    got = read_output(apply(tmp_path, rule_file(tmp_path, """\
        s: {fill: 2, shape: [], dtype: float32}
        e: {fill: 1, shape: [0, 4], dtype: bfloat16}
        """)))
    assert same_bits(got["s"], torch.tensor(2.0)) and tuple(got["e"].shape) == (0, 4)


def test_the_audit_says_created_and_require_loaded_does_not_count_it(tmp_path: Path) -> None:
    write_source(tmp_path / "src")
    out = apply(tmp_path, rule_file(tmp_path, BIAS))
    events = read_audit(out)
    written = {e["key"]: e for e in events if e["event"] == "written"}
    assert written["model.layers.0.self_attn.o_proj.bias"]["from"] == {"created": "constant", "fill": 0}
    assert not any(e["event"] == "tensor" and e["key"].endswith(".bias") for e in events)
    verify(out)
    plan = api.plan(rule_file(tmp_path, BIAS), sources={"model": str(tmp_path / "src")})
    bias = next(o for o in plan.outputs if o.key.endswith(".bias"))
    assert not bias.loaded and bias.recipe.describe() == "created: constant 0"
    rule = rule_file(tmp_path, BIAS, extra="require:\n  loaded: ['model\\.layers\\.0\\.self_attn\\.o_proj\\.bias']\n")
    with pytest.raises(RequirementError, match=r"o_proj\\?\.bias.* was not loaded"):
        api.plan(rule, sources={"model": str(tmp_path / "src")})


def test_output_dtype_casts_a_float_constant_as_every_float_tensor(tmp_path: Path) -> None:
    write_source(tmp_path / "src", torch.float32)
    rule = rule_file(tmp_path, "c: {fill: 0.1, shape: [3], dtype: float32}\n", extra="output: {dtype: bfloat16}\n")
    got = read_output(apply(tmp_path, rule))
    assert same_bits(got["c"], torch.full((3,), 0.1, dtype=torch.bfloat16))


def test_a_dtype_given_by_an_expression(tmp_path: Path) -> None:
    write_source(tmp_path / "src")
    rule = rule_file(tmp_path, "c: {fill: 1, shape: [2], dtype: '${config.torch_dtype}'}\n")
    got = read_output(apply(tmp_path, rule))
    assert got["c"].dtype == torch.float16


def where_of(rule: Path, text: str) -> str:
    """``rules.yaml:LINE`` of the first line of ``rule`` holding ``text``."""
    line = next(i for i, s in enumerate(rule.read_text().splitlines(), 1) if text in s)
    return f"{rule.name}:{line}"


@pytest.mark.parametrize(("add", "at", "message"), [
    ("model.layers.{L}.b: {fill: 0, shape: [2], dtype: float32}\n", "model.layers.{L}.b",
     r"the key names \{L\}, which nothing binds: add for_each"),
    ("b.{L}: {fill: 0, shape: [2], for_each: 'model.layers.{L}.{X}'}\n", "b.{L}",
     r"for_each: binds \{X\}, which the key does not use"),
    ("b.{L}.{M}: {fill: 0, shape: [2], for_each: 'model.layers.{L}.x'}\n", "b.{L}",
     r"the key names \{M\}, which for_each 'model.layers.\{L\}.x' does not bind"),
    ("b: {fill: 0, shape: [2]}\n", "b:", r"no dtype: give the constant's dtype"),
    ("b: {fill: '${config.x +}', shape: [2], dtype: float32}\n", "b:", r"fill: .*config.x \+"),
    ("b: {fill: 0, shape: ['${vocab.nope.draft_size}'], dtype: float32}\n", "b:", r"unknown vocabulary 'nope'"),
    ("b: {fill: 0, shape: [-1], dtype: float32}\n", "b:", r"shape"),
    ("b: {fill: 0, shape: [2], dtype: float8}\n", "b:", r"dtype"),
])
def test_a_bad_entry_is_refused_by_the_loader_at_its_line(tmp_path: Path, add: str, at: str, message: str) -> None:
    rule = rule_file(tmp_path, add)
    with pytest.raises(RuleError) as err:
        load_rules(rule)
    text = str(err.value)
    assert where_of(rule, at) in text, text
    assert re.search(message, text), text


@pytest.mark.parametrize(("add", "message"), [
    ("model.layers.{L}.b: {fill: 0, shape: [2], for_each: 'model.layers.{L}.mlp.weight'}\n",
     r"for_each 'model.layers.\{L\}.mlp.weight' matches no output tensor the tensor rules write"),
    ("b: {fill: 65520, shape: [2], dtype: float16}\n", r"fill: 65520 overflows float16"),
    ("b: {fill: 0.5, shape: [2], dtype: int32}\n", r"fill: 0.5 is not an integer int32 holds"),
    ("b: {fill: 2, shape: [2], dtype: bool}\n", r"fill: 2 is not 0 or 1 bool holds"),
    ("b: {fill: 300, shape: [2], dtype: uint8}\n", r"fill: 300 is not an integer uint8 holds \(0..255\)"),
    ("b: {fill: 0, shape: [2], dtype: '${config.scale}'}\n", r"dtype '\$\{config.scale\}' is 0.25, not one of"),
    ("b: {fill: 0, shape: ['${config.hidden_size - 9}'], dtype: float32}\n", r"shape\[0\]: .* is -2; a dimension"),
    ("b: {fill: 0, shape: ['${config.absent}'], dtype: float32}\n", r"has no field 'absent'"),
    ("model.norm.weight: {fill: 1, shape: [7], dtype: bfloat16}\n", r"both write output key 'model.norm.weight'"),
    ("b: {fill: 0, shape: [1000000000000, 1000000000], dtype: float32}\n",
     r"shape \[1000000000000, 1000000000\] of float32 is 4,000,000,000,000,000,000,000 bytes, more than a file"),
])
def test_a_bad_entry_is_refused_at_plan_time_naming_its_line(tmp_path: Path, add: str, message: str) -> None:
    write_source(tmp_path / "src")
    rule = rule_file(tmp_path, add)
    with pytest.raises(PlanError) as err:
        api.plan(rule, sources={"model": str(tmp_path / "src")})
    text = str(err.value)
    assert re.search(message, text), text
    assert where_of(rule, add.split(":")[0]) in text, text
    assert not (tmp_path / "out").exists()


def test_the_run_plan_codec_carries_a_constant_and_refuses_an_edited_one() -> None:
    recipe = Constant("3f80", 12, 1)
    assert CODEC.decode(CODEC.encode(recipe), "plan.json") == recipe
    for field, bad in (("count", -1), ("element", "zz"), ("element", "")):
        data: Any = CODEC.encode(recipe)
        data["fields"][field] = bad
        with pytest.raises(OutputError, match="not a Constant of a plan"):
            CODEC.decode(data, "plan.json")


def test_a_large_constant_streams_in_bounded_chunks() -> None:
    count = 3 * CHUNK_BYTES // 2 + 5  # 48 MiB of bfloat16 ones, one and a half chunks... and 10 bytes
    sizes = []
    for chunk in Constant("803f", count, 1).stream(None):  # type: ignore[arg-type]
        sizes.append(len(chunk))
        assert chunk[:4] == b"\x80\x3f\x80\x3f"
    assert max(sizes) <= CHUNK_BYTES and sum(sizes) == 2 * count


def test_a_run_in_worker_processes_writes_the_same_constants(tmp_path: Path) -> None:
    """--jobs 2 over several output shards: each worker decodes its slice of the run plan
    (constants included) from the job directory's JSON."""
    write_source(tmp_path / "src")
    rule = rule_file(tmp_path, BIAS, extra="output: {max_shard_size: 100B}\n")
    plan, opened = api.plan_open(rule, sources={"model": str(tmp_path / "src")})
    with opened:
        layout = layout_of(plan, opened)
        run = slice_plan(plan, opened, list(layout.shards), first_etags(opened))
        for work in run.shards.values():  # a file a shard's plan, and one of what they share
            assert CODEC.decode(json.loads(json.dumps(CODEC.encode(work))), "plan.json") == work
    alone = replace(run, shards={})
    assert CODEC.decode(json.loads(json.dumps(CODEC.encode(alone))), "plan.json") == alone
    one = api.apply(rule, out=tmp_path / "one", sources={"model": str(tmp_path / "src")}, progress=False, jobs=1)
    two = api.apply(rule, out=tmp_path / "two", sources={"model": str(tmp_path / "src")}, progress=False, jobs=2)
    assert len(list(two.out.glob("*.safetensors"))) > 2
    ones, twos = read_output(one.out), read_output(two.out)
    assert sorted(ones) == sorted(twos) and all(same_bits(ones[k], twos[k]) for k in ones)
    assert json.loads((two.out / "ckptxform_audit.jsonl").read_text().splitlines()[-1])["jobs"]["workers"] == 2
