"""Structural ops through the engine on hand-built safetensors files.

Each case writes a small checkpoint with torch, runs the real ``apply`` with a ``key:``
rule, and compares every output tensor with the same op written in torch here (the
semantics of shared/structural-ops.md): stack, concat (inner dims too), unequal split,
unstack, transpose, the RoPE permute (GQA) and its inverse, resize, untie and tie.
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_clean_failure, read_audit, read_output, same_bits
from safetensors.torch import save_file

from ckptxform import api
from ckptxform.errors import PlanError, RequirementError
from ckptxform.engine.run.shard_plan import CODEC
from ckptxform.ops.base import Block, BlockOp, Context, InputTensor, NoInverse, Value, View
from ckptxform.rules.loader import load_rules


def write_model(path: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any] | None = None,
                config_name: str = "config.json") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors")
    if config is not None:
        (path / config_name).write_text(json.dumps(config))
    return path


def rule_file(tmp_path: Path, body: str, name: str = "rules.yaml") -> Path:
    path = tmp_path / name
    path.write_text("version: 1\nsources:\n  model: {path: src}\nconvert: model\n" + textwrap.dedent(body))
    return path


def run(tmp_path: Path, rule: Path) -> dict[str, torch.Tensor]:
    out = tmp_path / "out"
    api.apply(rule, out=out, sources={"model": str(tmp_path / "src")}, progress=False, force=True)
    return read_output(out)


def rand(*shape: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].shape == value.shape, key
        assert same_bits(got[key], value), key


MIXTRAL_RULE = """\
tensors:
  - key: 'model.layers.{L}.block_sparse_moe.experts.{E}.{P:w1,w3}.weight'
    to: 'model.layers.{L}.mlp.experts.gate_up_proj'
    ops:
      - stack: {over: E, count: '${config.num_local_experts}'}
      - concat: {over: P, dim: 1}
  - key: 'model.layers.{L}.block_sparse_moe.experts.{E}.w2.weight'
    to: 'model.layers.{L}.mlp.experts.down_proj'
    ops: [{stack: {over: E, count: '${config.num_local_experts}'}}]
  - key: 'model.layers.{L}.block_sparse_moe.gate.weight'
    to: 'model.layers.{L}.mlp.gate.weight'
  - match: '.+'
