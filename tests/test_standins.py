"""The stand-ins must look like the real checkpoints to every reader: exact keys, shapes,
dtypes, configs and vocabulary maps, written the same way byte for byte every time."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ckptxform.errors import UsageError
from ckptxform.standins import (
    KIMI_K2,
    KIMI_K2_TINY,
    LLAMA31_8B,
    LLAMA31_8B_TINY,
    DrafterDims,
    HeadlineStandins,
    build_eagle3_drafter,
    build_full_vocab_drafter,
    build_headline_standins,
    build_kimi_k25_verifier,
    build_llama_eagle3,
    make_draft_vocab,
)

DIMS = KIMI_K2_TINY
LAYER = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "mlp.down_proj.weight", "input_layernorm.weight", "hidden_norm.weight",
    "post_attention_layernorm.weight",
)
NATIVE_KEYS = {f"midlayer.{k}" for k in LAYER} | {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}


def expected_shapes(dims: DrafterDims, prefix: str = "midlayer.") -> dict[str, tuple[int, ...]]:
    """eagle3-formats.md's table, written out independently of the builder."""
    h, q, kv, i = dims.hidden, dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim, \
        dims.intermediate
    layer = {
        "self_attn.q_proj.weight": (q, 2 * h), "self_attn.k_proj.weight": (kv, 2 * h),
        "self_attn.v_proj.weight": (kv, 2 * h), "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i), "input_layernorm.weight": (h,),
        "hidden_norm.weight": (h,), "post_attention_layernorm.weight": (h,),
    }
    return {**{prefix + k: v for k, v in layer.items()},
            "fc.weight": (h, len(dims.aux_layers) * dims.verifier_hidden),
            "norm.weight": (h,), "lm_head.weight": (dims.draft_vocab, h),
            "d2t": (dims.draft_vocab,), "t2d": (dims.vocab,)}


