"""Meta's model-parallel Llama checkpoints, as Llama-2-13B/70B, CodeLlama-34B/70B and
Llama-3-70B's ``original/`` ship them: ``consolidated.00.pth`` ... ``consolidated.NN.pth``
and ``params.json``, written from one whole (seeded) model split as Meta's ranks hold it.

Meta's model-parallel layers (llama/model.py, fairscale): ``ColumnParallelLinear`` (wq, wk,
wv, w1, w3, output) holds a slice of the rows, ``RowParallelLinear`` (wo, w2) of the
columns, ``ParallelEmbedding`` (Llama 1/2) of the embedding's columns and
``VocabParallelEmbedding`` (Llama 3) of its rows; norms and ``rope.freqs`` are copies.
As in Meta's files, every tensor of a shard is a view of one storage (torch.save keeps
them so), and params.json says what Meta's says: Llama 2's has no ``n_kv_heads`` for
full multi-head attention, ``vocab_size: -1`` and no ``rope_theta``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ckptxform.errors import UsageError
from ckptxform.standins.tensors import meta_llama_specs, seeded_values, write_json

if TYPE_CHECKING:
    import numpy as np

__all__ = ["META_GQA_TINY", "MetaDims", "build_meta_model_parallel", "meta_whole_state", "split_dims"]

Version = Literal["2", "3"]


@dataclass(frozen=True, kw_only=True)
class MetaDims:
    """The params.json of a Meta Llama (``kv_heads`` None: full multi-head attention)."""

    dim: int = 48
    heads: int = 8
    kv_heads: int | None = 4
    layers: int = 2
    vocab: int = 92             # not a power of 2 (the output's rows split into 4, as 32000 into 8)
    multiple_of: int = 4
    ffn_dim_multiplier: float | None = 1.3
    dtype: str = "bfloat16"

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def n_kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def ffn(self) -> int:
        """The feed-forward width Meta's ``FeedForward`` derives from these fields."""
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


#: GQA, head_dim 6, ffn width 168: splits into 1, 2 or 4 shards
META_GQA_TINY = MetaDims()


def split_dims(version: Version) -> dict[str, int]:
    """Which dim each kind of Meta weight is split along across the shards."""
    return {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0, "wo": 1, "w2": 1,
            "tok_embeddings": 0 if version == "3" else 1}


def meta_whole_state(dims: MetaDims, *, seed: int) -> dict[str, np.ndarray]:
    """The whole model under Meta's key names, seeded by (seed, key)."""
    import numpy as np

    d = dims
    specs = meta_llama_specs(vocab=d.vocab, hidden=d.dim, heads=d.heads, kv_heads=d.n_kv, head_dim=d.head_dim,
                             intermediate=d.ffn, layers=d.layers, dtype=d.dtype, head_key="output.weight")
    state = {s.key: seeded_values(s, seed) for s in specs}
    # Llama 1/2 files carry the RoPE inverse frequencies (theta 10000), replicated
    freqs = 1.0 / (10000.0 ** (np.arange(0, d.head_dim, 2, dtype=np.float32) / d.head_dim))
    state["rope.freqs"] = freqs.astype(state["norm.weight"].dtype)
    return state


def build_meta_model_parallel(out_dir: str | Path, dims: MetaDims = META_GQA_TINY, *, shards: int, seed: int = 0,
                              version: Version = "2") -> Path:
    """``consolidated.00.pth`` .. and ``params.json`` of ``dims`` split over ``shards`` ranks;
    returns the directory (what ``--source model=`` takes)."""
    import numpy as np

    from ckptxform.ops.decode import require_torch

    torch = require_torch("consolidated.NN.pth (pickled stand-ins)")
    d = dims
    if any(size % shards for size in (d.heads, d.n_kv, d.dim, d.ffn, d.vocab)):
        raise UsageError(f"MetaDims {d}: heads, kv heads, dim, the ffn width ({d.ffn}) and the vocabulary "
                         f"must divide into {shards} model-parallel shards")
    whole = meta_whole_state(d, seed=seed)
    along = split_dims(version)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for rank in range(shards):
        pieces: dict[str, Any] = {}
        for key, value in whole.items():
            if key == "rope.freqs" and version == "3":
                continue
            dim = along.get(key.split(".")[-2])
            pieces[key] = value if dim is None else np.array_split(value, shards, axis=dim)[rank]
        torch.save(_one_storage(pieces, torch), out / f"consolidated.{rank:02d}.pth")
    write_json(out / "params.json", _params(d, version))
    return out


def _one_storage(pieces: dict[str, np.ndarray], torch: Any) -> dict[str, Any]:
    """The tensors as views of one storage, each at its own offset, as in Meta's files."""
    import numpy as np

    from ckptxform.dtypes import from_numpy_dtype, torch_dtype

    blobs = [np.ascontiguousarray(v).tobytes() for v in pieces.values()]
    flat = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8)
    out, offset = {}, 0
    for (key, value), blob in zip(pieces.items(), blobs):
        dtype = torch_dtype(from_numpy_dtype(value.dtype))
        out[key] = flat[offset:offset + len(blob)].view(dtype).view(value.shape)
        offset += len(blob)
    return out


def _params(d: MetaDims, version: Version) -> dict[str, Any]:
    params: dict[str, Any] = {"dim": d.dim, "multiple_of": d.multiple_of, "n_heads": d.heads, "n_layers": d.layers,
                              "norm_eps": 1e-05, "vocab_size": -1}
    if d.kv_heads is not None:
        params["n_kv_heads"] = d.kv_heads
    if d.ffn_dim_multiplier is not None:
        params["ffn_dim_multiplier"] = d.ffn_dim_multiplier
    if version == "3":
        params |= {"vocab_size": d.vocab, "rope_theta": 500000.0, "use_scaled_rope": False}
    return params