"""


def mixtral_legacy(experts: int, layers: int = 2, inter: int = 6, hidden: int = 5) -> dict[str, torch.Tensor]:
    out = {"model.embed_tokens.weight": rand(11, hidden, seed=99)}
    for layer in range(layers):
        base = f"model.layers.{layer}.block_sparse_moe"
        out[f"{base}.gate.weight"] = rand(experts, hidden, seed=layer)
        for e in range(experts):
            for i, (name, shape) in enumerate((("w1", (inter, hidden)), ("w2", (hidden, inter)),
                                               ("w3", (inter, hidden)))):
                out[f"{base}.experts.{e}.{name}.weight"] = rand(*shape, seed=1000 * layer + 10 * e + i)
    return out


def test_mixtral_stack_and_concat_in_natural_order(tmp_path: Path) -> None:
    experts = 11  # expert 10 must come after 9, not after 1
    src = mixtral_legacy(experts)
    write_model(tmp_path / "src", src, {"num_local_experts": experts})
    got = run(tmp_path, rule_file(tmp_path, MIXTRAL_RULE))
    want = {"model.embed_tokens.weight": src["model.embed_tokens.weight"]}
    for layer in range(2):
        base = f"model.layers.{layer}.block_sparse_moe"
        e = range(experts)
        gate = torch.stack([src[f"{base}.experts.{i}.w1.weight"] for i in e])
        up = torch.stack([src[f"{base}.experts.{i}.w3.weight"] for i in e])
        want[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        want[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack(
            [src[f"{base}.experts.{i}.w2.weight"] for i in e])
        want[f"model.layers.{layer}.mlp.gate.weight"] = src[f"{base}.gate.weight"]
    assert_same(got, want)
    events = read_audit(tmp_path / "out")
    written = {e["key"]: e for e in events if e["event"] == "written"}
    origin = written["model.layers.1.mlp.experts.gate_up_proj"]["from"]
    assert len(origin["inputs"]) == 2 * experts
    assert origin["inputs"][0] == {"source": "model", "key": "model.layers.1.block_sparse_moe.experts.0.w1.weight"}
    # in the order the output reads them: concat along dim 1 puts gate_e, up_e for each e
    assert origin["inputs"][1] == {"source": "model", "key": "model.layers.1.block_sparse_moe.experts.0.w3.weight"}
    assert origin["inputs"][-1] == {"source": "model", "key": "model.layers.1.block_sparse_moe.experts.10.w3.weight"}
    assert origin["ops"] == ["stack over E", "concat over P"]
    records = {e["key"]: e for e in events if e["event"] == "tensor"}
    w3 = records["model.layers.0.block_sparse_moe.experts.10.w3.weight"]
    assert (w3["action"], w3["target"]) == ("transformed", "model.layers.0.mlp.experts.gate_up_proj")


def test_missing_expert_is_a_plan_error_naming_the_key_and_line(tmp_path: Path) -> None:
    src = mixtral_legacy(4)
    del src["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    write_model(tmp_path / "src", src, {"num_local_experts": 4})
    rule = rule_file(tmp_path, MIXTRAL_RULE)
    with pytest.raises(PlanError) as err:
        run(tmp_path, rule)
    assert str(err.value) == (
        f"tensors[0].ops[0] stack ({rule}:9): incomplete group: "
        "'model.layers.1.block_sparse_moe.experts.2.w3.weight' is missing; stack over {E} needs 0, 1, 2, 3")
    assert not (tmp_path / "out").exists()


def test_absent_config_field_is_a_plan_error(tmp_path: Path) -> None:
    write_model(tmp_path / "src", mixtral_legacy(2), {"hidden_size": 5})
    rule = rule_file(tmp_path, MIXTRAL_RULE)
    with pytest.raises(PlanError) as err:
        run(tmp_path, rule)
    assert str(err.value) == (
        f"tensors[0].ops[0] stack ({rule}:9): stack.count: ${{config.num_local_experts}}: the config.json of "
        f"source 'model' ({tmp_path / 'src'}) has no field 'num_local_experts'; add it there, or write the "
        "value in the rule file")


QKV_RULE = """\
tensors:
  - key: 'layers.{L}.qkv_proj.weight'
    to: 'layers.{L}.{P:q,k,v}_proj.weight'
    ops:
      - split:
          into: P
          dim: 0
          sizes: ['${config.num_attention_heads * config.head_dim}',
                  '${config.num_key_value_heads * config.head_dim}',
                  '${config.num_key_value_heads * config.head_dim}']
