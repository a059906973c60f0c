"""Mistral's own checkpoint format as mistralai repos ship it: ``consolidated.safetensors``
with Meta's key names and a ``params.json`` that may say more than Meta's: ``head_dim``
apart from ``dim / n_heads`` (Mistral-Nemo), ``n_kv_heads``, ``rope_theta``,
``sliding_window``, ``max_seq_len``. What rules/mistral_to_hf.yaml reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptxform.standins.tensors import TensorSpec, save_safetensors, seeded_values, write_json


@dataclass(frozen=True)
class MistralDims:
    """A Mistral-Nemo in miniature: head_dim 24 with dim 80 and 5 heads (not 16), GQA."""

    dim: int = 80
    n_heads: int = 5
    n_kv_heads: int = 1
    head_dim: int | None = 24    # None: not in params.json (dim / n_heads)
    hidden_dim: int = 112
    n_layers: int = 2
    vocab_size: int = 131
    rope_theta: float | None = 1000000.0
    sliding_window: int | None = None
    max_seq_len: int | None = None
    dtype: str = "bfloat16"

    @property
    def hd(self) -> int:
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads


def mistral_params(d: MistralDims) -> dict[str, Any]:
    params: dict[str, Any] = {"dim": d.dim, "n_layers": d.n_layers, "hidden_dim": d.hidden_dim, "n_heads": d.n_heads,
                              "n_kv_heads": d.n_kv_heads, "norm_eps": 1e-5, "vocab_size": d.vocab_size}
    optional = {"head_dim": d.head_dim, "rope_theta": d.rope_theta, "sliding_window": d.sliding_window,
                "max_seq_len": d.max_seq_len}
    return params | {k: v for k, v in optional.items() if v is not None}


def build_mistral_consolidated(out_dir: str | Path, dims: MistralDims = MistralDims(), *, seed: int = 0) -> Path:
    """Write ``consolidated.safetensors`` and ``params.json``; returns the weights file."""
    d = dims
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    q, kv = d.n_heads * d.hd, d.n_kv_heads * d.hd
    specs = [TensorSpec("tok_embeddings.weight", (d.vocab_size, d.dim), d.dtype, "linear"),
             TensorSpec("norm.weight", (d.dim,), d.dtype, "norm"),
             TensorSpec("output.weight", (d.vocab_size, d.dim), d.dtype, "linear")]
    for n in range(d.n_layers):
        a, f = f"layers.{n}.attention.", f"layers.{n}.feed_forward."
        specs += [TensorSpec(f"{a}wq.weight", (q, d.dim), d.dtype, "linear"),
                  TensorSpec(f"{a}wk.weight", (kv, d.dim), d.dtype, "linear"),
                  TensorSpec(f"{a}wv.weight", (kv, d.dim), d.dtype, "linear"),
                  TensorSpec(f"{a}wo.weight", (d.dim, q), d.dtype, "linear"),
                  TensorSpec(f"{f}w1.weight", (d.hidden_dim, d.dim), d.dtype, "linear"),
                  TensorSpec(f"{f}w2.weight", (d.dim, d.hidden_dim), d.dtype, "linear"),
                  TensorSpec(f"{f}w3.weight", (d.hidden_dim, d.dim), d.dtype, "linear"),
                  TensorSpec(f"layers.{n}.attention_norm.weight", (d.dim,), d.dtype, "norm"),
                  TensorSpec(f"layers.{n}.ffn_norm.weight", (d.dim,), d.dtype, "norm")]
    save_safetensors({s.key: seeded_values(s, seed) for s in specs}, out / "consolidated.safetensors")
    write_json(out / "params.json", mistral_params(d))
    return out / "consolidated.safetensors"
