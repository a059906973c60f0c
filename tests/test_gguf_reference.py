"""rules/gguf_to_hf.yaml against transformers 5.23, the reference (issue 38, Must show 1):
``AutoModelForCausalLM.from_pretrained(DIR, gguf_file=FILE)`` dequantizes a GGUF with gguf-py
and undoes llama.cpp's q/k permutation; our output holds the same tensors, bit for bit, and
the config transformers builds from the metadata.

The GGUF files are written by gguf-py's own ``GGUFWriter`` (standins/gguf_models.py) for
models the rule was not tuned for: head_dim apart from hidden / heads (40 with hidden 256 and
8 heads, 48 with 4 heads), GQA (2 kv heads of 8), an intermediate size that is no whole block
(its down projection falls back to F16, as llama.cpp does), and each block format gguf-py
dequantizes (quantized with gguf-py where it has a quantizer, else valid random blocks).
Tied embeddings (no output.weight) and Qwen2 GGUFs (rules/gguf_qwen2_to_hf.yaml: q/k not
permuted, q/k/v biases, no vocab_size in the metadata) likewise.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import read_output

from ckptxform import api
from ckptxform.standins.gguf_models import GgufDims, build_llama_gguf

gguf = pytest.importorskip("gguf")
from gguf.quants import _type_traits  # noqa: E402

RULE = Path(__file__).resolve().parents[1] / "rules" / "gguf_to_hf.yaml"
QWEN2_RULE = RULE.with_name("gguf_qwen2_to_hf.yaml")
REFERENCE = "needs the 'reference' extra: pip install torch==2.13.0 -e '.[test,reference]'"
#: every block format gguf-py dequantizes (so transformers' loader does), and the plain ones
FORMATS = sorted({t.name for t in _type_traits} | {"F16", "BF16", "F32"})
#: the config fields transformers' GGUF loader sets from the metadata, compared one by one
CONFIG_FIELDS = ("hidden_size", "num_hidden_layers", "intermediate_size", "max_position_embeddings",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size",
                 "bos_token_id", "eos_token_id", "tie_word_embeddings", "model_type")

pytestmark = pytest.mark.reference


def transformers_load(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    """What transformers makes of the GGUF file ``path``: its tensors (float32) and config."""
    transformers = pytest.importorskip("transformers", reason=REFERENCE)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=str(path),
                                                                    output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set()), info
    tensors = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return tensors, model.config.to_dict()


def assert_same(path: Path, out: Path) -> dict:
    """Our output at ``out`` against transformers' load of ``path``; returns our config."""
    want, want_config = transformers_load(path)
    got = {k: v.numpy() for k, v in read_output(out).items()}
    config = json.loads((out / "config.json").read_text())
    if config.get("tie_word_embeddings"):
        assert want_config["tie_word_embeddings"] is True
        assert np.array_equal(want.pop("lm_head.weight"), want["model.embed_tokens.weight"])
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == np.float32 and got[key].shape == value.shape, key
        assert np.array_equal(got[key].view(np.uint32), value.view(np.uint32)), key
    for field in CONFIG_FIELDS:
        assert config.get(field) == want_config.get(field), field
    assert config["rope_parameters"]["rope_theta"] == want_config["rope_parameters"]["rope_theta"]
    return config


@pytest.mark.parametrize("kind", FORMATS)
def test_each_format_is_what_transformers_loads(tmp_path: Path, kind: str) -> None:
    dims = GgufDims(hidden=256, heads=8, kv_heads=2, head_dim=40, intermediate=288, layers=1, vocab=96)
    path = build_llama_gguf(tmp_path / "gguf" / "m.gguf", qtype=kind, dims=dims, seed=len(kind))
    out = api.apply(str(RULE), out=tmp_path / "hf", sources={"model": str(path)}, progress=False).out
    config = assert_same(path, out)
    assert (config["head_dim"], config["num_key_value_heads"]) == (40, 2)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][0]
    assert types["blk.0.ffn_down.weight"] == (kind if dims.intermediate % block == 0 else "F16")
    assert types["blk.0.attn_q.weight"] == kind


def test_a_split_set_with_other_dims_is_what_transformers_loads_of_the_whole(tmp_path: Path) -> None:
    """transformers reads one file; our rule reads the split set of the same model."""
    dims = GgufDims(hidden=192, heads=3, kv_heads=1, head_dim=80, intermediate=200, layers=3, vocab=130)
    whole = build_llama_gguf(tmp_path / "one" / "m.gguf", qtype="Q6_K", dims=dims, seed=17)
    first = build_llama_gguf(tmp_path / "split" / "m.gguf", qtype="Q6_K", dims=dims, seed=17, split_max_tensors=10)
    out = api.apply(str(RULE), out=tmp_path / "hf", sources={"model": str(first)}, progress=False).out
    assert_same(whole, out)


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_K", "IQ3_S", "F16"])
def test_tied_embeddings_are_what_transformers_loads(tmp_path: Path, kind: str) -> None:
    """No output.weight: no lm_head.weight written, tie_word_embeddings true."""
    dims = GgufDims(hidden=256, heads=4, kv_heads=1, head_dim=72, intermediate=256, layers=2, vocab=77)
    path = build_llama_gguf(tmp_path / "gguf" / "m.gguf", qtype=kind, dims=dims, seed=23, tied=True)
    out = api.apply(str(RULE), out=tmp_path / "hf", sources={"model": str(path)}, progress=False).out
    config = assert_same(path, out)
    assert config["tie_word_embeddings"] is True and "lm_head.weight" not in read_output(out)


@pytest.mark.parametrize(("kind", "tied", "dims"), [
    ("Q8_0", True, GgufDims(hidden=192, heads=6, kv_heads=2, head_dim=32, intermediate=320, layers=2, vocab=151)),
    ("Q4_K", False, GgufDims(hidden=256, heads=4, kv_heads=4, head_dim=64, intermediate=300, layers=1, vocab=90)),
    ("IQ4_XS", True, GgufDims(hidden=256, heads=8, kv_heads=1, head_dim=32, intermediate=512, layers=1, vocab=64)),
    ("BF16", False, GgufDims(hidden=96, heads=3, kv_heads=1, head_dim=32, intermediate=200, layers=2, vocab=99)),
])
def test_qwen2_is_what_transformers_loads(tmp_path: Path, kind: str, tied: bool, dims: GgufDims) -> None:
    """Qwen2: q/k not permuted, q/k/v biases, no vocab_size in the metadata, tied or not."""
    path = build_llama_gguf(tmp_path / "gguf" / "m.gguf", qtype=kind, dims=dims, seed=31, tied=tied, arch="qwen2")
    out = api.apply(str(QWEN2_RULE), out=tmp_path / "hf", sources={"model": str(path)}, progress=False).out
    config = assert_same(path, out)
    assert config["model_type"] == "qwen2" and config["tie_word_embeddings"] is tied
    assert "model.layers.0.self_attn.k_proj.bias" in read_output(out)
