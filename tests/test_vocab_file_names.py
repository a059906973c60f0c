"""Vocabulary files by the names and formats the tools write today: speculators' maps named
by the draft vocabulary size (``d2t-<N>.npy``/``t2d-<N>.npy``, vllm-project/speculators#1081)
and SGLang's hot-token map (``--speculative-token-map``: a ``.pt`` list of target ids,
read by SGLang's ``load_token_map`` with ``torch.load(weights_only=True)``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import read_output
from safetensors.torch import load_file

from ckptxform import api
from ckptxform.errors import UsageError, VocabMapError
from ckptxform.sources.vocab_files import load_vocab_file
from ckptxform.standins import HeadlineStandins


def sized_mapping(folder: Path, drafter: Path) -> tuple[Path, int]:
    """The drafter's d2t/t2d saved as speculators now caches them: ``d2t-N.npy``, ``t2d-N.npy``."""
    folder.mkdir()
    tensors = load_file(str(drafter / "model.safetensors"))
    n = len(tensors["d2t"])
    np.save(folder / f"d2t-{n}.npy", tensors["d2t"].numpy())
    np.save(folder / f"t2d-{n}.npy", tensors["t2d"].numpy())
    return folder, n


def k25_from_file(tmp_path: Path, file: Path, *extra: str) -> Path:
    """The headline rule with its K2.5 map read from ``file``."""
    child = tmp_path / "k25_from_file.yaml"
    fields = ", ".join([f"file: '{file}'", *extra])
    child.write_text(f"version: 1\nextends: aqmedai_k2_to_k25\nvocab:\n  k25: {{{fields}}}\n")
    return child


def without_target_vocab(headline: HeadlineStandins) -> dict[str, str]:
    return {k: v for k, v in headline.sources.items() if k != "target_vocab"}


@pytest.mark.parametrize("form", ["folder", "file"])
def test_a_sized_npy_mapping_is_the_drafters_map(form: str, headline: HeadlineStandins, headline_out: Path,
                                                 tmp_path: Path) -> None:
    folder, n = sized_mapping(tmp_path / "data", headline.target_vocab.path)
    file = folder if form == "folder" else folder / f"d2t-{n}.npy"
    rule = k25_from_file(tmp_path, file, "encoding: offset")
    # hash_inputs: a folder among the inputs is pinned, not hashed (it once failed the commit)
    result = api.apply(rule, out=tmp_path / "out", sources=without_target_vocab(headline), hash_inputs=True)
    for name in ("model.safetensors", "config.json"):
        assert (result.out / name).read_bytes() == (headline_out / name).read_bytes()


def test_the_t2d_beside_a_sized_d2t_is_read_and_checked(headline: HeadlineStandins, tmp_path: Path) -> None:
    folder, n = sized_mapping(tmp_path / "data", headline.target_vocab.path)
    t2d = np.load(folder / f"t2d-{n}.npy")
    np.save(folder / f"t2d-{n}.npy", np.roll(t2d, 1))
    with pytest.raises(VocabMapError, match="t2d"):
        load_vocab_file(folder / f"d2t-{n}.npy", name="k25", encoding="offset")


def test_a_sized_name_that_disagrees_with_d2t_is_refused(headline: HeadlineStandins, tmp_path: Path) -> None:
    folder, n = sized_mapping(tmp_path / "data", headline.target_vocab.path)
    wrong = folder / "d2t-32000.npy"
    (folder / f"d2t-{n}.npy").rename(wrong)
    with pytest.raises(VocabMapError) as err:
        load_vocab_file(wrong, name="k25", encoding="offset")
    assert str(err.value) == (f"vocab file '{wrong}': its name says 32000 draft tokens but d2t has {n}; fix: give "
                              "the file of the draft vocabulary size the drafter was trained with")


def test_a_folder_with_maps_of_several_sizes_is_ambiguous(headline: HeadlineStandins, tmp_path: Path) -> None:
    folder, n = sized_mapping(tmp_path / "data", headline.target_vocab.path)
    np.save(folder / "d2t.npy", np.load(folder / f"d2t-{n}.npy"))
    with pytest.raises(UsageError) as err:
        load_vocab_file(folder, name="k25", encoding="offset")
    assert str(err.value) == (f"vocab file '{folder}': the folder holds 2 d2t files ('d2t-{n}.npy', 'd2t.npy'), one "
                              "per draft vocabulary size; fix: give the path of the one the drafter was trained with")


@pytest.mark.parametrize("stored", ["list", "tensor"])
def test_an_sglang_hot_token_map_in_frequency_order(stored: str, headline: HeadlineStandins, tmp_path: Path) -> None:
    """FR-Spec's maps list hot tokens by frequency, not by id: row i of the output lm_head
    must be the row of target token hot[i], and d2t the offset hot[i] - i."""
    k2, k25 = headline.k2_ids, headline.k25_ids
    hot = list(k25)
    np.random.default_rng(0).shuffle(hot)  # "by frequency": any order
    path = tmp_path / "freq_512.pt"
    torch.save(hot if stored == "list" else torch.tensor(hot), path)
    vocab = headline.drafter.dims.vocab
    rule = k25_from_file(tmp_path, path, "encoding: absolute", f"vocab_size: {vocab}", "t2d: null")
    result = api.apply(rule, out=tmp_path / "out", sources=without_target_vocab(headline))
    out = read_output(result.out)
    assert (out["d2t"] + torch.arange(len(hot))).tolist() == hot
    assert out["t2d"].nonzero().flatten().tolist() == sorted(hot)
    source = load_file(str(headline.drafter.path / "model.safetensors"))["lm_head.weight"]
    row_of = {target: i for i, target in enumerate(k2)}
    shared = [(i, row_of[t]) for i, t in enumerate(hot) if t in row_of]
    assert shared  # the two stand-in vocabularies overlap
    for i, j in shared:
        assert torch.equal(out["lm_head.weight"][i], source[j])