def digest(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def ids_for(dims: DrafterDims = DIMS, seed: int = 0) -> tuple[int, ...]:
    return make_draft_vocab(dims.vocab, dims.draft_vocab, seed=seed)


@pytest.fixture(scope="module")
def headline(tmp_path_factory: pytest.TempPathFactory) -> HeadlineStandins:
    return build_headline_standins(tmp_path_factory.mktemp("headline"))


# --------------------------------------------------------------------------- dimensions


def test_real_dims_are_the_published_configs() -> None:
    assert (KIMI_K2.hidden, KIMI_K2.heads, KIMI_K2.kv_heads, KIMI_K2.head_dim) == \
        (7168, 64, 64, 128)
    assert (KIMI_K2.vocab, KIMI_K2.draft_vocab, KIMI_K2.aux_layers) == \
        (163840, 32000, (2, 30, 58))
    assert KIMI_K2.fc_in == 3 * 7168 and KIMI_K2.dtype == "bfloat16"
    assert (LLAMA31_8B.hidden, LLAMA31_8B.heads, LLAMA31_8B.kv_heads,
            LLAMA31_8B.intermediate, LLAMA31_8B.vocab) == (4096, 32, 8, 14336, 128256)


def test_scaled_dims_keep_the_proportions_that_matter() -> None:
    # Kimi: attention wider than hidden (8192 vs 7168), no GQA, verifier width = hidden.
    assert DIMS.heads * DIMS.head_dim > DIMS.hidden
    assert DIMS.kv_heads == DIMS.heads and DIMS.verifier_hidden == DIMS.hidden
    # Llama: GQA stays GQA with more than one KV head.
    assert 1 < LLAMA31_8B_TINY.kv_heads < LLAMA31_8B_TINY.heads
    for dims in (DIMS, LLAMA31_8B_TINY):
        assert dims.vocab >= 8 * dims.draft_vocab
        assert all(i < dims.verifier_layers for i in dims.aux_layers)
        assert dims.hidden % dims.heads == 0 and dims.intermediate % 32 == 0


def test_scaled_takes_explicit_sizes_for_the_benchmark() -> None:
    big = KIMI_K2.scaled(hidden=2048, head_dim=128, vocab=32000, draft_vocab=8000)
    assert (big.hidden, big.vocab, big.draft_vocab, big.verifier_hidden) == \
        (2048, 32000, 8000, 2048)
    assert big.heads * big.head_dim > big.hidden
    assert KIMI_K2.scaled(heads=4, kv_heads=4).heads == 4


@pytest.mark.parametrize("change, fragment", [
    ({"kv_heads": 3}, "not a multiple of kv_heads=3"),
    ({"draft_vocab": 5000}, "draft_vocab=5000 exceeds vocab=4096"),
    ({"aux_layers": (2, 9)}, "below verifier_layers=8"),
    ({"dtype": "int8"}, "'int8' is not one of"),
])
def test_inconsistent_dims_are_refused(change: dict[str, object], fragment: str) -> None:
    with pytest.raises(UsageError, match=fragment):
        dataclasses.replace(DIMS, **change)


def test_scaled_refuses_unknown_fields() -> None:
    with pytest.raises(UsageError, match="unknown field.*'hiden'"):
        KIMI_K2.scaled(hiden=32)


# ----------------------------------------------------------------------- vocabulary maps


def test_draft_vocab_is_sorted_unique_in_range_and_seeded() -> None:
    ids = make_draft_vocab(4096, 512, seed=3)
    assert len(ids) == 512 and list(ids) == sorted(set(ids))
    assert 0 <= ids[0] and ids[-1] < 4096
    assert ids == make_draft_vocab(4096, 512, seed=3)
    assert ids != make_draft_vocab(4096, 512, seed=4)


# Sorted maps agree by chance where their omissions balance out, a fraction that falls
# like 1/sqrt(draft_vocab): ~8% at 512 tokens, ~1% at 32,000 (real pair: 252 of 32,000).
@pytest.mark.parametrize("vocab, draft, prefix, max_same_position", [
    (4096, 512, 4, 0.2), (163840, 32000, 250, 0.02)])
def test_two_maps_differ_like_the_k2_and_k25_drafters(vocab: int, draft: int, prefix: int,
                                                      max_same_position: float) -> None:
    k2 = make_draft_vocab(vocab, draft, seed=1, shared_prefix=prefix)
    k25 = make_draft_vocab(vocab, draft, seed=2, shared_prefix=prefix)
    assert k2[:prefix] == k25[:prefix] == tuple(range(prefix))
    same_position = sum(a == b for a, b in zip(k2, k25))
    shared = len(set(k2) & set(k25))
    # real pair: 252 of 32,000 positions agree; 25,750 of 32,000 tokens are shared
    assert prefix <= same_position < max_same_position * draft
    assert 0.74 * draft < shared < 0.86 * draft


def test_bad_draft_vocab_arguments_are_refused() -> None:
    with pytest.raises(UsageError, match="draft_vocab=9 must be in"):
        make_draft_vocab(8, 9, seed=0)
    with pytest.raises(UsageError, match="shared_fraction=0 must be in"):
        make_draft_vocab(4096, 512, seed=0, shared_fraction=0)


# ------------------------------------------------------------------------------ drafters


def test_native_drafter_has_exactly_the_documented_tensors(tmp_path: Path) -> None:
    ids = ids_for()
    built = build_eagle3_drafter(tmp_path, DIMS, ids, seed=5)
    tensors = load_file(tmp_path / "model.safetensors")
    assert set(tensors) == NATIVE_KEYS == set(built.keys)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected_shapes(DIMS)
    assert {k: v.dtype for k, v in tensors.items() if k not in ("d2t", "t2d")} == \
        dict.fromkeys(NATIVE_KEYS - {"d2t", "t2d"}, torch.bfloat16)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert built.dtypes["lm_head.weight"] == "BF16" and built.target_ids == ids
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_d2t_is_an_offset_map_consistent_with_t2d(tmp_path: Path) -> None:
    ids = ids_for(seed=7)
    build_eagle3_drafter(tmp_path, DIMS, ids)
    t = load_file(tmp_path / "model.safetensors")
    targets = t["d2t"] + torch.arange(DIMS.draft_vocab)
    assert targets.tolist() == list(ids)
    assert torch.equal(torch.nonzero(t["t2d"]).flatten(), targets)
    assert t["d2t"][0] == 0 and t["d2t"][-1] > 0  # offsets, not absolute ids


def test_absolute_d2t_variant_stores_target_ids(tmp_path: Path) -> None:
    ids = ids_for()
    build_eagle3_drafter(tmp_path, DIMS, ids, d2t_encoding="absolute")
    assert load_file(tmp_path / "model.safetensors")["d2t"].tolist() == list(ids)


def test_weights_look_like_trained_ones(tmp_path: Path) -> None:
    build_eagle3_drafter(tmp_path, DIMS, ids_for())
    t = load_file(tmp_path / "model.safetensors")
    for key in ("norm.weight", "midlayer.hidden_norm.weight"):
        assert (t[key].float() - 1).abs().max() < 0.5
    assert 0.005 < t["lm_head.weight"].float().std() < 0.05
    rows = t["lm_head.weight"]
    assert len({tuple(r.tolist()) for r in rows}) == DIMS.draft_vocab  # rows identifiable


def test_native_config_is_a_llama_eagle3_config(tmp_path: Path) -> None:
    build_eagle3_drafter(tmp_path, DIMS, ids_for())
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    # SpecForge's configs/kimi-k2-eagle3.json says kimi_k2 (its layer is a Llama layer all the same)
    assert config["model_type"] == "kimi_k2" and config["num_hidden_layers"] == 1
    assert (config["hidden_size"], config["vocab_size"], config["draft_vocab_size"]) == \
        (DIMS.hidden, DIMS.vocab, DIMS.draft_vocab)
    assert (config["num_attention_heads"], config["num_key_value_heads"],
            config["head_dim"], config["intermediate_size"]) == \
        (DIMS.heads, DIMS.kv_heads, DIMS.head_dim, DIMS.intermediate)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == \
        list(DIMS.aux_layers)
    assert config["torch_dtype"] == "bfloat16"


def test_speculators_layout_renames_midlayer_and_keeps_values(tmp_path: Path) -> None:
    ids = ids_for()
    build_eagle3_drafter(tmp_path / "n", DIMS, ids, seed=9)
    built = build_eagle3_drafter(tmp_path / "s", DIMS, ids, seed=9, layout="speculators",
                                 verifier_name="moonshotai/Kimi-K2.5")
    native = load_file(tmp_path / "n/model.safetensors")
    spec = load_file(tmp_path / "s/model.safetensors")
    assert set(spec) == set(expected_shapes(DIMS, "layers.0.")) == set(built.keys)
    for key, value in native.items():
        assert torch.equal(spec[key.replace("midlayer.", "layers.0.")], value), key
    config = json.loads((tmp_path / "s/config.json").read_text())
    assert config["architectures"] == ["Eagle3Speculator"]
    assert config["speculators_model_type"] == "eagle3"
    assert config["draft_vocab_size"] == DIMS.draft_vocab
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["vocab_size"] == DIMS.vocab
    assert layer["num_hidden_layers"] == 1 and layer["hidden_size"] == DIMS.hidden
    sc = config["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"][0]["proposal_type"] == "greedy"
    assert sc["verifier"] == {"name_or_path": "moonshotai/Kimi-K2.5",
                              "architectures": ["KimiK25ForConditionalGeneration"]}


def test_embed_omit_and_dtype_overrides_make_variants(tmp_path: Path) -> None:
    built = build_eagle3_drafter(tmp_path, DIMS, ids_for(), include_embed=True,
                                 omit_keys=["t2d", "midlayer.hidden_norm.weight"],
                                 dtype_overrides={"fc.weight": "float32"})
    t = load_file(tmp_path / "model.safetensors")
    assert set(t) == set(built.keys) == \
        NATIVE_KEYS - {"t2d", "midlayer.hidden_norm.weight"} | {"embed_tokens.weight"}
    assert tuple(t["embed_tokens.weight"].shape) == (DIMS.vocab, DIMS.hidden)
    assert t["fc.weight"].dtype == torch.float32 and built.dtypes["fc.weight"] == "F32"


def test_omitting_an_unknown_key_names_it(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="'lm_head' not in this drafter"):
        build_eagle3_drafter(tmp_path, DIMS, ids_for(), omit_keys=["lm_head"])


def test_target_ids_of_the_wrong_length_or_order_are_refused(tmp_path: Path) -> None:
    ids = ids_for()
    with pytest.raises(UsageError, match="511 ids given for draft_vocab=512"):
        build_eagle3_drafter(tmp_path, DIMS, ids[:-1])
    with pytest.raises(UsageError, match="strictly ascending"):
        build_eagle3_drafter(tmp_path, DIMS, ids[::-1])


def test_bin_drafter_loads_with_weights_only_and_matches_safetensors(tmp_path: Path) -> None:
    ids = ids_for()
    build_eagle3_drafter(tmp_path / "st", DIMS, ids, seed=2)
    built = build_eagle3_drafter(tmp_path / "bin", DIMS, ids, seed=2, fmt="bin")
    assert built.files == ("config.json", "pytorch_model.bin")
    state = torch.load(tmp_path / "bin/pytorch_model.bin", weights_only=True)
    reference = load_file(tmp_path / "st/model.safetensors")
    assert state.keys() == reference.keys()
    assert all(torch.equal(state[k], reference[k]) for k in state)
    assert zipfile.ZipFile(tmp_path / "bin/pytorch_model.bin").testzip() is None


def test_full_vocab_drafter_has_no_vocab_map(tmp_path: Path) -> None:
    built = build_full_vocab_drafter(tmp_path, DIMS)
    t = load_file(tmp_path / "model.safetensors")
    assert set(t) == NATIVE_KEYS - {"d2t", "t2d"} == set(built.keys)
    assert tuple(t["lm_head.weight"].shape) == (DIMS.vocab, DIMS.hidden)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "draft_vocab_size" not in config and config["vocab_size"] == DIMS.vocab
    assert built.target_ids is None


def test_llama_drafter_is_a_float16_gqa_pickle(tmp_path: Path) -> None:
    built = build_llama_eagle3(tmp_path)
    state = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    dims = LLAMA31_8B_TINY
    assert {k: tuple(v.shape) for k, v in state.items()} == expected_shapes(dims)
    assert state["midlayer.self_attn.k_proj.weight"].shape[0] < \
        state["midlayer.self_attn.q_proj.weight"].shape[0]
    assert state["lm_head.weight"].dtype == torch.float16
    targets = state["d2t"] + torch.arange(dims.draft_vocab)
    assert torch.equal(torch.nonzero(state["t2d"]).flatten(), targets)
    assert built.target_ids == tuple(targets.tolist())
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["vocab_size"] == dims.vocab and config["torch_dtype"] == "float16"


# ----------------------------------------------------------------------------- verifier


def test_verifier_index_is_laid_out_like_kimi_k25(tmp_path: Path) -> None:
    built = build_kimi_k25_verifier(tmp_path, DIMS)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert shards == [f"model-{i:05d}-of-00064.safetensors" for i in range(1, 65)]
    # as in moonshotai/Kimi-K2.5: lm_head and the embeddings together in shard 62 of 64
    assert weight_map["language_model.lm_head.weight"] == shards[61]
    assert weight_map["language_model.model.embed_tokens.weight"] == shards[61]
    vision = [k for k in weight_map if k.startswith(("vision_tower.", "mm_projector."))]
    assert vision and {weight_map[k] for k in vision} == set(shards[62:])
    layers = {weight_map[k] for k in weight_map if k.startswith("language_model.model.layers.")}
    assert layers == set(shards[:61])
    total = 0
    for shard in shards:
        with safe_open(tmp_path / shard, "pt") as f:
            assert set(f.keys()) == {k for k, v in weight_map.items() if v == shard}
            for key in f.keys():
                t = f.get_tensor(key)
                total += t.numel() * t.element_size()
                assert tuple(t.shape) == built.shapes[key]
    assert index["metadata"]["total_size"] == total
    assert set(built.keys) == set(weight_map)


def test_verifier_routed_experts_are_int4_as_its_quantization_config_says(tmp_path: Path) -> None:
    build_kimi_k25_verifier(tmp_path, DIMS, num_shards=4)
    config = json.loads((tmp_path / "config.json").read_text())
    quant = config["text_config"]["quantization_config"]
    weights = quant["config_groups"]["group_0"]["weights"]
    assert (quant["quant_method"], quant["format"]) == ("compressed-tensors", "pack-quantized")
    assert (weights["num_bits"], weights["type"], weights["symmetric"], weights["strategy"]) == \
        (4, "int", True, "group")
    group = weights["group_size"]
    assert DIMS.verifier_hidden % group == 0 and group in (16, 32)  # 112 columns: 16
    dtypes = {}
    for shard in {p.name for p in tmp_path.glob("model-*.safetensors")}:
        with safe_open(tmp_path / shard, "pt") as f:
            dtypes.update({k: f.get_slice(k).get_dtype() for k in f.keys()})
    packed = [k for k in dtypes if k.endswith(".weight_packed")]
    assert packed and all(".mlp.experts." in k for k in packed)
    for key in packed:
        module = key.removesuffix(".weight_packed")
        assert (dtypes[key], dtypes[f"{module}.weight_scale"], dtypes[f"{module}.weight_shape"]) == \
            ("I32", "BF16", "I32")
        assert f"{module}.weight" not in dtypes
    plain = [k for k in dtypes if k.endswith(".weight")]
    assert any(".self_attn." in k for k in plain) and any(".shared_experts." in k for k in plain)
    assert all(dtypes[k] == "BF16" for k in plain)
    bias = [k for k in dtypes if k.endswith("e_score_correction_bias")]
    assert bias and all(dtypes[k] == "F32" for k in bias)


def test_verifier_text_weights_have_the_vocab_and_hidden_size(tmp_path: Path) -> None:
    build_kimi_k25_verifier(tmp_path, DIMS, num_shards=3)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    lm_shard = tmp_path / weight_map["language_model.lm_head.weight"]
    with safe_open(lm_shard, "pt") as f:
        lm_head = f.get_tensor("language_model.lm_head.weight")
    size = lm_shard.stat().st_size
    assert tuple(lm_head.shape) == (DIMS.vocab, DIMS.verifier_hidden)
    assert lm_head.dtype == torch.bfloat16
    # the rows a conversion needs (~20% of the draft vocab) are a sliver of the shard
    assert 0.2 * DIMS.draft_vocab * DIMS.verifier_hidden * 2 < size / 20
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert config["model_type"] == "kimi_k25"
    assert (config["text_config"]["hidden_size"], config["text_config"]["vocab_size"]) == \
        (DIMS.verifier_hidden, DIMS.vocab)


@pytest.mark.parametrize("num_shards, lm_shard", [(1, 1), (2, 1), (3, 2)])
def test_verifier_with_few_shards_still_has_an_index(tmp_path: Path, num_shards: int,
                                                     lm_shard: int) -> None:
    build_kimi_k25_verifier(tmp_path, DIMS, num_shards=num_shards)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())[
        "weight_map"]
    name = f"model-{lm_shard:05d}-of-{num_shards:05d}.safetensors"
    assert weight_map["language_model.lm_head.weight"] == name
    assert len(set(weight_map.values())) == num_shards


