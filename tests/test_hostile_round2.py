"""The hostile-input suite, round 2 (issue 22): inputs that gave exit 0 with a wrong output,
an unbounded allocation, or an unclear message.

Each case runs the real command in a subprocess, like tests/test_hostile_inputs.py, whose
``Case`` asserts the one error line, the exit code, no output, no temporary sibling and
unchanged sources.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, file_keys
from reference_models import build_meta
from test_hostile_inputs import Case, make_source, simple_rule, write_rule


@pytest.fixture
def case(tmp_path: Path, run_cli: Any) -> Case:
    return Case(tmp_path, run_cli)


# ---------------------------------------------------------------- 1: config vs tensors

#: how Meta's model-parallel layers split a tensor across consolidated.NN.pth (llama/model.py:
#: ColumnParallelLinear splits the output rows, RowParallelLinear and ParallelEmbedding the
#: input columns; norms are replicated)
_MP_SPLIT = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0, "wo": 1, "w2": 1, "tok_embeddings": 1}


def test_one_model_parallel_shard_is_not_taken_for_the_whole_model(case: Case) -> None:
    whole = build_meta(case.root / "whole", dim=32, n_heads=4, n_kv_heads=2, n_layers=1, vocab=64, seed=1,
                       file_name="consolidated.00.pth")
    state = torch.load(whole.path, weights_only=True)
    (case.root / "mp").mkdir()
    shard = {}
    for key, value in state.items():
        dim = next((d for name, d in _MP_SPLIT.items() if f"{name}.weight" in key), None)
        shard[key] = value if dim is None else value.chunk(2, dim=dim)[0].clone()
    torch.save(shard, case.root / "mp" / "consolidated.00.pth")
    (case.root / "mp" / "params.json").write_text(json.dumps(whole.params))
    rule = REPO / "rules" / "meta_llama_to_hf.yaml"
    line = rule.read_text().splitlines().index("  - key: tok_embeddings.weight") + 4  # its concat_shards
    case.fails("apply", "meta_llama_to_hf", "--source", "model=mp/consolidated.00.pth", "--out", "out", code=1,
               line=f"error: tensors[0].ops[0] concat_shards ({rule}:{line}): concat_shards: 'tok_embeddings.weight' "
               "is 16 along dim 1 in each of its 1 shard file (consolidated.00.pth), 16 in all, but the whole tensor "
               "has 32 (${config.dim}): the checkpoint has 2 shards, and 'consolidated.01.pth' is missing from mp; "
               "download it beside the others")


@pytest.mark.parametrize(("config", "line"), [
    ({"hidden_size": 8, "num_attention_heads": 2, "head_dim": 3},
     "num_attention_heads x head_dim (2 x 3) is 6 but output 'model.layers.0.self_attn.q_proj.weight' has 8 rows "
     "(shape [8, 8])"),
    ({"hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 2},
     "num_key_value_heads x head_dim (2 x 4) is 8 but output 'model.layers.0.self_attn.k_proj.weight' has 4 rows "
     "(shape [4, 8])"),
    ({"hidden_size": 8, "intermediate_size": 12},
     "intermediate_size is 12 but output 'model.layers.0.mlp.down_proj.weight' has 24 columns (shape [8, 24])"),
    ({"vocab_size": 32}, "vocab_size is 32 but output 'model.embed_tokens.weight' has 16 rows (shape [16, 8])"),
    ({"num_local_experts": 3}, "num_local_experts is 3 but output 'model.layers.0.mlp.gate.weight' has 2 rows "
     "(shape [2, 8])"),
    ({"num_hidden_layers": 2}, "num_hidden_layers is 2 but no output is of layer 1 (the output has 1 layer)"),
    ({"num_hidden_layers": 0}, "num_hidden_layers is 0 but output 'model.layers.0.mlp.down_proj.weight' is layer 0"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings is true but output 'lm_head.weight' is written beside "
     "'model.embed_tokens.weight': transformers would replace it with the embedding"),
])
def test_a_config_field_the_tensors_contradict_is_refused(case: Case, config: dict[str, Any], line: str) -> None:
    shapes = {"model.embed_tokens.weight": (16, 8), "lm_head.weight": (16, 8), "model.norm.weight": (8,),
              "model.layers.0.self_attn.q_proj.weight": (8, 8), "model.layers.0.self_attn.k_proj.weight": (4, 8),
              "model.layers.0.mlp.down_proj.weight": (8, 24), "model.layers.0.mlp.gate.weight": (2, 8)}
    make_source(case.root / "m", {k: torch.zeros(s) for k, s in shapes.items()}, config=json.dumps(config))
    rule = write_rule(case.root / "r.yaml", "sources:\n  m: {path: m}\ntensors:\n  - match: '.+'\n"
                      "config:\n  from: m\n")
    case.fails("plan", rule, code=1, line=f"error: config (r.yaml:7): {line}; the written config must describe the "
               "tensors written: fix the rule's config section, or convert the whole checkpoint (one model-parallel "
               "shard has a fraction of the model's dimensions)")


# ---------------------------------------------------------------- 3: output.dtype in the config


def dtype_rule(case: Case, extra: str = "") -> Path:
    make_source(case.root / "m", {"w": torch.ones(2, 2)}, config=json.dumps(
        {"torch_dtype": "float32", "dtype": "float32", "text_config": {"torch_dtype": "float32"}}))
    return write_rule(case.root / "r.yaml", "sources:\n  m: {path: m}\ntensors:\n  - match: 'w'\n"
                      f"output: {{dtype: bfloat16}}\nconfig:\n  from: m\n{extra}")


def test_output_dtype_is_what_the_written_config_says(case: Case) -> None:
    proc = case.run_cli("apply", dtype_rule(case), "--out", case.out, cwd=case.root)
    assert proc.returncode == 0, proc.stderr
    config = json.loads((case.out / "config.json").read_text())
    assert (config["torch_dtype"], config["dtype"], config["text_config"]["torch_dtype"]) == ("bfloat16",) * 3
    assert file_keys(case.out / "model.safetensors") == {"w": ([2, 2], "BF16")}


def test_output_dtype_wins_over_a_dtype_the_config_section_sets(case: Case) -> None:
    proc = case.run_cli("apply", dtype_rule(case, "  set:\n    torch_dtype: float16\n"), "--out", case.out,
                        cwd=case.root)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((case.out / "config.json").read_text())["torch_dtype"] == "bfloat16"


# ---------------------------------------------------------------- 13: files under an output file


@pytest.mark.parametrize("target", ["config.json/x", "model.safetensors/x", "ckptxform_audit.jsonl/a/b"])
def test_a_file_copied_under_an_output_file_is_refused_at_plan_time(case: Case, target: str) -> None:
    make_source(case.root / "m", {"w": torch.ones(2)})
    (case.root / "m" / "tokenizer.json").write_text("{}")
    rule = write_rule(case.root / "r.yaml", "sources:\n  m: {path: m}\ntensors:\n  - match: 'w'\n"
                      f"files:\n  - {{glob: tokenizer.json, rename: '{target}'}}\n")
    top = target.split("/")[0]
    case.fails("apply", rule, "--out", "out", code=1, line=(
        f"error: files[0] (r.yaml:7): would copy m:'tokenizer.json' to '{target}', under '{top}', a name the "
        "output's weights, config.json or audit take; skip the file or rename it"))


def test_a_copy_under_another_copy_is_refused_at_plan_time(case: Case) -> None:
    make_source(case.root / "m", {"w": torch.ones(2)})
    (case.root / "m" / "tokenizer.json").write_text("{}")
    (case.root / "m" / "vocab.txt").write_text("a")
    rule = write_rule(case.root / "r.yaml", "sources:\n  m: {path: m}\ntensors:\n  - match: 'w'\n"
                      "files:\n  - {glob: tokenizer.json}\n  - {glob: vocab.txt, rename: tokenizer.json/vocab.txt}\n")
    case.fails("apply", rule, "--out", "out", code=1, line=(
        "error: files[1] (r.yaml:8): m:'vocab.txt' would be copied to 'tokenizer.json/vocab.txt' and "
        "m:'tokenizer.json' to 'tokenizer.json': one path cannot be a file and a folder; rename one (rename: may "
        "use {path})"))


# ---------------------------------------------------------------- 8: a rule matching nothing, at apply


def unmatched_rule(case: Case) -> Path:
    make_source(case.root / "m", {"w": torch.ones(2)})
    return write_rule(case.root / "r.yaml", "sources:\n  m: {path: m}\ntensors:\n  - match: 'x'\n  - match: 'w'\n")


def test_apply_refuses_a_rule_that_matched_no_tensor(case: Case) -> None:
    # a warning until issue 35: a rule that matches nothing does not fit the checkpoint
    case.fails("apply", unmatched_rule(case), "--out", "out", code=1, line=(
        "error: r.yaml: 1 tensor rule matches no tensor of source 'm' (m): tensors[0] (r.yaml:5) match 'x'; "
        "this rule does not fit this checkpoint (or the pattern is wrong); mark a rule 'optional: true' when "
        "the tensor may be absent; no shipped rule plans on it (ckptxform rules --for m)"))


# ---------------------------------------------------------------- 2: a cast of a quantized weight


FP8_CONFIG = json.dumps({"quantization_config": {"quant_method": "fp8", "weight_block_size": [2, 2]}})


def fp8_source(case: Case, config: str | None = FP8_CONFIG) -> None:
    make_source(case.root / "m", {"w.weight": torch.full((2, 2), 2.0).to(torch.float8_e4m3fn),
                                  "w.weight_scale_inv": torch.full((1, 1), 448.0)}, config=config)


def test_a_cast_of_a_quantized_weight_without_its_scale_is_refused(case: Case) -> None:
    fp8_source(case)
    rule = write_rule(case.root / "r.yaml", "sources:\n  m: {path: m}\ntensors:\n  - match: 'w\\.weight'\n"
                      "    cast: bfloat16\n  - match: 'w\\.weight_scale_inv'\n    skip: not needed\n")
    case.fails("apply", rule, "--out", "out", code=1, line=(
        "error: tensors[0] (r.yaml:5) (from m:w.weight): cast F8_E4M3 -> BF16 of 'w.weight' would drop its scale: "
        "the source's quantization_config (quant_method 'fp8') declares it quantized and 'w.weight_scale_inv' "
        "scales it; dequantize it with dequant_fp8_block (a key: rule over the weight and its scale, ops: "
        "[dequant_fp8_block: {over: T}]) instead of casting"))


def test_a_cast_of_a_quantized_weight_by_add_is_refused_too(case: Case) -> None:
    fp8_source(case)
    rule = write_rule(case.root / "r.yaml", "sources:\n  m: {path: m}\ntensors:\n  - match: '.+'\n    skip: x\n"
                      "add:\n  big: {source: m, tensor: w.weight, cast: float32}\n")
    case.fails("plan", rule, code=1, line=(
        "error: add.big (r.yaml:8): cast F8_E4M3 -> F32 of 'w.weight' would drop its scale: the source's "
        "quantization_config (quant_method 'fp8') declares it quantized and 'w.weight_scale_inv' scales it; "
        "dequantize it with dequant_fp8_block (a key: rule over the weight and its scale, ops: "
        "[dequant_fp8_block: {over: T}]) instead of casting"))


def test_a_cast_of_a_float8_tensor_of_an_unquantized_source_is_kept(case: Case) -> None:
    fp8_source(case, config='{"hidden_size": 4}')
    rule = write_rule(case.root / "r.yaml", "sources:\n  m: {path: m}\ntensors:\n  - match: 'w\\.weight'\n"
                      "    cast: bfloat16\n  - match: 'w\\.weight_scale_inv'\n")
    proc = case.run_cli("apply", rule, "--out", "out", cwd=case.root)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------- 4: non-finite dequantized values


def test_e4m3_bytes_decode_as_torch_decodes_them_nan_included() -> None:
    from ckptxform.quant.kernels import Fp8Block, dequant_fp8_rows, tensor_view

    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16)
    out = dequant_fp8_rows(bytes(every.numpy()), bytes(torch.ones(1, 1).numpy()), Fp8Block(16, 16, 16),
                           out_dtype="F32")
    want = every.view(torch.float8_e4m3fn).to(torch.float32)  # the reference: 0x7F/0xFF are NaN
    got = torch.from_numpy(tensor_view(out, "F32", (16, 16)).copy())  # the kernels' view is numpy
    assert torch.equal(got.isnan(), want.isnan()) and int(want.isnan().sum()) == 2
    assert torch.equal(got[~want.isnan()], want[~want.isnan()])


def dequant_rule(case: Case, weight: torch.Tensor, scale: torch.Tensor, allow: str = "") -> Path:
    make_source(case.root / "m", {"w.weight": weight.to(torch.float8_e4m3fn) if weight.is_floating_point()
                                  else weight.view(torch.float8_e4m3fn), "w.weight_scale_inv": scale},
                config=FP8_CONFIG)
    return write_rule(case.root / "r.yaml", "sources:\n  m: {path: m}\ntensors:\n"
                      "  - key: '{X*}.{T:weight,weight_scale_inv}'\n    to: '{X}.weight'\n"
                      f"    ops: [dequant_fp8_block: {{over: T{allow}}}]\n")


NONFINITE = ("non-finite value from a NaN or inf scale or a NaN byte of the source; fix the source, or add "
             "allow_nonfinite: true to the op to write such values")


def test_a_nan_scale_is_refused_naming_the_tensor_and_the_first_bad_index(case: Case) -> None:
    rule = dequant_rule(case, torch.ones(4, 4), torch.tensor([[1.0, 1.0], [1.0, float("nan")]]))
    case.fails("apply", rule, "--out", "out", code=1, line=(
        f"error: tensors[0].ops[0] dequant_fp8_block (r.yaml:7): 'w.weight' dequantized gives nan at [2, 2], a {NONFINITE}"))


def test_a_nan_scale_in_a_later_block_of_a_large_tensor_is_refused_with_nothing_left(case: Case) -> None:
    """A weight of three blocks of rows, decoded two at once and each written in turn by its
    own thread (quant/pipeline.then_in_order): the second block's NaN is the one error, the
    first block's bytes are not left anywhere, no thread is left waiting (``fails``: 60 s)."""
    scale = torch.ones(1025, 512)
    scale[700, 3] = float("nan")  # rows 1400-1401, columns 6-7: the second block of rows (1024-2047)
    rule = dequant_rule(case, torch.ones(2050, 1024), scale)
    case.fails("apply", rule, "--out", "out", code=1, line=(
        f"error: tensors[0].ops[0] dequant_fp8_block (r.yaml:7): 'w.weight' dequantized gives nan at [1400, 6], a "
        f"{NONFINITE}"))


