"""Tests for ckptxform.vocab: decoding d2t/t2d, every consistency error, wrong-encoding
detection, alignment between two maps, and standalone vocab files."""

from __future__ import annotations

import json
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from ckptxform.errors import (
    CheckpointFormatError,
    SourceNotFoundError,
    UsageError,
    VocabMapError,
)
from ckptxform.sources.vocab_files import load_vocab_file
from ckptxform.vocab.maps import Alignment, VocabMap, vocab_map_from_bytes

# Small stand-ins of real maps: a 2,000-token verifier vocabulary, a 300-token draft
# vocabulary, sorted ascending, sharing the first 40 (special and byte) tokens like the
# Kimi-K2 and K2.5 drafters do.
VOCAB = 2000
DRAFT = 300
SPECIAL = 40
ORIGIN = "source 'drafter' tensor 'd2t'"


def sorted_map(seed: int) -> list[int]:
    rng = random.Random(seed)
    return sorted(set(range(SPECIAL)) | set(rng.sample(range(SPECIAL, VOCAB), DRAFT - SPECIAL)))


def offsets(targets: list[int]) -> list[int]:
    return [t - i for i, t in enumerate(targets)]


def t2d_of(targets: list[int], vocab: int = VOCAB) -> bytes:
    flags = bytearray(vocab)
    for t in targets:
        flags[t] = 1
    return bytes(flags)


def message(excinfo: pytest.ExceptionInfo[BaseException]) -> str:
    return str(excinfo.value)


K2 = sorted_map(1)
K25 = sorted_map(2)


# ---------------------------------------------------------------- decoding and round trips


def test_offset_d2t_decodes_to_index_plus_offset() -> None:
    m = VocabMap.from_d2t("k2", offsets(K2), encoding="offset", t2d=t2d_of(K2), origin=ORIGIN)
    assert m.target_ids == tuple(K2)
    assert m.vocab_size == VOCAB
    assert m.draft_size == DRAFT
    assert m.d2t_offsets() == offsets(K2)
    # The shared special-token prefix gives the zero offsets real maps start with.
    assert m.d2t_offsets()[:SPECIAL] == [0] * SPECIAL


def test_absolute_d2t_decodes_to_itself() -> None:
    m = VocabMap.from_d2t("k2", K2, encoding="absolute", vocab_size=VOCAB)
    assert m.target_ids == tuple(K2)
    assert m.d2t_offsets() == offsets(K2)


def test_vocab_size_comes_from_t2d_then_argument_then_largest_id() -> None:
    assert (
        VocabMap.from_d2t("a", [0, 0, 3], encoding="offset", t2d=t2d_of([0, 1, 5], 9)).vocab_size
        == 9
    )
    assert VocabMap.from_d2t("a", [0, 0, 3], encoding="offset", vocab_size=7).vocab_size == 7
    assert VocabMap.from_d2t("a", [0, 0, 3], encoding="offset").vocab_size == 6


def test_bytes_are_what_safetensors_and_torch_read(tmp_path: Path) -> None:
    m = VocabMap.from_d2t("k25", offsets(K25), encoding="offset", vocab_size=VOCAB)
    # Write the bytes as safetensors I64/BOOL tensors by hand, read them with the real library.
    tensors = {"d2t": ("I64", [DRAFT], m.d2t_bytes()), "t2d": ("BOOL", [VOCAB], m.t2d_bytes())}
    path = tmp_path / "vocab.safetensors"
    write_safetensors(path, tensors)
    loaded = load_file(path)
    assert loaded["d2t"].dtype == torch.int64 and loaded["t2d"].dtype == torch.bool
    targets = loaded["d2t"] + torch.arange(DRAFT)
    assert targets.tolist() == K25
    # SpecForge's consistency rule: nonzero(t2d) == d2t + arange(draft_vocab).
    assert torch.equal(loaded["t2d"].nonzero().flatten(), targets)
    absolute = torch.frombuffer(bytearray(m.d2t_bytes("absolute")), dtype=torch.int64)
    assert absolute.tolist() == K25