"""


def test_unequal_gqa_split_and_its_fusion_back(tmp_path: Path) -> None:
    heads, kv, hd, hidden = 5, 1, 4, 7
    qkv = rand((heads + 2 * kv) * hd, hidden, seed=3)
    write_model(tmp_path / "src", {"layers.0.qkv_proj.weight": qkv},
                {"num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd})
    got = run(tmp_path, rule_file(tmp_path, QKV_RULE))
    q, k, v = torch.split(qkv, [heads * hd, kv * hd, kv * hd])
    assert_same(got, {"layers.0.q_proj.weight": q, "layers.0.k_proj.weight": k, "layers.0.v_proj.weight": v})
    rows = tmp_path / "bad"
    rows.mkdir()
    write_model(tmp_path / "src", {"layers.0.qkv_proj.weight": rand(30, hidden)},
                {"num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd})
    rule = rule_file(tmp_path, QKV_RULE)
    with pytest.raises(PlanError) as err:
        run(tmp_path, rule)
    assert str(err.value) == (f"tensors[0].ops[0] split ({rule}:9): split into P: sizes [20, 4, 4] add up to "
                              "28 but dim 0 of the tensor (shape [30, 7]) is 30")


def test_inner_dim_concat_and_split(tmp_path: Path) -> None:
    a, b = rand(3, 4, 2, seed=1), rand(3, 5, 2, seed=2)
    write_model(tmp_path / "src", {"x.a": a, "x.b": b})
    got = run(tmp_path, rule_file(tmp_path, """\
        tensors:
          - key: 'x.{P:a,b}'
            to: 'y'
            ops: [{concat: {over: P, dim: 1, sizes: [4, 5]}}]
        """))
    assert_same(got, {"y": torch.cat([a, b], dim=1)})
    write_model(tmp_path / "src", {"y": got["y"]})
    back = run(tmp_path, rule_file(tmp_path, """\
        tensors:
          - key: 'y'
            to: 'x.{P:a,b}'
            ops: [{split: {into: P, dim: -2, sizes: [4, 5]}}]
        """))
    assert_same(back, {"x.a": a, "x.b": b})


def test_unstack_keeps_size_one_dims(tmp_path: Path) -> None:
    fused = rand(3, 1, 4, seed=5)
    write_model(tmp_path / "src", {"e.w": fused})
    got = run(tmp_path, rule_file(tmp_path, """\
        tensors:
          - key: 'e.w'
            to: 'e.{E}.w'
            ops: [{unstack: {into: E}}]
        """))
    assert_same(got, {f"e.{i}.w": fused[i] for i in range(3)})
    assert got["e.0.w"].shape == (1, 4)


def test_transpose_in_place_and_after_a_split(tmp_path: Path) -> None:
    c_attn, c_fc = rand(6, 3 * 4, seed=7, dtype=torch.float32), rand(2, 3, 6, seed=8)
    write_model(tmp_path / "src", {"h.0.attn.c_attn.weight": c_attn, "h.0.mlp.c_fc.weight": c_fc})
    got = run(tmp_path, rule_file(tmp_path, """\
        tensors:
          - key: 'h.{N}.attn.c_attn.weight'
            to: 'h.{N}.attn.{P:q,k,v}_proj.weight'
            ops: [{split: {into: P, dim: 1}}, {transpose: [0, 1]}]
          - key: 'h.{N}.mlp.c_fc.weight'
            ops: [{transpose: [0, 2]}]
        """))
    q, k, v = torch.split(c_attn, 4, dim=1)
    assert_same(got, {"h.0.attn.q_proj.weight": q.t(), "h.0.attn.k_proj.weight": k.t(),
                      "h.0.attn.v_proj.weight": v.t(), "h.0.mlp.c_fc.weight": c_fc.transpose(0, 2)})


def meta_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's convert_llama_weights_to_hf permute (the reference semantics)."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def test_rope_permute_uses_kv_heads_for_k_and_inverts(tmp_path: Path) -> None:
    heads, kv, hd, dim = 4, 2, 6, 5
    wq, wk = rand(heads * hd, dim, seed=1), rand(kv * hd, dim, seed=2)
    write_model(tmp_path / "src", {"layers.0.attention.wq.weight": wq, "layers.0.attention.wk.weight": wk},
                {"n_heads": heads, "n_kv_heads": kv}, config_name="params.json")
    rule = tmp_path / "meta.yaml"
    rule.write_text(textwrap.dedent("""\
        version: 1
        sources:
          model: {path: src, config: params.json}
        tensors:
          - key: 'layers.{L}.attention.wq.weight'
            to: 'model.layers.{L}.self_attn.q_proj.weight'
            ops: [{rope_permute: {heads: '${config.n_heads}'}}]
          - key: 'layers.{L}.attention.wk.weight'
            to: 'model.layers.{L}.self_attn.k_proj.weight'
            ops: [{rope_permute: {heads: '${config.n_kv_heads}'}}]
        """))
    got = run(tmp_path, rule)
    assert_same(got, {"model.layers.0.self_attn.q_proj.weight": meta_permute(wq, heads),
                      "model.layers.0.self_attn.k_proj.weight": meta_permute(wk, kv)})
    write_model(tmp_path / "src", got)
    back = run(tmp_path, rule_file(tmp_path, """\
        tensors:
          - key: 'model.layers.{L}.self_attn.q_proj.weight'
            to: 'layers.{L}.attention.wq.weight'
            ops: [{rope_unpermute: {heads: 4}}]
          - key: 'model.layers.{L}.self_attn.k_proj.weight'
            to: 'layers.{L}.attention.wk.weight'
            ops: [{rope_unpermute: {heads: 2}}]
        """))
    assert_same(back, {"layers.0.attention.wq.weight": wq, "layers.0.attention.wk.weight": wk})


def test_resize_rows_pads_with_zeros_and_truncates(tmp_path: Path) -> None:
    emb = rand(5, 3, seed=4)
    write_model(tmp_path / "src", {"emb": emb, "head": emb.clone()})
    got = run(tmp_path, rule_file(tmp_path, """\
        tensors:
          - key: emb
            ops: [{resize_rows: {rows: '${shape.emb[0] + 3}'}}]
          - key: head
            ops: [{resize_rows: {rows: 2}}]
        """))
    assert_same(got, {"emb": torch.cat([emb, torch.zeros(3, 3, dtype=emb.dtype)]), "head": emb[:2]})


def test_resize_rows_mean_and_normal_fills(tmp_path: Path) -> None:
    emb = rand(5, 3, seed=4)
    write_model(tmp_path / "src", {"emb": emb, "head": emb.clone()})
    got = run(tmp_path, rule_file(tmp_path, """\
        tensors:
          - key: emb
            ops: [{resize_rows: {rows: 8, fill: mean}}]
          - key: head
            ops: [{resize_rows: {rows: 7, fill: normal, std: 0.5, seed: 3}}]
        """))
    mean = emb.double().mean(0).to(emb.dtype)
    normal = (torch.randn((2, 3), generator=torch.Generator().manual_seed(3), dtype=torch.float32) * 0.5)
    assert_same(got, {"emb": torch.cat([emb, mean.expand(3, 3)]), "head": torch.cat([emb, normal.to(emb.dtype)])})


def test_untie_writes_one_tensor_under_two_names_and_tie_checks_bytes(tmp_path: Path) -> None:
    emb = rand(7, 4, seed=6)
    write_model(tmp_path / "src", {"model.embed_tokens.weight": emb})
    got = run(tmp_path, rule_file(tmp_path, """\
        tensors:
          - key: model.embed_tokens.weight
            to: [model.embed_tokens.weight, lm_head.weight]
        """))
    assert_same(got, {"model.embed_tokens.weight": emb, "lm_head.weight": emb})
    records = [e for e in read_audit(tmp_path / "out") if e["event"] == "tensor"]
    assert records[0]["target"] == ["lm_head.weight", "model.embed_tokens.weight"]
    tie = """\
        tensors:
          - key: lm_head.weight
            tie: model.embed_tokens.weight
          - match: '.+'
        """
    write_model(tmp_path / "src", got)
    (tmp_path / "out").rename(tmp_path / "untied")
    assert_same(run(tmp_path, rule_file(tmp_path, tie)), {"model.embed_tokens.weight": emb})
    assert [e["action"] for e in read_audit(tmp_path / "out") if e.get("key") == "lm_head.weight"] == ["tied"]
    write_model(tmp_path / "src", {"model.embed_tokens.weight": emb, "lm_head.weight": emb + 1})
    rule = rule_file(tmp_path, tie)
    with pytest.raises(RequirementError) as err:
        api.apply(rule, out=tmp_path / "out2", sources={"model": str(tmp_path / "src")}, progress=False)
    assert str(err.value) == (f"tensors[0] ({rule}:6): tie: model:lm_head.weight differs from output "
                              "'model.embed_tokens.weight' at byte 0; tie only identical tensors (or write "
                              "both, without tie)")
    assert not (tmp_path / "out2").exists()


class _Difference(BlockOp):
    """A two-input block op (as dequant is: weight and scale): a - b, a block of rows at a time."""

    verb = "difference"
    kind = "reduce"
    description = "test op"
    schema: dict[str, Any] = {}

    def reduce(self, args: Any, ctx: Context, members: list[tuple[str, View]]) -> Value:
        (_, a), (_, b) = members
        return Block(self, {}, (a, b), a.shape, "F32")

    def inverse(self, args: Any) -> tuple[str, Any]:
        raise NoInverse("test op")

    def blocks(self, block: Block, inputs: Sequence[InputTensor], chunk_bytes: int,
               rows: range | None = None) -> Iterator[bytes]:
        width = block.inputs[0].nbytes // block.shape[0]
        wanted = rows or range(block.shape[0])
        for first in range(wanted.start, wanted.stop, 2):  # two rows a block: several blocks
            n = min(2, wanted.stop - first)
            a, b = (torch.frombuffer(bytearray(t.read(first * width, n * width)), dtype=torch.bfloat16)
                    for t in inputs)
            yield (a.float() - b.float()).numpy().tobytes()


def test_a_multi_input_block_op_reads_each_input_by_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = rand(5, 3, seed=1), rand(5, 3, seed=2)
    write_model(tmp_path / "src", {"x.a": a, "x.b": b})
    rule = rule_file(tmp_path, "tensors:\n  - key: 'x.{T:a,b}'\n    to: y\n    ops: [{concat: {over: T, dim: 0}}]\n")
    rules = load_rules(rule)
    step = rules.tensors[0].ops[0]
    op = _Difference()
    rules = dataclasses.replace(rules, tensors=(dataclasses.replace(
        rules.tensors[0], ops=(dataclasses.replace(step, op=op),)),))
    # the run plan names ops by verb: admit the test op (it lives in this process only: jobs=1)
    monkeypatch.setitem(CODEC._ops, op.verb, op)
    api.apply(rules, out=tmp_path / "out", sources={"model": str(tmp_path / "src")}, progress=False, jobs=1)
    assert_same(read_output(tmp_path / "out"), {"y": a.float() - b.float()})
    written = [e for e in read_audit(tmp_path / "out") if e["event"] == "written"]
    assert written[0]["from"] == {"inputs": [{"source": "model", "key": "x.a"}, {"source": "model", "key": "x.b"}],
                                  "ops": ["difference over T"]}


def megatron_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, kv: int) -> torch.Tensor:
    """Megatron-Bridge's QKVMapping layout: per kv group, its q heads, then k, then v."""
    hd = q.shape[0] // heads
    qg = q.view(kv, heads // kv * hd, -1)
    return torch.cat([qg, k.view(kv, hd, -1), v.view(kv, hd, -1)], dim=1).reshape(-1, q.shape[1])


def test_qkv_interleave_fuses_into_megatron_order_and_back(tmp_path: Path) -> None:
    heads, kv, hd, hidden = 6, 2, 4, 5
    q, k, v = rand(heads * hd, hidden, seed=1), rand(kv * hd, hidden, seed=2), rand(kv * hd, hidden, seed=3)
    write_model(tmp_path / "src", {"l.0.q_proj.weight": q, "l.0.k_proj.weight": k, "l.0.v_proj.weight": v})
    got = run(tmp_path, rule_file(tmp_path, f"""\
        tensors:
          - key: 'l.{{L}}.{{P:q,k,v}}_proj.weight'
            to: 'l.{{L}}.linear_qkv.weight'
            ops: [{{concat: {{over: P, dim: 0}}}}, {{qkv_interleave: {{heads: {heads}, kv_heads: {kv}}}}}]
        """))
    assert_same(got, {"l.0.linear_qkv.weight": megatron_qkv(q, k, v, heads, kv)})
    write_model(tmp_path / "src", got)
    back = run(tmp_path, rule_file(tmp_path, f"""\
        tensors:
          - key: 'l.{{L}}.linear_qkv.weight'
            ops: [{{qkv_deinterleave: {{heads: {heads}, kv_heads: {kv}}}}}]
        """))
    assert_same(back, {"l.0.linear_qkv.weight": torch.cat([q, k, v])})


@pytest.mark.parametrize("case", ["missing-member", "split-sizes", "absent-config-field"])
def test_plan_errors_are_one_line_exit_1_and_no_output(tmp_path: Path, case: str, run_cli) -> None:  # type: ignore[no-untyped-def]
    if case == "missing-member":
        src = mixtral_legacy(3)
        del src["model.layers.0.block_sparse_moe.experts.1.w1.weight"]
        write_model(tmp_path / "src", src, {"num_local_experts": 3})
        rule, want = rule_file(tmp_path, MIXTRAL_RULE), "'model.layers.0.block_sparse_moe.experts.1.w1.weight' is missing"
    elif case == "split-sizes":
        write_model(tmp_path / "src", {"layers.0.qkv_proj.weight": rand(30, 7)},
                    {"num_attention_heads": 5, "num_key_value_heads": 1, "head_dim": 4})
        rule, want = rule_file(tmp_path, QKV_RULE), "sizes [20, 4, 4] add up to 28 but dim 0"
    else:
        write_model(tmp_path / "src", {"layers.0.qkv_proj.weight": rand(28, 7)}, {"num_attention_heads": 5, "head_dim": 4})
        rule, want = rule_file(tmp_path, QKV_RULE), "has no field 'num_key_value_heads'"
    before = sorted(p.name for p in (tmp_path / "src").iterdir())
    proc = run_cli("apply", rule, "--out", tmp_path / "out", "--source", f"model={tmp_path / 'src'}")
    stderr = assert_clean_failure(proc, code=1)
    (line,) = stderr.strip().splitlines()
    assert want in line and f"({rule}:9)" in line, line
    assert not (tmp_path / "out").exists() and sorted(p.name for p in (tmp_path / "src").iterdir()) == before


def test_an_op_argument_falls_back_to_its_default(tmp_path: Path) -> None:
    src = mixtral_legacy(2, layers=1)
    write_model(tmp_path / "src", src, {"hidden_size": 5})
    got = run(tmp_path, rule_file(tmp_path, MIXTRAL_RULE.replace("${config.num_local_experts}",
                                                                 "${config.num_local_experts ?? 2}")))
    base = "model.layers.0.block_sparse_moe.experts"
    assert same_bits(got["model.layers.0.mlp.experts.down_proj"],
                     torch.stack([src[f"{base}.{e}.w2.weight"] for e in range(2)]))


def test_config_from_params_json_with_shape_and_arithmetic(tmp_path: Path) -> None:
    write_model(tmp_path / "src", {"layers.0.feed_forward.w1.weight": rand(14, 8)},
                {"dim": 8, "n_heads": 4, "n_kv_heads": 2}, config_name="params.json")
    rule = tmp_path / "meta.yaml"
    rule.write_text(textwrap.dedent("""\
        version: 1
        sources:
          model: {path: src, config: params.json}
        tensors:
          - match: '.+'
        config:
          from: model
          keep: []
          set:
            hidden_size: ${config.dim}
            head_dim: ${config.dim // config.n_heads}
            intermediate_size: ${shape.layers.0.feed_forward.w1.weight[0]}
            num_key_value_heads: '${config.n_kv_heads ?? 1}'
            rope_theta: '${config.rope_theta ?? 500000.0}'
        """))
    run(tmp_path, rule)
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == {
        "hidden_size": 8, "head_dim": 2, "intermediate_size": 14, "num_key_value_heads": 2, "rope_theta": 500000.0}


def test_a_key_template_skips_with_its_reason(tmp_path: Path) -> None:
    write_model(tmp_path / "src", {"h.0.attn.bias": rand(1, 1, 4, 4), "h.1.attn.bias": rand(1, 1, 4, 4),
                                   "h.0.attn.c_proj.weight": rand(3, 3)})
    got = run(tmp_path, rule_file(tmp_path, """\
        tensors:
          - key: 'h.{N}.attn.bias'
            skip: causal mask buffer, not a weight
          - key: 'h.{N}.attn.c_proj.weight'
        """))
    assert sorted(got) == ["h.0.attn.c_proj.weight"]
    records = {e["key"]: e for e in read_audit(tmp_path / "out") if e["event"] == "tensor"}
    assert (records["h.1.attn.bias"]["action"], records["h.1.attn.bias"]["reason"]) == (
        "skipped", "causal mask buffer, not a weight")


def test_require_loaded_names_the_source_key_a_template_would_read(tmp_path: Path) -> None:
    write_model(tmp_path / "src", {"model.layers.0.mlp.gate.weight": rand(2, 3)})
    rule = rule_file(tmp_path, """\
        tensors:
          - key: 'model.layers.{L}.block_sparse_moe.gate.weight'
            to: 'model.layers.{L}.mlp.gate.weight'
            optional: true
          - match: '.+'
            rename: 'x.\\g<0>'
        require:
          loaded: ['model\\.layers\\.0\\.mlp\\.gate\\.weight']
        """)
    with pytest.raises(RequirementError) as err:
        run(tmp_path, rule)
    assert "tensors[0] (" in str(err.value) and \
        "would produce it from 'model.layers.0.block_sparse_moe.gate.weight', which 'model' does not have" in str(err.value)


def test_a_rerun_of_an_op_chain_is_up_to_date(tmp_path: Path) -> None:
    write_model(tmp_path / "src", {"h.0.mlp.c_fc.weight": rand(4, 8), "e.w": rand(2, 3, 4)})
    rule = rule_file(tmp_path, """\
        tensors:
          - key: 'h.{N}.mlp.c_fc.weight'
            ops: [{transpose: [0, 1]}, {rope_permute: {heads: 2}}]
          - key: 'e.w'
            to: 'e.{E}.w'
            ops: [{unstack: {into: E}}]
        """)
    sources = {"model": str(tmp_path / "src")}
    first = api.apply(rule, out=tmp_path / "out", sources=sources, progress=False)
    again = api.apply(rule, out=tmp_path / "out", sources=sources, progress=False)
    assert not first.up_to_date and again.up_to_date