def test_an_inf_scale_is_refused(case: Case) -> None:
    rule = dequant_rule(case, torch.ones(4, 4), torch.tensor([[1.0, float("inf")], [1.0, 1.0]]))
    case.fails("apply", rule, "--out", "out", code=1, line=(
        f"error: tensors[0].ops[0] dequant_fp8_block (r.yaml:7): 'w.weight' dequantized gives inf at [0, 2], a {NONFINITE}"))


def test_a_nan_byte_is_refused(case: Case) -> None:
    weight = torch.full((4, 4), 0x38, dtype=torch.uint8)  # 1.0
    weight[3, 1] = 0xFF
    rule = dequant_rule(case, weight, torch.ones(2, 2))
    case.fails("apply", rule, "--out", "out", code=1, line=(
        f"error: tensors[0].ops[0] dequant_fp8_block (r.yaml:7): 'w.weight' dequantized gives nan at [3, 1], a {NONFINITE}"))


def test_allow_nonfinite_writes_them(case: Case) -> None:
    rule = dequant_rule(case, torch.ones(4, 4), torch.tensor([[1.0, 1.0], [1.0, float("nan")]]),
                        ", allow_nonfinite: true")
    proc = case.run_cli("apply", rule, "--out", "out", cwd=case.root)
    assert proc.returncode == 0, proc.stderr
    from conftest import read_output
    got = read_output(case.out)["w.weight"]
    assert got.dtype == torch.bfloat16 and int(got.isnan().sum()) == 4 and bool(got[:2].eq(1).all())


