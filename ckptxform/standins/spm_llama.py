"""A Llama checkpoint with a SentencePiece tokenizer (TinyLlama, Llama 2, Mistral 7B
v0.1): what the hf_to_gguf rules read, with the files llama.cpp's converter builds the
tokenizer metadata from (tokenizer.model, tokenizer_config.json with added tokens and a
chat template, special_tokens_map.json).

Widths not tuned for the GGUF writer: GQA, head_dim set apart from hidden / heads, an
intermediate size that is not a whole number of Q8_0 blocks (llama.cpp falls back to F16
for down_proj), a vocab_size beyond the SentencePiece pieces (padded with [PADn]).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ckptxform.engine.output.gguf.spm_model import BYTE, CONTROL, NORMAL, UNKNOWN, Piece, write_model
from ckptxform.standins.tensors import TensorSpec, save_safetensors, seeded_values, write_json

#: word pieces after the specials and the 256 byte pieces (scores fall with rank, as in BPE models)
_WORDS = ["▁", "e", "t", "a", "o", "▁t", "he", "▁the", "in", "▁a", "er", "on", "▁w", "re", "ll", "▁hello",
          "▁world", "▁model", "ing", "▁is", "▁of", "▁and", "é", "▁ü", "中", "文"]


@dataclass(frozen=True)
class SpmLlamaDims:
    hidden: int = 96
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32        # not hidden / heads (24)
    intermediate: int = 80    # not a whole number of 32-value blocks
    layers: int = 2
    vocab: int = 300          # 3 specials + 256 bytes + the words, then [PADn]
    dtype: str = "bfloat16"


def spm_pieces() -> list[Piece]:
    pieces = [Piece("<unk>", 0.0, UNKNOWN), Piece("<s>", 0.0, CONTROL), Piece("</s>", 0.0, CONTROL)]
    pieces += [Piece(f"<0x{b:02X}>", 0.0, BYTE) for b in range(256)]
    pieces += [Piece(word, -float(i), NORMAL) for i, word in enumerate(_WORDS)]
    return pieces


def build_spm_llama(out_dir: str | Path, dims: SpmLlamaDims = SpmLlamaDims(), *, seed: int = 0,
                    tied: bool = False) -> Path:
    """The checkpoint folder: model.safetensors, config.json, the tokenizer files."""
    d = dims
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    specs = [TensorSpec("model.embed_tokens.weight", (d.vocab, d.hidden), d.dtype, "linear"),
             TensorSpec("model.norm.weight", (d.hidden,), d.dtype, "norm")]
    if not tied:
        specs.append(TensorSpec("lm_head.weight", (d.vocab, d.hidden), d.dtype, "linear"))
    for n in range(d.layers):
        p = f"model.layers.{n}."
        specs += [TensorSpec(p + "self_attn.q_proj.weight", (q, d.hidden), d.dtype, "linear"),
                  TensorSpec(p + "self_attn.k_proj.weight", (kv, d.hidden), d.dtype, "linear"),
                  TensorSpec(p + "self_attn.v_proj.weight", (kv, d.hidden), d.dtype, "linear"),
                  TensorSpec(p + "self_attn.o_proj.weight", (d.hidden, q), d.dtype, "linear"),
                  TensorSpec(p + "mlp.gate_proj.weight", (d.intermediate, d.hidden), d.dtype, "linear"),
                  TensorSpec(p + "mlp.up_proj.weight", (d.intermediate, d.hidden), d.dtype, "linear"),
                  TensorSpec(p + "mlp.down_proj.weight", (d.hidden, d.intermediate), d.dtype, "linear"),
                  TensorSpec(p + "input_layernorm.weight", (d.hidden,), d.dtype, "norm"),
                  TensorSpec(p + "post_attention_layernorm.weight", (d.hidden,), d.dtype, "norm")]
    save_safetensors({s.key: seeded_values(s, seed) for s in specs}, out / "model.safetensors")
    write_json(out / "config.json", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d.hidden,
        "intermediate_size": d.intermediate, "num_attention_heads": d.heads, "num_key_value_heads": d.kv_heads,
        "head_dim": d.head_dim, "num_hidden_layers": d.layers, "vocab_size": d.vocab, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "max_position_embeddings": 2048,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "attention_bias": False,
        "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": tied, "dtype": d.dtype,
        "transformers_version": "5.0.0"})
    (out / "tokenizer.model").write_bytes(write_model(spm_pieces()))
    specials = {"0": "<unk>", "1": "<s>", "2": "</s>"}
    decoder = {i: {"content": text, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                   "special": True} for i, text in specials.items()}
    # added past the pieces: one that looks special but is not marked so (llama.cpp makes
    # it CONTROL), one plain word (USER_DEFINED, its ▁ written as a space)
    decoder[str(d.vocab - 4)] = {**decoder["0"], "content": "<|im_start|>", "special": False}
    decoder[str(d.vocab - 3)] = {**decoder["0"], "content": "▁hey", "special": False, "normalized": True}
    write_json(out / "tokenizer_config.json", {
        "add_bos_token": True, "add_eos_token": False, "added_tokens_decoder": decoder, "bos_token": "<s>",
        "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None, "legacy": False,
        "model_max_length": 2048, "tokenizer_class": "LlamaTokenizer",
        "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"})
    write_json(out / "special_tokens_map.json", {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    return out
