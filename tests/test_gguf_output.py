"""GGUF as an output (issue 38 item 4): rules/hf_to_gguf_{f16,bf16,q8_0}.yaml write one
llama.cpp .gguf file, streamed.

Checked with gguf-py (llama.cpp's own Python library): its ``GGUFReader`` reads the file;
each tensor's bytes are what ``gguf.quants.quantize`` makes of the source's values after
llama.cpp's q/k RoPE permutation, computed here independently (numpy, not the rule's op);
a bf16 round trip gives the source tensors back bit for bit. The stand-in is not tuned
for the writer: GQA, head_dim 32 with hidden 96 and 4 heads, an intermediate size (80)
that is not whole Q8_0 blocks, a vocab_size past the SentencePiece pieces, added tokens.
tests/test_gguf_output_reference.py compares with llama.cpp's convert_hf_to_gguf.py itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import REPO, assert_clean_failure

from ckptxform import api
from ckptxform.standins.spm_llama import SpmLlamaDims, build_spm_llama

gguf = pytest.importorskip("gguf")

RULES = REPO / "rules"


def _apply(variant: str, source: Path, out: Path) -> Path:
    result = api.apply(RULES / f"hf_to_gguf_{variant}.yaml", out=out, sources={"model": str(source)}, progress=False)
    (file,) = result.out.glob("*.gguf")
    return file


def _source_values(source: Path) -> dict[str, np.ndarray]:
    """The source's tensors as float32 (bf16 widened exactly) or float16 as they are."""
    from safetensors.numpy import load_file

    out = {}
    for key, value in load_file(source / "model.safetensors").items():
        out[key] = value if value.dtype in (np.float16, np.float32) else value.astype(np.float32)
    return out


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: HF's half-split RoPE rows -> interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Its inverse (transformers' convert_llama_weights_to_hf permute)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _gguf_name(key: str) -> str:
    if key in _NAMES:
        return _NAMES[key]
    _, _, layer, rest = key.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest.removesuffix('.weight')]}.weight"


def _expected(source: Path, dims: SpmLlamaDims, qtype: str) -> dict[str, tuple[str, bytes]]:
    """Each GGUF tensor's type and bytes as llama.cpp's converter makes them, from gguf-py."""
    out = {}
    for key, values in _source_values(source).items():
        if key.endswith("q_proj.weight"):
            values = _llama_cpp_permute(values, dims.heads)
        elif key.endswith("k_proj.weight"):
            values = _llama_cpp_permute(values, dims.kv_heads)
        kind = "F32" if values.ndim <= 1 else qtype
        if kind == "Q8_0" and values.shape[-1] % 32:
            kind = "F16"
        data = gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind])
        out[_gguf_name(key)] = (kind, np.ascontiguousarray(data).tobytes())
    return out


def _read(file: Path) -> tuple[dict[str, Any], dict[str, tuple[str, bytes]], Any]:
    reader = gguf.GGUFReader(file)
    fields = {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("GGUF.")}
    tensors = {t.name: (t.tensor_type.name, t.data.tobytes()) for t in reader.tensors}
    return fields, tensors, reader


@pytest.mark.parametrize(("variant", "dtype"), [("q8_0", "bfloat16"), ("f16", "bfloat16"), ("bf16", "float32"),
                                                ("q8_0", "float16")])
def test_every_tensor_is_gguf_pys_quantization_of_the_permuted_source(tmp_path: Path, variant: str,
                                                                       dtype: str) -> None:
    dims = SpmLlamaDims(dtype=dtype)
    source = build_spm_llama(tmp_path / "TinyLlama", dims, seed=3)
    fields, tensors, reader = _read(_apply(variant, source, tmp_path / "out"))
    assert tensors == _expected(source, dims, variant.upper())
    assert tensors["blk.0.ffn_down.weight"][0] == ("F16" if variant == "q8_0" else variant.upper())
    assert all(t.data_offset % 32 == 0 for t in reader.tensors)
    assert fields["general.architecture"] == "llama"
    assert fields["general.file_type"] == int(gguf.LlamaFileType[{"q8_0": "MOSTLY_Q8_0", "f16": "MOSTLY_F16",
                                                                    "bf16": "MOSTLY_BF16"}[variant]])
    assert fields["llama.attention.key_length"] == 32 and fields["llama.rope.dimension_count"] == 32
    assert fields["llama.attention.head_count_kv"] == 2 and fields["llama.feed_forward_length"] == 80


