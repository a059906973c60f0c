"""Meta's model-parallel checkpoints (consolidated.NN.pth + params.json) as one source, and
``meta_llama_to_hf`` over MP=1..4 from the same rule.

The reference is transformers' Meta converter (``write_model``, restated in
reference_models.py because transformers 5.x wheels no longer ship it) run on the very
shard files the rule reads, compared bit for bit; the stand-ins are split from one whole
seeded model by standins/meta_shards.py (GQA and full attention, head_dim 6/10, Llama 2's
params.json without n_kv_heads, Llama 3's row-split embedding), other sizes and seeds
than any other test's.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from conftest import assert_clean_failure, error_lines
from reference_models import load_strict, logits, meta_forward, read_tensors, tensor_bytes, transformers_write_model

from ckptxform import api
from ckptxform.errors import CheckpointFormatError, PlanError, SourceNotFoundError
from ckptxform.standins.meta_shards import META_GQA_TINY, MetaDims, build_meta_model_parallel

REPO = Path(__file__).resolve().parents[1]
RULE = REPO / "rules" / "meta_llama_to_hf.yaml"

#: (name, dims, shards, Llama version, seed)
CASES = [
    ("llama2-13b-like-mha-mp2", MetaDims(dim=40, heads=4, kv_heads=None, vocab=90, multiple_of=8,
                                         ffn_dim_multiplier=None), 2, "2", 1),
    ("llama2-70b-like-gqa-mp4", META_GQA_TINY, 4, "2", 2),
    ("codellama-34b-like-gqa-mp4", MetaDims(dim=80, heads=8, kv_heads=4, layers=3, vocab=100,
                                            ffn_dim_multiplier=1.0), 4, "2", 7),
    ("llama3-70b-like-gqa-mp2", MetaDims(dim=48, heads=8, kv_heads=2, vocab=92), 2, "3", 4),
    ("llama2-7b-like-mp1", MetaDims(dim=40, heads=4, kv_heads=None, vocab=90), 1, "2", 5),
]


def _shards(directory: Path) -> list[dict[str, torch.Tensor]]:
    return [torch.load(f, weights_only=True, map_location="cpu") for f in sorted(directory.glob("consolidated.*.pth"))]


@pytest.mark.parametrize(("name", "dims", "shards", "version", "seed"), CASES, ids=[c[0] for c in CASES])
def test_the_conversion_is_transformers_converter_bit_for_bit(tmp_path: Path, name: str, dims: MetaDims,
                                                               shards: int, version: str, seed: int) -> None:
    source = build_meta_model_parallel(tmp_path / name, dims, shards=shards, seed=seed, version=version)
    out = api.apply("meta_llama_to_hf", out=tmp_path / "hf", sources={"model": str(source)}, progress=False).out
    params = json.loads((source / "params.json").read_text())
    want = transformers_write_model(_shards(source), params, llama_version=version)
    got = tensor_bytes(out)
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key] == tensor_bytes_of(tensor), key
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"],
            config["head_dim"], config["intermediate_size"], config["vocab_size"]) == (
        dims.dim, dims.heads, dims.n_kv, dims.head_dim, dims.ffn, dims.vocab)


def tensor_bytes_of(t: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    return str(t.dtype), tuple(t.shape), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def test_one_rule_gives_the_same_bytes_for_every_model_parallel_degree(tmp_path: Path) -> None:
    """The whole model split over 1, 2 or 4 shards converts to one output, byte for byte."""
    outs = []
    for shards in (1, 2, 4):
        source = build_meta_model_parallel(tmp_path / f"mp{shards}", shards=shards, seed=11)
        outs.append(api.apply("meta_llama_to_hf", out=tmp_path / f"hf{shards}", sources={"model": str(source)},
                              progress=False).out)
    assert tensor_bytes(outs[0]) == tensor_bytes(outs[1]) == tensor_bytes(outs[2])
    # the audit names every shard file a tensor's bytes come from
    written = [json.loads(line) for line in (outs[2] / "ckptxform_audit.jsonl").read_text().splitlines()]
    q = next(e for e in written if e.get("event") == "written" and e.get("key") == "model.layers.1.self_attn.q_proj.weight")
    assert [i.get("shard") for i in q["from"]["inputs"]] == [0, 1, 2, 3], q


@pytest.mark.reference
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed; the 'reference' extra: "
                           "pip install torch==2.13.0 -e '.[test,reference]'")
@pytest.mark.parametrize(("name", "dims", "shards", "version", "seed"), CASES[:3], ids=[c[0] for c in CASES[:3]])
def test_transformers_loads_the_output_and_computes_meta_s_logits(tmp_path: Path, name: str, dims: MetaDims,
                                                                  shards: int, version: str, seed: int) -> None:
    """No missing or unexpected key, and the logits of Meta's definition run on the whole
    (never split) model."""
    source = build_meta_model_parallel(tmp_path / name, dims, shards=shards, seed=seed, version=version)
    whole = build_meta_model_parallel(tmp_path / "whole", dims, shards=1, seed=seed, version=version)
    out = api.apply("meta_llama_to_hf", out=tmp_path / "hf", sources={"model": str(source)}, progress=False).out
    params = {**json.loads((whole / "params.json").read_text()), "n_kv_heads": dims.n_kv, "rope_theta": 10000.0}
    torch.testing.assert_close(logits(load_strict("LlamaForCausalLM", out)),
                               meta_forward(read_tensors(whole / "consolidated.00.pth"), params),
                               rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------ refusals


def _copy(source: Path, to: Path, files: list[str]) -> Path:
    to.mkdir()
    for name in [*files, "params.json"]:
        (to / name).write_bytes((source / name).read_bytes())
    return to


def test_fewer_shards_than_params_json_implies_are_refused_naming_the_missing_files(tmp_path: Path,
                                                                                    run_cli) -> None:  # type: ignore[no-untyped-def]
    full = build_meta_model_parallel(tmp_path / "mp4", shards=4, seed=3)
    part = _copy(full, tmp_path / "part", ["consolidated.00.pth", "consolidated.01.pth"])
    done = run_cli("apply", "meta_llama_to_hf", "--source", f"model={part}", "--out", tmp_path / "out")
    assert_clean_failure(done, 1)
    line = RULE.read_text().splitlines().index("  - key: tok_embeddings.weight") + 4
    assert error_lines(done.stderr) == [
        f"error: tensors[0].ops[0] concat_shards ({RULE}:{line}): concat_shards: 'tok_embeddings.weight' is 12 "
        "along dim 1 in each of its 2 shard files (consolidated.00.pth, consolidated.01.pth), 24 in all, but the "
        "whole tensor has 48 (${config.dim}): the checkpoint has 4 shards, and 'consolidated.02.pth', "
        f"'consolidated.03.pth' are missing from {part}; download them beside the others"]
    assert not (tmp_path / "out").exists()


def test_one_shard_s_file_given_with_the_others_beside_it_asks_for_the_directory(tmp_path: Path) -> None:
    full = build_meta_model_parallel(tmp_path / "mp2", shards=2, seed=3)
    with pytest.raises(PlanError, match=r"'consolidated\.01\.pth' is missing from this source, but .*mp2 holds it: "
                                        r"give the directory, not one shard's file"):
        api.plan("meta_llama_to_hf", sources={"model": str(full / "consolidated.00.pth")})


def test_a_gap_in_the_shard_numbering_is_refused(tmp_path: Path) -> None:
    full = build_meta_model_parallel(tmp_path / "mp4", shards=4, seed=3)
    gap = _copy(full, tmp_path / "gap", ["consolidated.00.pth", "consolidated.03.pth"])
    with pytest.raises(SourceNotFoundError, match=r"holds model-parallel shards 'consolidated\.00\.pth', "
                                                  r"'consolidated\.03\.pth' but not 'consolidated\.01\.pth', "
                                                  r"'consolidated\.02\.pth'; download"):
        api.plan("meta_llama_to_hf", sources={"model": str(gap)})


def test_shards_of_two_checkpoints_are_refused(tmp_path: Path) -> None:
    """Another model's shard (other shapes), a shard saved in another dtype, a shard lacking a key."""
    a = build_meta_model_parallel(tmp_path / "a", shards=2, seed=3)
    b = build_meta_model_parallel(tmp_path / "b", MetaDims(dim=40, heads=4, kv_heads=2, vocab=92), shards=2, seed=3)
    mixed = _copy(a, tmp_path / "mixed", ["consolidated.00.pth"])
    (mixed / "consolidated.01.pth").write_bytes((b / "consolidated.01.pth").read_bytes())
    with pytest.raises(CheckpointFormatError, match=r"mixed: tensor 'tok_embeddings\.weight' is BF16 \[92, 24\] in "
                                                    r"consolidated\.00\.pth but BF16 \[92, 20\] in consolidated\.01"
                                                    r"\.pth; .*not one checkpoint's"):
        api.plan("meta_llama_to_hf", sources={"model": str(mixed)})
    state = torch.load(a / "consolidated.01.pth", weights_only=True)
    torch.save({k: v.half() if k == "norm.weight" else v for k, v in state.items()}, mixed / "consolidated.01.pth")
    with pytest.raises(CheckpointFormatError, match=r"'norm\.weight' is BF16 \[48\] in consolidated\.00\.pth but "
                                                    r"F16 \[48\] in consolidated\.01\.pth"):
        api.plan("meta_llama_to_hf", sources={"model": str(mixed)})
    torch.save({k: v for k, v in state.items() if k != "layers.1.ffn_norm.weight"}, mixed / "consolidated.01.pth")
    with pytest.raises(CheckpointFormatError, match=r"consolidated\.01\.pth: lacks 'layers\.1\.ffn_norm\.weight', "
                                                    r"which consolidated\.00\.pth holds"):
        api.plan("meta_llama_to_hf", sources={"model": str(mixed)})