# ----------------------------------------------------------------------------- headline


def test_headline_standins_are_the_three_sources(headline: HeadlineStandins) -> None:
    assert {name: Path(p).name for name, p in headline.sources.items()} == {
        "drafter": "Kimi-K2-Instruct-eagle3", "target_vocab": "Kimi-K25-eagle3",
        "verifier": "Kimi-K2.5"}
    assert (headline.drafter.path / "training_state.pt").is_file()
    assert not (headline.target_vocab.path / "training_state.pt").exists()
    assert "embed_tokens.weight" not in headline.target_vocab.keys
    for built, ids in ((headline.drafter, headline.k2_ids),
                       (headline.target_vocab, headline.k25_ids)):
        t = load_file(built.path / "model.safetensors")
        assert (t["d2t"] + torch.arange(len(ids))).tolist() == list(ids)
    assert headline.verifier.shapes["language_model.lm_head.weight"][1] == \
        headline.drafter.shapes["lm_head.weight"][1]
    shared = len(set(headline.k2_ids) & set(headline.k25_ids))
    assert 0.7 * DIMS.draft_vocab < shared < 0.9 * DIMS.draft_vocab


def test_headline_drafters_have_different_weights(headline: HeadlineStandins) -> None:
    k2 = load_file(headline.drafter.path / "model.safetensors")
    k25 = load_file(headline.target_vocab.path / "model.safetensors")
    assert not torch.equal(k2["lm_head.weight"], k25["lm_head.weight"])


def test_headline_refuses_a_verifier_of_another_width(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=f"verifier_hidden=128 != hidden={DIMS.hidden}"):
        build_headline_standins(tmp_path, dims=dataclasses.replace(DIMS, verifier_hidden=128))


def test_same_seed_gives_byte_identical_files(tmp_path: Path,
                                              headline: HeadlineStandins) -> None:
    again = build_headline_standins(tmp_path / "again")
    assert digest(again.root) == digest(headline.root)
    build_llama_eagle3(tmp_path / "l1")
    build_llama_eagle3(tmp_path / "l2")
    assert digest(tmp_path / "l1") == digest(tmp_path / "l2")
    build_llama_eagle3(tmp_path / "l3", seed=1)
    assert digest(tmp_path / "l3") != digest(tmp_path / "l1")