def test_from_bytes_round_trips_both_encodings_and_dtypes() -> None:
    m = VocabMap.from_d2t("k2", offsets(K2), encoding="offset", vocab_size=VOCAB)
    again = vocab_map_from_bytes(
        "k2", m.d2t_bytes(), "I64", m.t2d_bytes(), "BOOL", encoding="offset"
    )
    assert again == m
    as_absolute = vocab_map_from_bytes(
        "k2", m.d2t_bytes("absolute"), "I64", encoding="absolute", vocab_size=VOCAB
    )
    assert as_absolute == m
    i32 = torch.tensor(offsets(K2), dtype=torch.int32)
    u8 = torch.tensor(list(m.t2d_bytes()), dtype=torch.uint8)
    from_i32 = vocab_map_from_bytes(
        "k2",
        memoryview(i32.numpy().tobytes()),
        "I32",
        u8.numpy().tobytes(),
        "U8",
        encoding="offset",
    )
    assert from_i32 == m


def test_direct_construction_checks_ids() -> None:
    assert VocabMap("a", (3, 1), 4).target_ids == (3, 1)  # unsorted is a valid map
    with pytest.raises(VocabMapError) as e:
        VocabMap("a", (3, 1, 3), 4)
    assert message(e) == (
        "vocab map 'a': draft indices 0 and 2 both map to target id 3 (d2t[0] = 3, d2t[2] = 3, "
        "encoding 'absolute'); fix: a draft vocabulary lists each target token once: rebuild "
        "d2t or correct the encoding"
    )
    with pytest.raises(VocabMapError) as e:
        VocabMap("a", (), 4)
    assert (
        message(e)
        == "vocab map 'a': the draft vocabulary is empty; fix: give at least one target id"
    )