def test_a_replicated_tensor_that_differs_between_shards_fails_the_run_and_writes_nothing(
        tmp_path: Path, run_cli) -> None:  # type: ignore[no-untyped-def]
    source = build_meta_model_parallel(tmp_path / "mp2", shards=2, seed=3)
    state = torch.load(source / "consolidated.01.pth", weights_only=True)
    state["layers.0.ffn_norm.weight"] = state["layers.0.ffn_norm.weight"].clone()
    state["layers.0.ffn_norm.weight"][5] += 1
    torch.save(state, source / "consolidated.01.pth")
    done = run_cli("apply", "meta_llama_to_hf", "--source", f"model={source}", "--out", tmp_path / "out")
    assert_clean_failure(done, 1)
    [line] = error_lines(done.stderr)
    assert line.startswith(f"error: {source}: tensor 'layers.0.ffn_norm.weight' differs between consolidated.00.pth "
                           "and consolidated.01.pth (byte 10): it is split across the model-parallel shards, not "
                           "replicated; concatenate it in the rule"), line
    assert not (tmp_path / "out").exists()


def _rule(tmp_path: Path, ops: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text("version: 1\nsources:\n  model: {path: mp2, config: params.json}\nconvert: model\n"
                    "require: {strict: false}\ntensors:\n"
                    f"  - key: 'layers.{{L}}.attention.wq.weight'\n    ops: {ops}\n")
    return path


def test_a_split_tensor_read_without_concat_shards_is_never_taken_for_a_replicated_one(tmp_path: Path) -> None:
    build_meta_model_parallel(tmp_path / "mp2", shards=2, seed=3)
    with pytest.raises(CheckpointFormatError, match=r"'layers\.0\.attention\.wq\.weight' differs between "
                                                    r"consolidated\.00\.pth and consolidated\.01\.pth"):
        api.apply(_rule(tmp_path, "[]"), out=tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("ops", "message"), [
    ("[{rope_permute: {heads: 4}}, {concat_shards: {dim: 0}}]",
     r"ops\[1\] concat_shards .*: concat_shards reads a source tensor's pieces in every shard file: it must be "
     r"the first op of the chain"),
    ("[{concat_shards: {dim: 2}}]", r"concat_shards: dim 2 is outside a tensor of shape \[24, 48\]"),
    ("[{concat_shards: {dim: 0, size: 40}}]", r"'layers\.0\.attention\.wq\.weight' is 24 along dim 0 in each shard "
     r"file, and the whole tensor has 40, which is not a whole number of such pieces"),
    ("[{concat_shards: {dim: 0, size: 24}}]", r"the whole tensor has 24: the checkpoint has 1 shards, and 1 more "
     r"than the whole tensor needs; give only one checkpoint's shards"),
    ("[{concat_shards: {shape: [null, null]}}]", r"match it in every known dim, so the split dim is not known"),
    ("[{concat_shards: {shape: [24, 48]}}]", r"the pieces \(shape \[24, 48\] in each of 2 shards\) already have it"),
])
def test_a_concat_shards_that_cannot_be_is_refused_at_plan_time(tmp_path: Path, ops: str, message: str) -> None:
    build_meta_model_parallel(tmp_path / "mp2", shards=2, seed=3)
    with pytest.raises(PlanError, match=message):
        api.plan(_rule(tmp_path, ops))


@pytest.mark.parametrize("dim", [0, 1, 2, -1])
@pytest.mark.parametrize("then", [[], [{"rope_permute": {"heads": 3}}], [{"transpose": [0, 2]}]])
def test_concat_shards_along_any_dim_is_torch_cat_also_under_later_ops(tmp_path: Path, dim: int,
                                                                       then: list[dict]) -> None:
    """Three shards of rank-3 tensors of two dtypes; later ops read the concatenation by rows
    (a block's row ranges when the split dim is an inner one)."""
    gen = torch.Generator().manual_seed(dim + 7)
    whole = {"a.w": torch.randn(6, 6, 9, generator=gen).to(torch.bfloat16),
             "b.w": torch.randint(-100, 100, (6, 6, 9), generator=gen, dtype=torch.int8)}
    (tmp_path / "mp").mkdir()
    for rank in range(3):
        torch.save({k: v.chunk(3, dim=dim)[rank].clone() for k, v in whole.items()},
                   tmp_path / "mp" / f"consolidated.{rank:02d}.pth")
    ops = [{"concat_shards": {"dim": dim}}, *then]
    rule = tmp_path / "r.yaml"
    rule.write_text("version: 1\nsources:\n  model: {path: mp}\nconvert: model\ntensors:\n"
                    f"  - key: '{{N}}.w'\n    ops: {json.dumps(ops)}\n")
    api.apply(rule, out=tmp_path / "out", progress=False)
    got = read_tensors(tmp_path / "out")
    for key, want in whole.items():
        for op in then:
            if "transpose" in op:
                want = want.transpose(0, 2).contiguous()
            else:  # Meta -> HF: view(n, hd // 2, 2, ...).transpose(1, 2)
                want = want.reshape(3, 1, 2, 6, 9).transpose(1, 2).reshape(6, 6, 9)
        assert tensor_bytes_of(got[key]) == tensor_bytes_of(want), (key, ops)
