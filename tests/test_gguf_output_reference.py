"""rules/hf_to_gguf_{f16,bf16,q8_0}.yaml against llama.cpp's own ``convert_hf_to_gguf.py``
(llama-cpp-python 0.3.36's vendored llama.cpp, tests/llama_cpp_reference.py), the reference
(issue 38, Must show 2): on the same model folder, both files hold the same metadata
key/values, in the same order, and the same tensors (name, GGUF type, shape, bytes).

What legitimately varies, and is therefore not compared: the order of the tensors in the
file (llama.cpp writes them in the source's order, we in name order; GGUF readers find a
tensor by name), hence the data offsets and the file's bytes. Nothing else: general.name,
general.basename, size label and the rest of gguf-py's Metadata come from the same folder.

The stand-ins are not tuned for the writer (standins/spm_llama.py): GQA, head_dim apart from
hidden / heads, intermediate sizes that are no whole Q8_0 block (llama.cpp's F16 fallback),
a vocab_size past the SentencePiece pieces, added tokens, tied embeddings, bf16, float16
and float32 weights. gguf-py's ``GGUFReader`` reads each file, and hf_to_gguf_bf16 then
gguf_to_hf gives the source tensors back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from conftest import REPO, read_output
from llama_cpp_reference import convert

from ckptxform import api
from ckptxform.standins.spm_llama import SpmLlamaDims, build_spm_llama

gguf = pytest.importorskip("gguf")

pytestmark = pytest.mark.reference

RULES = REPO / "rules"
MODELS = {
    "gqa-bf16": (SpmLlamaDims(), False),
    "mqa-f16-tied": (SpmLlamaDims(hidden=160, heads=5, kv_heads=1, head_dim=48, intermediate=100, layers=3,
                                  vocab=320, dtype="float16"), True),
    "f32": (SpmLlamaDims(hidden=64, heads=2, kv_heads=2, head_dim=40, intermediate=96, layers=1, vocab=290,
                         dtype="float32"), False),
}


def read_gguf(file: Path) -> tuple[list[tuple[str, Any]], dict[str, tuple[str, tuple[int, ...], bytes]]]:
    """A GGUF file as GGUFReader reads it: its key/values in order, its tensors by name."""
    reader = gguf.GGUFReader(file)
    fields = [(f.name, f.contents()) for f in reader.fields.values()]
    tensors = {t.name: (t.tensor_type.name, tuple(t.shape.tolist()), t.data.tobytes()) for t in reader.tensors}
    return fields, tensors


def build(name: str, root: Path) -> Path:
    dims, tied = MODELS[name]
    # the folder's name is the model's name in both files (gguf-py's Metadata reads it)
    return build_spm_llama(root / name / "TinyLlama-1.1B-Chat", dims, seed=len(name), tied=tied)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("variant", ["f16", "bf16", "q8_0"])
def test_the_file_is_what_convert_hf_to_gguf_writes(tmp_path: Path, variant: str, name: str) -> None:
    model = build(name, tmp_path)
    ours = api.apply(RULES / f"hf_to_gguf_{variant}.yaml", out=tmp_path / "ours", sources={"model": str(model)},
                     progress=False).out
    (file,) = ours.glob("*.gguf")
    theirs = convert(model, variant, tmp_path / "theirs.gguf")
    our_fields, our_tensors = read_gguf(file)
    their_fields, their_tensors = read_gguf(theirs)
    assert [k for k, _ in our_fields] == [k for k, _ in their_fields]
    for (key, got), (_, want) in zip(our_fields, their_fields, strict=True):
        assert got == want, key
    assert sorted(our_tensors) == sorted(their_tensors)
    for key, want in their_tensors.items():
        assert our_tensors[key] == want, key
    assert ("output.weight" in their_tensors) != MODELS[name][1]  # a tied model has none


@pytest.mark.parametrize("name", sorted(MODELS))
def test_bf16_then_gguf_to_hf_gives_the_source_back(tmp_path: Path, name: str) -> None:
    from safetensors.numpy import load_file

    model = build(name, tmp_path)

    first = api.apply(RULES / "hf_to_gguf_bf16.yaml", out=tmp_path / "gguf", sources={"model": str(model)},
                      progress=False).out
    (file,) = first.glob("*.gguf")
    back = api.apply(RULES / "gguf_to_hf.yaml", out=tmp_path / "hf", sources={"model": str(file)},
                     progress=False).out
    got = {k: v.numpy() for k, v in read_output(back).items()}
    source = load_file(model / "model.safetensors")
    assert json.loads((back / "config.json").read_text())["tie_word_embeddings"] is MODELS[name][1]
    assert sorted(got) == sorted(source)
    for key, value in source.items():
        if key.endswith("norm.weight"):  # written F32 (llama.cpp keeps rank-1 tensors F32): exact
            assert np.array_equal(got[key].astype(value.dtype), value), key
            continue
        # the weights went through bfloat16: a bf16 source comes back bit for bit, others rounded once
        want = value.astype(np.float32).astype(ml_dtypes.bfloat16)
        assert np.array_equal(got[key].astype(ml_dtypes.bfloat16).view(np.uint16), want.view(np.uint16)), key
        assert np.array_equal(got[key], want.astype(np.float32)), key