def test_module_does_not_import_torch() -> None:
    code = (
        "import sys; from ckptxform.vocab.maps import vocab_map_from_bytes;"
        "m = vocab_map_from_bytes('a', bytes(16), 'I64', b'\\x01\\x01', 'BOOL', encoding='offset');"
        "m.alignment_to(m); m.d2t_bytes(); assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------- consistency errors (golden)


def raises(**kwargs: object) -> str:
    kwargs.setdefault("origin", ORIGIN)
    d2t = kwargs.pop("d2t")
    with pytest.raises(VocabMapError) as e:
        VocabMap.from_d2t("k2", d2t, **kwargs)  # type: ignore[arg-type]
    return message(e)


P = f"vocab map 'k2' ({ORIGIN})"


def test_target_out_of_range() -> None:
    # As absolute ids the zeros would repeat, so neither decoding is valid: a plain range error.
    assert raises(d2t=[0, 0, 0, 5, 1997], encoding="offset", vocab_size=VOCAB) == (
        f"{P}: draft index 4 maps to target id 2001 (d2t[4] = 1997, encoding 'offset'), "
        "outside [0, 2000); fix: set vocab_size to the verifier's vocabulary size or correct "
        "the encoding ('offset': target = index + d2t[index]; 'absolute': target = d2t[index])"
    )


def test_negative_target_without_vocab_size() -> None:
    assert raises(d2t=[0, 0, -5], encoding="offset") == (
        f"{P}: draft index 2 maps to target id -3 (d2t[2] = -5, encoding 'offset'), a negative "
        "id; fix: set vocab_size to the verifier's vocabulary size or correct the encoding "
        "('offset': target = index + d2t[index]; 'absolute': target = d2t[index])"
    )


def test_duplicate_targets_name_both_draft_indices() -> None:
    assert raises(d2t=[0, 0, -1, 0], encoding="offset", vocab_size=10) == (
        f"{P}: draft indices 1 and 2 both map to target id 1 (d2t[1] = 0, d2t[2] = -1, "
        "encoding 'offset'); fix: a draft vocabulary lists each target token once: rebuild "
        "d2t or correct the encoding"
    )


def test_t2d_length_differs_from_vocab_size() -> None:
    assert raises(d2t=offsets(K2), encoding="offset", vocab_size=VOCAB + 1, t2d=t2d_of(K2)) == (
        f"{P}: t2d has 2000 entries but vocab_size is 2001; fix: t2d is indexed by target id, "
        "so both must be the verifier's vocabulary size: correct vocab_size or use this map's "
        "own t2d"
    )


def test_t2d_disagreeing_with_d2t_lists_both_sides() -> None:
    wrong = bytearray(t2d_of(K2))
    unmarked = [K2[SPECIAL], K2[SPECIAL + 1]]
    extra = [t for t in range(VOCAB) if t not in set(K2)][:7]
    for t in unmarked:
        wrong[t] = 0
    for t in extra:
        wrong[t] = 1
    assert raises(d2t=offsets(K2), encoding="offset", t2d=bytes(wrong)) == (
        f"{P}: t2d disagrees with d2t (encoding 'offset') on 9 target ids: t2d marks 7 that "
        f"d2t does not map to (first: {', '.join(map(str, extra[:5]))}) and d2t maps 2 that "
        f"t2d does not mark (first: {unmarked[0]} at draft index {SPECIAL}, {unmarked[1]} at "
        f"draft index {SPECIAL + 1}); fix: take d2t and t2d from the same checkpoint, or drop "
        "t2d and let it be rebuilt from d2t"
    )


def test_t2d_marking_more_than_d2t_maps() -> None:
    assert raises(d2t=[0, 0, 3], encoding="offset", t2d=[1, 1, 1, 0, 0, 1, 0, 1]) == (
        f"{P}: t2d disagrees with d2t (encoding 'offset') on 2 target ids: t2d marks 2 that "
        "d2t does not map to (first: 2, 7); fix: take d2t and t2d from the same checkpoint, "
        "or drop t2d and let it be rebuilt from d2t"
    )


def test_draft_vocab_larger_than_vocab() -> None:
    assert raises(d2t=[0, 0, 0, 0, 0], encoding="offset", vocab_size=4) == (
        f"{P}: the draft vocabulary has 5 entries but the target vocabulary only 4; fix: a "
        "draft vocabulary is a subset of the verifier's: check vocab_size (and that t2d "
        "belongs to this map)"
    )


def test_empty_d2t() -> None:
    assert raises(d2t=[], encoding="offset") == (
        f"{P}: d2t is empty; fix: point the map at the drafter's d2t tensor (shape [draft_vocab])"
    )


def test_non_integer_d2t_and_non_flag_t2d() -> None:
    assert raises(d2t=[0, 1.5], encoding="offset") == (
        f"{P}: d2t[1] is 1.5, not an integer; fix: d2t must be an integer tensor (int64)"
    )
    flag_fix = (
        "not a flag (0/1, False/True); fix: t2d must be a bool tensor with one entry per target id"
    )
    assert (
        raises(d2t=[0], encoding="offset", t2d=b"\x01\x00\x02") == f"{P}: t2d[2] is 2, {flag_fix}"
    )
    assert raises(d2t=[0], encoding="offset", t2d=[True, 0.5]) == f"{P}: t2d[1] is 0.5, {flag_fix}"
    assert raises(d2t=None, encoding="offset") == (
        f"{P}: d2t is of type 'NoneType', not a sequence of integers; fix: d2t must be an integer "
        "tensor (int64)"
    )
    assert raises(d2t=[0], encoding="offset", t2d=7) == (
        f"{P}: t2d is of type 'int', not a sequence of flags; fix: t2d must be a bool tensor "
        "with one entry per target id"
    )


def test_unknown_encoding_is_a_usage_error() -> None:
    with pytest.raises(UsageError) as e:
        VocabMap.from_d2t("k2", [0], encoding="relative")  # type: ignore[arg-type]
    assert message(e) == "unknown d2t encoding 'relative'; fix: use 'offset' or 'absolute'"


def test_raw_bytes_with_wrong_dtype_or_length() -> None:
    with pytest.raises(VocabMapError) as e:
        vocab_map_from_bytes("k2", bytes(8), "F32", encoding="offset", origin=ORIGIN)
    assert message(e) == (
        f"{P}: d2t has dtype 'F32'; fix: d2t must be an integer tensor ('I64', or 'I32'): "
        "point the map at the drafter's d2t"
    )
    with pytest.raises(VocabMapError) as e:
        vocab_map_from_bytes("k2", bytes(12), "I64", encoding="offset", origin=ORIGIN)
    assert message(e) == (
        f"{P}: d2t holds 12 bytes, not a multiple of 8 (I64); fix: the file is truncated or "
        "its header lies: re-download it"
    )
    with pytest.raises(VocabMapError) as e:
        vocab_map_from_bytes(
            "k2", bytes(8), "I64", bytes(16), "I64", encoding="offset", origin=ORIGIN
        )
    assert message(e) == (
        f"{P}: t2d has dtype 'I64'; fix: t2d must be 'BOOL' (or 'U8'), one flag per target id"
    )


# ---------------------------------------------------------------- wrong declared encoding


def test_offsets_declared_absolute_with_t2d() -> None:
    assert raises(d2t=[0, 0, 3], encoding="absolute", t2d=t2d_of([0, 1, 5], 8)) == (
        f"{P}: declared 'absolute' but the values decode consistently as 'offset': read as "
        "'absolute', draft indices 0 and 1 both map to target id 0 (d2t[0] = 0, d2t[1] = 0, "
        "encoding 'absolute'), while read as 'offset' all 3 target ids agree with t2d; fix: "
        "set encoding: offset"
    )


def test_absolute_declared_offset_with_t2d() -> None:
    # Strictly increasing, distinct, in range as offsets too: only t2d can tell.
    assert raises(d2t=[0, 2, 4], encoding="offset", t2d=t2d_of([0, 2, 4], 8)) == (
        f"{P}: declared 'offset' but the values decode consistently as 'absolute': read as "
        "'offset', draft index 1 maps to target id 3 (d2t[1] = 2, encoding 'offset'), which "
        "t2d does not mark, while read as 'absolute' all 3 target ids agree with t2d; fix: "
        "set encoding: absolute"
    )


def test_offsets_declared_absolute_without_t2d() -> None:
    assert raises(d2t=[0, 0, 3], encoding="absolute", vocab_size=8) == (
        f"{P}: declared 'absolute' but the values decode consistently as 'offset': read as "
        "'absolute', draft indices 0 and 1 both map to target id 0 (d2t[0] = 0, d2t[1] = 0, "
        "encoding 'absolute'), while read as 'offset' they are 3 distinct ascending target ids "
        "in [0, 8); fix: set encoding: offset"
    )


def test_absolute_declared_offset_without_t2d() -> None:
    assert raises(d2t=[1, 5, 7], encoding="offset", vocab_size=8) == (
        f"{P}: declared 'offset' but the values decode consistently as 'absolute': read as "
        "'offset', draft index 2 maps to target id 9 (d2t[2] = 7, encoding 'offset'), outside "
        "[0, 8), while read as 'absolute' they are 3 distinct ascending target ids in [0, 8); "
        "fix: set encoding: absolute"
    )


def test_duplicates_are_not_blamed_on_the_encoding_when_the_other_is_unsorted() -> None:
    # As offsets 2, 2, 7 (duplicate); as absolute 2, 1, 5: valid but not ascending, so no
    # evidence that the declaration is wrong.
    assert raises(d2t=[2, 1, 5], encoding="offset", vocab_size=10) == (
        f"{P}: draft indices 0 and 1 both map to target id 2 (d2t[0] = 2, d2t[1] = 1, "
        "encoding 'offset'); fix: a draft vocabulary lists each target token once: rebuild "
        "d2t or correct the encoding"
    )
    # As absolute 3, 3, 0 (duplicate); as offsets 3, 4, 2: valid, not ascending.
    assert raises(d2t=[3, 3, 0], encoding="absolute").startswith(
        f"{P}: draft indices 0 and 1 both map to target id 3"
    )


@pytest.mark.parametrize("with_t2d", [True, False])
def test_wrong_encoding_caught_on_realistic_maps(with_t2d: bool) -> None:
    extra = {"t2d": t2d_of(K2)} if with_t2d else {"vocab_size": VOCAB}
    with pytest.raises(VocabMapError, match="declared 'absolute' but .* set encoding: offset$"):
        VocabMap.from_d2t("k2", offsets(K2), encoding="absolute", **extra)
    with pytest.raises(VocabMapError, match="declared 'offset' but .* set encoding: absolute$"):
        VocabMap.from_d2t("k2", K2, encoding="offset", **extra)


def test_offsets_declared_absolute_caught_even_without_any_size() -> None:
    # The shared special-token prefix makes offsets repeat: duplicates as absolute ids.
    with pytest.raises(VocabMapError, match="set encoding: offset$"):
        VocabMap.from_d2t("k2", offsets(K2), encoding="absolute")


def test_ambiguous_values_keep_the_declared_encoding() -> None:
    # No two targets adjacent and no vocab_size/t2d: both decodings are valid ascending maps.
    assert VocabMap.from_d2t("a", [0, 2, 4], encoding="offset").target_ids == (0, 3, 6)
    assert VocabMap.from_d2t("a", [0, 2, 4], encoding="absolute").target_ids == (0, 2, 4)


def test_unsorted_valid_map_is_accepted_when_the_other_decoding_is_invalid() -> None:
    shuffled = K2[:]
    random.Random(3).shuffle(shuffled)
    m = VocabMap.from_d2t("x", shuffled, encoding="absolute", vocab_size=VOCAB)
    assert m.target_ids == tuple(shuffled)
    assert VocabMap.from_d2t("x", m.d2t_offsets(), encoding="offset", t2d=m.t2d_bytes()) == m


# ---------------------------------------------------------------- alignment


def brute_force(source: list[int], target: list[int]) -> list[int]:
    return [source.index(t) if t in source else -1 for t in target]


def test_alignment_matches_brute_force_on_realistic_maps() -> None:
    a = VocabMap.from_d2t("k2", offsets(K2), encoding="offset", vocab_size=VOCAB)
    b = VocabMap.from_d2t("k25", offsets(K25), encoding="offset", vocab_size=VOCAB)
    al = a.alignment_to(b)
    expected = brute_force(K2, K25)
    assert list(al.source_index) == expected
    shared = len(set(K2) & set(K25))
    assert al.shared == shared
    assert al.positional_matches == sum(1 for i, t in enumerate(K25) if K2[i] == t)
    assert al.positional_matches >= SPECIAL  # the shared prefix agrees position by position
    assert al.only_in_source == len(set(K2) - set(K25))
    assert al.only_in_target == len(set(K25) - set(K2))
    assert al.carried_fraction == shared / DRAFT
    assert al.missing_indices == tuple(j for j, i in enumerate(expected) if i == -1)
    assert json.loads(json.dumps(al.to_dict())) == al.to_dict()
    assert "source_index" not in al.to_dict()
    assert al.to_dict(include_index=True)["source_index"] == expected


def test_alignment_summary_and_dict() -> None:
    a = VocabMap("k2", tuple(range(1200)), 5000)
    b = VocabMap("k25", tuple(range(3)) + tuple(range(1000, 2197)), 5000)
    al = a.alignment_to(b)
    assert al.summary() == (
        "3/1,200 positions agree; 203 tokens shared; 997 only in k2; 997 only in k25"
    )
    assert al.to_dict() == {
        "source": "k2",
        "target": "k25",
        "source_draft_size": 1200,
        "target_draft_size": 1200,
        "positional_matches": 3,
        "shared": 203,
        "only_in_source": 997,
        "only_in_target": 997,
        "carried_fraction": 203 / 1200,
    }


def test_alignment_of_different_vocabularies_is_refused() -> None:
    with pytest.raises(VocabMapError) as e:
        VocabMap("k2", (0, 1), 10).alignment_to(VocabMap("llama", (0, 1), 12))
    assert message(e) == (
        "cannot align vocab map 'k2' (vocab_size 10) with 'llama' (vocab_size 12): target ids "
        "of different vocabularies mean different tokens; fix: give both maps the verifier's "
        "vocabulary size, or compare drafters of the same verifier family"
    )


@settings(max_examples=150, deadline=None)
@given(
    vocab=st.integers(1, 60),
    data=st.data(),
)
def test_alignment_properties(vocab: int, data: st.DataObject) -> None:
    ids = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=vocab, unique=True)
    src, dst = data.draw(ids), data.draw(ids)
    if data.draw(st.booleans()):
        src, dst = sorted(src), sorted(dst)
    a, b = VocabMap("a", tuple(src), vocab), VocabMap("b", tuple(dst), vocab)
    al = a.alignment_to(b)
    assert al.shared + al.only_in_source == a.draft_size
    assert al.shared + al.only_in_target == b.draft_size
    assert list(al.source_index) == brute_force(src, dst)
    for j, i in enumerate(al.source_index):
        assert (a.target_ids[i] == b.target_ids[j]) if i >= 0 else b.target_ids[j] not in src
    assert al.positional_matches == sum(1 for j, i in enumerate(al.source_index) if i == j)
    assert a.alignment_to(a).positional_matches == a.draft_size


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 199), min_size=2, max_size=120, unique=True).map(sorted))
def test_sorted_maps_round_trip_and_reject_the_wrong_encoding(targets: list[int]) -> None:
    m = VocabMap("m", tuple(targets), 200)
    assert (
        vocab_map_from_bytes("m", m.d2t_bytes(), "I64", m.t2d_bytes(), "BOOL", encoding="offset")
        == m
    )
    absolute = m.d2t_bytes("absolute")
    assert (
        vocab_map_from_bytes("m", absolute, "I64", m.t2d_bytes(), "BOOL", encoding="absolute") == m
    )
    # With t2d, the other decoding never agrees for two or more entries.
    with pytest.raises(VocabMapError, match="set encoding: offset$"):
        vocab_map_from_bytes("m", m.d2t_bytes(), "I64", m.t2d_bytes(), "BOOL", encoding="absolute")
    with pytest.raises(VocabMapError, match="set encoding: absolute$"):
        vocab_map_from_bytes("m", absolute, "I64", m.t2d_bytes(), "BOOL", encoding="offset")