def test_the_tokenizer_metadata_is_the_sentencepiece_vocabulary_padded_to_vocab_size(tmp_path: Path) -> None:
    from ckptxform.standins.spm_llama import spm_pieces

    dims = SpmLlamaDims()
    source = build_spm_llama(tmp_path / "TinyLlama", dims)
    fields, _, _ = _read(_apply("f16", source, tmp_path / "out"))
    pieces = spm_pieces()
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    assert fields["tokenizer.ggml.model"] == "llama" and len(tokens) == dims.vocab
    assert tokens[:len(pieces)] == [p.text for p in pieces]
    # <unk> is UNKNOWN in tokenizer.model, but added_tokens_decoder marks it special: llama.cpp makes it CONTROL
    assert types[:3] == [3, 3, 3] and set(types[3:259]) == {6}
    # added tokens: one that looks special (CONTROL), one plain word (USER_DEFINED, ▁ -> space)
    assert (tokens[dims.vocab - 4], types[dims.vocab - 4]) == ("<|im_start|>", 3)
    assert (tokens[dims.vocab - 3], types[dims.vocab - 3]) == (" hey", 4)
    assert tokens[len(pieces)] == f"[PAD{len(pieces)}]" and types[len(pieces)] == 5
    assert fields["tokenizer.ggml.bos_token_id"] == 1 and fields["tokenizer.ggml.eos_token_id"] == 2
    assert fields["tokenizer.ggml.add_bos_token"] is True and fields["tokenizer.ggml.add_eos_token"] is False
    assert fields["tokenizer.chat_template"].startswith("{% for m in messages %}")


def test_bf16_round_trip_gives_the_source_tensors_back(tmp_path: Path) -> None:
    """hf_to_gguf_bf16 then reading each tensor back with gguf-py and undoing the permutation."""
    import ml_dtypes

    dims = SpmLlamaDims(dtype="bfloat16")
    source = build_spm_llama(tmp_path / "TinyLlama", dims, seed=11)
    _, _, reader = _read(_apply("bf16", source, tmp_path / "out"))
    back = {}
    for t in reader.tensors:
        shape = tuple(reversed(t.shape.tolist()))
        values = (np.asarray(t.data).view(ml_dtypes.bfloat16).reshape(shape) if t.tensor_type.name == "BF16"
                  else np.asarray(t.data).reshape(shape).astype(ml_dtypes.bfloat16))  # the F32 norms: exact
        back[t.name] = values
    from safetensors.numpy import load_file

    original = load_file(source / "model.safetensors")
    assert len(back) == len(original)
    for key, value in original.items():
        got = back[_gguf_name(key)]
        if key.endswith("q_proj.weight"):
            got = _hf_permute(got, dims.heads)
        elif key.endswith("k_proj.weight"):
            got = _hf_permute(got, dims.kv_heads)
        assert got.dtype == value.dtype and got.tobytes() == value.tobytes(), key


def test_a_tensor_quantized_in_bands_is_the_whole_tensor_quantized() -> None:
    """gguf_quantize's program, a few rows at a time, gives gguf-py's bytes of the whole."""
    from ckptxform.ops.base import Block, InputTensor, Run, View
    from ckptxform.ops.gguf_quantize import GgufQuantize

    values = np.random.default_rng(0).standard_normal((37, 96), dtype=np.float32)
    raw = values.tobytes()
    view = View((37, 96), "F32", (Run(0, 0, len(raw)),))
    op = GgufQuantize()
    block = Block(op, {"ggml_type": "Q8_0", "requested": "Q8_0"}, (view,), (37, 3 * 34), "U8")
    tensor = InputTensor(view, lambda start, length: raw[start:start + length])
    pieces = list(op.blocks(block, [tensor], chunk_bytes=5 * 96 * 4))
    assert len(pieces) == 8
    assert b"".join(bytes(p) for p in pieces) == gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0).tobytes()
    rows = b"".join(bytes(p) for p in op.blocks(block, [tensor], chunk_bytes=1 << 20, rows=range(9, 20)))
    assert rows == b"".join(bytes(p) for p in pieces)[9 * 102:20 * 102]