def test_an_int4_block_with_an_inf_scale_is_refused_where_it_is_decoded() -> None:
    from functools import partial

    from ckptxform.errors import CheckpointFormatError
    from ckptxform.quant.finite import checked
    from ckptxform.quant.kernels import Int4Groups, dequant_int4_rows

    words = bytes(torch.full((3, 2), 0x77777777, dtype=torch.int32).numpy())  # q = -1 everywhere
    scale = bytes(torch.tensor([[1.0], [1.0], [float("-inf")]], dtype=torch.bfloat16).view(torch.int16).numpy())
    layout = Int4Groups(cols=16, group_size=16, scale_dtype="BF16")
    run = checked(partial(dequant_int4_rows, words, scale, layout), dtype="BF16", cols=16, first_row=8,
                  what="'m.weight_packed' dequantized", scale=scale, scale_dtype="BF16", largest_code=15.0)
    with pytest.raises(CheckpointFormatError) as err:
        run()
    assert str(err.value).startswith("'m.weight_packed' dequantized gives inf at [10, 0], a non-finite value")


# ---------------------------------------------------------------- 11: counts bounded by the tensors present


def experts(prefix: str, names: tuple[str, ...], indices: tuple[str, ...] = ("0", "1")) -> dict[str, torch.Tensor]:
    return {f"model.layers.0.{prefix}.experts.{e}.{p}.weight": torch.ones(2, 2) for e in indices for p in names}