# ---------------------------------------------------------------- vocab files


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    header: dict[str, object] = {}
    blobs, at = [], 0
    for key, (dtype, shape, blob) in tensors.items():
        header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(blob)]}
        blobs.append(blob)
        at += len(blob)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def k2_tensors() -> dict[str, torch.Tensor]:
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[torch.tensor(K2)] = True
    return {"d2t": torch.tensor(K2) - torch.arange(DRAFT), "t2d": t2d}


def test_load_safetensors_vocab_file_reads_only_the_maps(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    # A whole drafter file works as a vocab file: other tensors are not decoded.
    save_file({**k2_tensors(), "lm_head.weight": torch.zeros(DRAFT, 8, dtype=torch.bfloat16)}, path)
    m = load_vocab_file(path, name="k2", encoding="offset")
    assert m.target_ids == tuple(K2) and m.vocab_size == VOCAB
    assert m.origin == f"file '{path}'"
    save_file({"d2t": k2_tensors()["d2t"]}, path)
    assert load_vocab_file(path, name="k2", encoding="offset", vocab_size=VOCAB).vocab_size == VOCAB


def test_load_specforge_pt_and_bare_tensor(tmp_path: Path) -> None:
    path = tmp_path / "vocab_mapping.pt"
    torch.save(k2_tensors(), path)
    assert load_vocab_file(path, name="k2", encoding="offset").target_ids == tuple(K2)
    torch.save(k2_tensors()["d2t"].to(torch.int32), path)
    m = load_vocab_file(path, name="k2", encoding="offset", vocab_size=VOCAB)
    assert m.target_ids == tuple(K2) and m.vocab_size == VOCAB


def test_load_json_list_and_dict(tmp_path: Path) -> None:
    path = tmp_path / "vocab.json"
    path.write_text(json.dumps(offsets(K2)))
    assert load_vocab_file(
        path, name="k2", encoding="offset", vocab_size=VOCAB
    ).target_ids == tuple(K2)
    path.write_text(json.dumps({"d2t": K2, "t2d": [t in set(K2) for t in range(VOCAB)]}))
    m = load_vocab_file(path, name="k2", encoding="absolute")
    assert m.target_ids == tuple(K2) and m.vocab_size == VOCAB


def test_vocab_file_declared_with_the_wrong_encoding(tmp_path: Path) -> None:
    path = tmp_path / "vocab_mapping.pt"
    torch.save(k2_tensors(), path)
    with pytest.raises(VocabMapError) as e:
        load_vocab_file(path, name="k25", encoding="absolute")
    assert message(e).startswith(
        f"vocab map 'k25' (file '{path}'): declared 'absolute' but the values decode "
        "consistently as 'offset'"
    )


def file_error(error: type[Exception], path: Path) -> str:
    with pytest.raises(error) as e:
        load_vocab_file(path, name="k2", encoding="offset")
    return message(e)


def test_vocab_file_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope.pt"
    assert (
        file_error(SourceNotFoundError, missing)
        == f"vocab file '{missing}' does not exist; fix: check the path"
    )

    txt = tmp_path / "vocab.txt"
    txt.write_text("0 0 3")
    assert file_error(UsageError, txt) == (
        f"vocab file '{txt}': unsupported file type '.txt'; fix: give a .safetensors, .pt, "
        ".pth, .bin, .npy or .json file holding d2t"
    )


def test_safetensors_vocab_file_errors(tmp_path: Path) -> None:
    path = tmp_path / "v.safetensors"
    save_file({"lm_head.weight": torch.zeros(2, 2), "t2d": k2_tensors()["t2d"]}, path)
    assert file_error(VocabMapError, path) == (
        f"vocab file '{path}' has no tensor 'd2t' (has: 'lm_head.weight', 't2d'); fix: give a "
        "file holding the drafter's d2t"
    )

    save_file({"d2t": k2_tensors()["d2t"].reshape(1, DRAFT)}, path)
    assert file_error(VocabMapError, path) == (
        f"vocab file '{path}': tensor 'd2t' has shape [1, 300]; fix: d2t must be "
        "one-dimensional, [draft_vocab]"
    )

    save_file(k2_tensors(), path)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(
        CheckpointFormatError, match=r"tensor 't2d': data_offsets \[\d+, \d+\] run past the end"
    ):
        load_vocab_file(path, name="k2", encoding="offset")

    # the header goes through the project's one strict safetensors parser
    write_safetensors(path, {"d2t": ("I64", [DRAFT], bytes(8 * DRAFT - 8))})
    assert file_error(CheckpointFormatError, path) == (
        f"vocab file '{path}': tensor 'd2t': data_offsets [0, 2392] span 2392 bytes but dtype I64 "
        "with shape [300] needs 2400"
    )

    path.write_bytes(b"\xff" * 16)
    assert file_error(CheckpointFormatError, path) == (
        f"vocab file '{path}': header length 18446744073709551615 exceeds the 100000000-byte limit "
        "of safetensors; the file is corrupt or not safetensors"
    )

    path.write_bytes(struct.pack("<Q", 4) + b"[1 }")
    with pytest.raises(CheckpointFormatError, match="header is not valid JSON"):
        load_vocab_file(path, name="k2", encoding="offset")


class NotATensor:
    pass


def test_torch_vocab_file_errors(tmp_path: Path) -> None:
    path = tmp_path / "vocab_mapping.pt"
    torch.save({"t2d": k2_tensors()["t2d"], "step": 3}, path)
    assert file_error(VocabMapError, path) == (
        f"vocab file '{path}' holds no tensor 'd2t' (found: 'step', 't2d'); fix: give a dict "
        "with a 'd2t' tensor (and optionally 't2d'), a bare d2t tensor or a list of target ids"
    )

    torch.save({"d2t": torch.zeros(3)}, path)
    assert file_error(VocabMapError, path) == (
        f"vocab file '{path}': d2t has dtype torch.float32; fix: d2t must be an integer "
        "tensor (torch.int64)"
    )

    # Arbitrary pickled objects are refused by weights_only loading, never executed.
    torch.save({"d2t": NotATensor()}, path)
    refused = file_error(CheckpointFormatError, path)
    assert refused.startswith(f"vocab file '{path}' cannot be loaded with weights_only=True (")
    assert refused.endswith(
        "); fix: save the map as plain tensors (torch.save({'d2t': d2t, 't2d': t2d}, ...))"
    )


def test_json_vocab_file_errors(tmp_path: Path) -> None:
    path = tmp_path / "vocab.json"
    path.write_text("[0, 0,")
    with pytest.raises(CheckpointFormatError, match=r"^vocab file '.*': its text is not valid JSON \("):
        load_vocab_file(path, name="k2", encoding="offset")

    path.write_text('{"t2d": [true]}')
    assert file_error(VocabMapError, path) == (
        f"vocab file '{path}' holds no d2t list; fix: give a list of ints or "
        '{"d2t": [...], "t2d": [...]}'
    )

    path.write_text('[0, "1"]')
    assert file_error(VocabMapError, path) == (
        f"vocab file '{path}': d2t[1] is '1', not an integer; fix: d2t must be a list of integers"
    )


def test_alignment_is_exported() -> None:
    assert isinstance(VocabMap("a", (0,), 1).alignment_to(VocabMap("b", (0,), 1)), Alignment)
