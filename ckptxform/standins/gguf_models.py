"""Stand-ins of GGUF models as llama.cpp's ``convert_hf_to_gguf.py`` lays them out, written
with gguf-py's own ``GGUFWriter`` and quantizers: a Llama (or Qwen2) of seeded float32
weights under llama.cpp's names, q/k rows permuted as llama.cpp permutes them (Llama only;
Qwen2 rotates halves and is not permuted), norms F32, every matrix in ``qtype``.

A matrix whose rows are not whole blocks of ``qtype`` is written F16, as llama.cpp falls
back. A format gguf-py has no quantizer for (the K-quants, I-quants) is written as seeded
random blocks whose float16 scale fields hold small finite values: what matters to the
tests is that every decoder sees valid blocks, not that they approximate the weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ckptxform.standins.tensors import derive_seed

#: where each block format keeps its float16 scale(s) (bytes from the block's start)
F16_SCALES: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,), "IQ1_S": (0,),
    "IQ4_NL": (0,), "IQ4_XS": (0,), "TQ1_0": (52,), "TQ2_0": (64,),
}


@dataclass(frozen=True, kw_only=True)
class GgufDims:
    """A small decoder: head_dim apart from hidden / heads, GQA, and an intermediate size
    that is no whole block of 32 or 256 (its down projection falls back to F16)."""

    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 48
    intermediate: int = 528
    layers: int = 2
    vocab: int = 320
    rope_theta: float = 500000.0
    eps: float = 1e-5
    context: int = 2048


#: a Qwen2: head_dim is hidden / heads (transformers' Qwen2 config has no other), GQA
QWEN2_GGUF = GgufDims(hidden=192, heads=6, kv_heads=2, head_dim=32, intermediate=320, layers=2, vocab=151)


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's rotate-half q/k rows -> llama.cpp's interleaved pairs (convert_hf_to_gguf's ``permute``)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_blocks(qtype: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Seeded random ``qtype`` blocks for a ``[rows, cols]`` matrix, scale fields finite and small."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    values, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    gen = np.random.default_rng(seed)
    blocks = gen.integers(0, 256, (rows * cols // values, size), dtype=np.uint8)
    for at in F16_SCALES.get(qtype, ()):
        scales = (gen.uniform(0.5, 1.5, blocks.shape[0]) * 1e-3).astype(np.float16)
        blocks[:, at:at + 2] = scales.view(np.uint8).reshape(-1, 2)
    if qtype == "MXFP4":  # e8m0 exponent byte: 2**(e - 127), kept near 2**-7
        blocks[:, 0] = gen.integers(115, 125, blocks.shape[0], dtype=np.uint8)
    return blocks.reshape(rows, cols // values * size)


def encode(values: np.ndarray, qtype: str, seed: int) -> tuple[np.ndarray, str]:
    """``values`` (float32 ``[rows, cols]``) in ``qtype`` as gguf-py writes it, and the type
    written: F16 where the rows are not whole blocks (llama.cpp's fallback)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    kind = GGMLQuantizationType[qtype]
    if qtype == "F32":
        return values, "F32"
    if qtype == "F16" or values.shape[-1] % GGML_QUANT_SIZES[kind][0]:
        return values.astype(np.float16), "F16"
    try:
        return quantize(values, kind), qtype
    except NotImplementedError:  # no quantizer in gguf-py: valid random blocks
        return random_blocks(qtype, *values.shape, seed), qtype


def build_llama_gguf(out: str | Path, *, dims: GgufDims = GgufDims(), qtype: str = "Q8_0", arch: str = "llama",
                     tied: bool = False, seed: int = 0, split_max_tensors: int = 0, name: str = "tiny") -> Path:
    """Write a GGUF model to ``out`` (a ``.gguf`` path; with ``split_max_tensors``, a split
    set ``NAME-0000i-of-0000N.gguf`` beside it). Returns the (first) file's path."""
    from gguf import GGMLQuantizationType, GGUFWriter

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    d = dims
    writer = GGUFWriter(out, arch, split_max_tensors=split_max_tensors)
    writer.add_name(name)
    writer.add_context_length(d.context)
    writer.add_embedding_length(d.hidden)
    writer.add_block_count(d.layers)
    writer.add_feed_forward_length(d.intermediate)
    writer.add_head_count(d.heads)
    writer.add_head_count_kv(d.kv_heads)
    writer.add_rope_freq_base(d.rope_theta)
    writer.add_layer_norm_rms_eps(d.eps)
    if arch == "llama":
        writer.add_rope_dimension_count(d.head_dim)
        writer.add_key_length(d.head_dim)
        writer.add_value_length(d.head_dim)
        writer.add_vocab_size(d.vocab)
    else:  # Qwen2's GGUF has no vocab_size: transformers counts the tokenizer's tokens
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list([f"t{i}" for i in range(d.vocab)])

    def tensor(key: str, shape: tuple[int, ...], kind: str = "linear") -> None:
        gen = np.random.default_rng(derive_seed(seed, key))
        values = gen.standard_normal(shape, dtype=np.float32)
        values = 1.0 + 0.05 * values if kind == "norm" else 0.02 * values
        if kind == "q" and arch == "llama":
            values = llama_cpp_permute(values, d.heads)
        if kind == "k" and arch == "llama":
            values = llama_cpp_permute(values, d.kv_heads)
        if kind in ("norm", "bias"):
            writer.add_tensor(key, values.astype(np.float32))
            return
        data, written = encode(values.astype(np.float32), qtype, derive_seed(seed, key + "/blocks"))
        raw: dict[str, Any] = {} if written in ("F32", "F16") else {"raw_dtype": GGMLQuantizationType[written]}
        writer.add_tensor(key, data, **raw)

    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    tensor("token_embd.weight", (d.vocab, d.hidden))
    for n in range(d.layers):
        b = f"blk.{n}."
        tensor(b + "attn_norm.weight", (d.hidden,), "norm")
        tensor(b + "attn_q.weight", (q, d.hidden), "q")
        tensor(b + "attn_k.weight", (kv, d.hidden), "k")
        tensor(b + "attn_v.weight", (kv, d.hidden))
        if arch == "qwen2":
            for part, rows in (("q", q), ("k", kv), ("v", kv)):
                tensor(f"{b}attn_{part}.bias", (rows,), "bias")
        tensor(b + "attn_output.weight", (d.hidden, q))
        tensor(b + "ffn_norm.weight", (d.hidden,), "norm")
        tensor(b + "ffn_gate.weight", (d.intermediate, d.hidden))
        tensor(b + "ffn_up.weight", (d.intermediate, d.hidden))
        tensor(b + "ffn_down.weight", (d.hidden, d.intermediate))
    tensor("output_norm.weight", (d.hidden,), "norm")
    if not tied:
        tensor("output.weight", (d.vocab, d.hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if split_max_tensors:
        return sorted(out.parent.glob(out.stem + "-00001-of-*.gguf"))[0]
    return out