def test_the_output_verifies_and_a_changed_byte_is_found(tmp_path: Path, run_cli: Any) -> None:
    source = build_spm_llama(tmp_path / "TinyLlama")
    file = _apply("q8_0", source, tmp_path / "out")
    assert run_cli("verify", tmp_path / "out").returncode == 0
    again = api.apply(RULES / "hf_to_gguf_q8_0.yaml", out=tmp_path / "out", sources={"model": str(source)},
                      progress=False)
    assert again.up_to_date
    reader = gguf.GGUFReader(file)
    offset = next(t for t in reader.tensors if t.name == "blk.1.attn_q.weight").data_offset
    del reader
    with open(file, "r+b") as f:
        f.seek(offset + 5)
        byte = f.read(1)
        f.seek(offset + 5)
        f.write(bytes([byte[0] ^ 1]))
    err = assert_clean_failure(run_cli("verify", tmp_path / "out"))
    assert "blk.1.attn_q.weight" in err


def test_a_bpe_tokenizer_is_refused_before_anything_is_written(tmp_path: Path, run_cli: Any) -> None:
    source = build_spm_llama(tmp_path / "Llama-3")
    (source / "tokenizer.model").unlink()
    (source / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": {}, "merges": []}}))
    proc = run_cli("apply", RULES / "hf_to_gguf_q8_0.yaml", "--source", f"model={source}", "--out", tmp_path / "out")
    err = assert_clean_failure(proc)
    assert "no tokenizer.model" in err and "convert_hf_to_gguf.py" in err
    assert not (tmp_path / "out").exists()


def test_llama3_rope_scaling_is_refused(tmp_path: Path, run_cli: Any) -> None:
    source = build_spm_llama(tmp_path / "Llama-3.1")
    config = json.loads((source / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}
    (source / "config.json").write_text(json.dumps(config))
    proc = run_cli("apply", RULES / "hf_to_gguf_f16.yaml", "--source", f"model={source}", "--out", tmp_path / "out")
    assert "rope_freqs" in assert_clean_failure(proc)
    assert not (tmp_path / "out").exists()


def test_a_tensor_not_made_by_gguf_quantize_is_refused(tmp_path: Path, run_cli: Any) -> None:
    source = build_spm_llama(tmp_path / "TinyLlama")
    rule = tmp_path / "rule.yaml"
    rule.write_text("version: 1\nsources:\n  model: {path: .}\ntensors:\n"
                    "  - key: model.norm.weight\n    to: output_norm.weight\n"
                    "  - key: '{K*}'\n    to: '{K}'\n    ops: [gguf_quantize: {type: F16}]\n"
                    "output: {format: gguf, gguf: {architecture: llama, file_type: F16}}\n")
    proc = run_cli("apply", rule, "--source", f"model={source}", "--out", tmp_path / "out")
    err = assert_clean_failure(proc)
    assert "'output_norm.weight' is not made by gguf_quantize" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("output", "message"), [
    ("{format: gguf}", "format: gguf needs output.gguf"),
    ("{format: gguf, gguf: {architecture: llama, file_type: F16}, max_shard_size: 5GB}",
     "output.max_shard_size has nothing to decide"),
    ("{format: gguf, gguf: {architecture: llama, file_type: F16}, file_name: model.safetensors}",
     "file_name ends in .gguf"),
    ("{gguf: {architecture: llama, file_type: F16}}", "add format: gguf"),
    ("{file_name: model.gguf}", "needs format: gguf"),
])
def test_output_sections_that_cannot_be_written_are_refused(tmp_path: Path, run_cli: Any, output: str,
                                                            message: str) -> None:
    rule = tmp_path / "rule.yaml"
    rule.write_text(f"version: 1\nsources:\n  model: {{path: .}}\ntensors:\n  - match: '.*'\noutput: {output}\n")
    proc = run_cli("validate", rule)
    assert message in assert_clean_failure(proc, code=2)