def test_a_huge_expert_count_in_the_config_is_a_missing_member_not_an_allocation(case: Case) -> None:
    tensors = experts("block_sparse_moe", ("w1", "w2", "w3")) | {
        "model.layers.0.block_sparse_moe.gate.weight": torch.ones(2, 2)}
    make_source(case.root / "m", tensors, config=json.dumps({"num_local_experts": 100000000000,
                                                             "intermediate_size": 2}))
    rule = REPO / "rules" / "mixtral_legacy_to_fused.yaml"
    line = rule.read_text().splitlines().index("      - stack: {over: E, count: '${config.num_local_experts}'}") + 1
    case.fails("plan", "mixtral_legacy_to_fused", "--source", "model=m", code=1, line=(
        f"error: tensors[0].ops[0] stack ({rule}:{line}): incomplete group: "
        "'model.layers.0.block_sparse_moe.experts.2.w1.weight' is missing (99,999,999,998 members missing); "
        "stack over {E} needs 0, 1, 2, 3, 4, 5, 6, 7..."))


def test_a_huge_router_in_a_header_alone_is_a_missing_member_not_an_allocation(case: Case) -> None:
    tensors = experts("mlp", ("gate_proj", "up_proj", "down_proj")) | {
        "model.layers.0.mlp.gate.weight": torch.ones(100000000000, 0)}  # no bytes
    make_source(case.root / "m", tensors)
    rule = REPO / "rules" / "qwen2_moe_legacy_to_fused.yaml"
    lines = rule.read_text().splitlines()
    line = len(lines) - lines[::-1].index("      - stack: {over: E, count: '${shape.{X}.mlp.gate.weight[0]}'}")
    case.fails("plan", "qwen2_moe_legacy_to_fused", "--source", "model=m", code=1, line=(
        f"error: tensors[1].ops[0] stack ({rule}:{line}): incomplete group: "
        "'model.layers.0.mlp.experts.2.down_proj.weight' is missing (99,999,999,998 members missing); "
        "stack over {E} needs 0, 1, 2, 3, 4, 5, 6, 7..."))


def stack_rule(case: Case, indices: tuple[str, ...], count: str = "") -> Path:
    make_source(case.root / "m", experts("mlp", ("w1",), indices))
    return write_rule(case.root / "r.yaml", "sources:\n  m: {path: m}\ntensors:\n"
                      "  - key: 'model.layers.0.mlp.experts.{E}.w1.weight'\n    to: 'w1'\n"
                      f"    ops: [stack: {{over: E{count}}}]\n")


def test_a_huge_expert_index_in_a_key_is_a_missing_member_not_an_allocation(case: Case) -> None:
    case.fails("plan", stack_rule(case, ("0", "1", "100000000000")), code=1, line=(
        "error: tensors[0].ops[0] stack (r.yaml:7): incomplete group: 'model.layers.0.mlp.experts.2.w1.weight' "
        "is missing (99,999,999,998 members missing); stack over {E} needs 0, 1, 2, 3, 4, 5, 6, 7..."))


# ---------------------------------------------------------------- 14: unclear messages


def test_a_negative_expert_count_is_named(case: Case) -> None:
    tensors = experts("block_sparse_moe", ("w1", "w2", "w3")) | {
        "model.layers.0.block_sparse_moe.gate.weight": torch.ones(2, 2)}
    make_source(case.root / "m", tensors, config=json.dumps({"num_local_experts": -4, "intermediate_size": 2}))
    rule = REPO / "rules" / "mixtral_legacy_to_fused.yaml"
    line = rule.read_text().splitlines().index("      - stack: {over: E, count: '${config.num_local_experts}'}") + 1
    case.fails("plan", "mixtral_legacy_to_fused", "--source", "model=m", code=1, line=(
        f"error: tensors[0].ops[0] stack ({rule}:{line}): stack over E: count '${{config.num_local_experts}}' is "
        "-4, a negative number of members; fix the count (or the config field it reads)"))


def test_an_expert_index_with_a_superscript_digit_is_no_index(case: Case) -> None:
    case.fails("plan", stack_rule(case, ("0", "1", "\u00b2"), ", count: 2"), code=1, line=(
        "error: tensors[0].ops[0] stack (r.yaml:7): 'model.layers.0.mlp.experts.\u00b2.w1.weight' is beyond the 2 "
        "members stack over {E} expects (0, 1)"))


def test_unstacking_a_huge_dim_of_no_bytes_is_refused_not_listed(case: Case) -> None:
    make_source(case.root / "m", {"fused": torch.ones(100000000000, 0)})
    rule = write_rule(case.root / "r.yaml", "sources:\n  m: {path: m}\ntensors:\n  - key: 'fused'\n"
                      "    to: 'e.{E}'\n    ops: [unstack: {into: E}]\n")
    case.fails("plan", rule, code=1, line=(
        "error: tensors[0].ops[0] unstack (r.yaml:7): unstack: dim 0 of the tensor (shape [100000000000, 0]) is "
        "100,000,000,000 but it holds no bytes: there is nothing to unstack"))


def test_an_unreadable_rule_fifo_named_like_a_shipped_rule_says_it_is_a_fifo(case: Case) -> None:
    os.mkfifo(case.root / "meta_llama_to_hf.yaml")
    case.fails("plan", "meta_llama_to_hf.yaml", code=2, line=(
        "meta_llama_to_hf.yaml: is a FIFO (named pipe) and nothing was written to it; give the path of a YAML file "
        "(a shipped rule has that file name: 'meta_llama_to_hf' names it; or remove the FIFO)"))


def test_a_null_where_a_string_belongs_says_null_once(case: Case) -> None:
    case.fails("validate", simple_rule(case, "  - match: 'w'\n    skip: null\n"), code=2, line=(
        "r.yaml:6:11: tensors[0].skip: expected a string, got null"))


def test_validate_json_failure_says_where_the_first_problem_is(case: Case) -> None:
    simple_rule(case, "  - match: 'w'\n    skip: null\n  - match: 'x'\n    cast: float99\n")
    proc = case.run_cli("validate", "--json", "r.yaml", cwd=case.root)
    assert proc.returncode == 2
    failure = json.loads(proc.stdout)
    assert (failure["path"], failure["line"], failure["col"]) == ("r.yaml", 6, 11)
    assert failure["messages"] == ["r.yaml:6:11: tensors[0].skip: expected a string, got null",
                                   "r.yaml:8:11: tensors[1].cast: 'float99' is not one of 'bfloat16', 'float16', "
                                   "'float32', 'float64'"]


@pytest.mark.parametrize("as_json", [(), ("--json",)])
def test_apply_to_a_full_stdout_commits_exits_0_and_says_the_report_was_lost(case: Case, as_json: tuple[str, ...]
                                                                             ) -> None:
    make_source(case.root / "m", {"w": torch.ones(2)})
    simple_rule(case)
    env = {k: v for k, v in os.environ.items() if k != "CKPTXFORM_DEBUG"}
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "ckptxform", "apply", "r.yaml", "--out", "out", *as_json],
                              stdout=full, stderr=subprocess.PIPE, text=True, env=env, cwd=case.root, timeout=120)
    assert (proc.returncode, proc.stderr.splitlines()) == (0, [
        f"WARNING {case.out} is written; its report was not printed: cannot write to standard output: No space left on "
        "device; redirect it to a file where there is room"])
    assert case.run_cli("verify", "out", cwd=case.root).returncode == 0


def test_a_group_reference_with_a_superscript_digit_is_no_group(case: Case) -> None:
    case.fails("validate", simple_rule(case, "  - match: '(w)'\n    rename: '\\g<\u00b2>'\n"), code=2, line=(
        "r.yaml:6:13: tensors[0].rename: \\g<\u00b2> names no group of 'match'"))


def test_a_shard_of_with_a_superscript_digit_is_a_usage_error(case: Case) -> None:
    make_source(case.root / "m", {"w": torch.ones(2)})
    case.fails("apply", simple_rule(case), "--out", "out", "--shard-of", "\u00b2/4", code=2, line=(
        "error: --shard-of '\u00b2/4': expected RANK/WORLD with 0 <= RANK < WORLD, e.g. --shard-of 0/4"))
