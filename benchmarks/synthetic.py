"""Synthetic checkpoints for the benchmark: real safetensors files of a chosen size, fast.

Tensor bytes are tiles of one random block (the values do not matter to a byte-moving
engine, and drawing gigabytes of random numbers would dominate the set-up). The
vocabulary maps are real (``make_draft_vocab``), so the headline rule plans and gathers
exactly as it would on real drafters.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ckptxform.standins import make_draft_vocab

_BLOCK = os.urandom(1 << 22)
_SIZES = {"BF16": 2, "I64": 8, "BOOL": 1}


@dataclass(frozen=True)
class Tensor:
    key: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes | None = None  # None: tiles of random bytes

    @property
    def nbytes(self) -> int:
        n = _SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n


def write_safetensors(path: Path, tensors: list[Tensor], *, sparse: bool = False,
                      real_ranges: Iterable[tuple[str, int, int]] = ()) -> None:
    """Write ``tensors``; with ``sparse`` only the header and ``real_ranges`` (key, start, len) hold bytes."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.key] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    base = 8 + len(blob)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        if sparse:
            f.truncate(base + offset)
            starts = {t.key: base + int(header[t.key]["data_offsets"][0]) for t in tensors}  # type: ignore[index]
            for key, start, length in real_ranges:
                f.seek(starts[key] + start)
                f.write((_BLOCK * (length // len(_BLOCK) + 1))[:length])
            return
        for t in tensors:
            if t.data is not None:
                f.write(t.data)
                continue
            left = t.nbytes
            while left:
                n = min(left, len(_BLOCK))
                f.write(_BLOCK[:n])
                left -= n


def write_sharded(root: Path, shards: list[list[Tensor]], **kw: object) -> None:
    root.mkdir(parents=True, exist_ok=True)
    n = len(shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i, group in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{n:05d}.safetensors"
        write_safetensors(root / name, group, **kw)  # type: ignore[arg-type]
        for t in group:
            weight_map[t.key] = name
            total += t.nbytes
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def _vocab_tensors(ids: tuple[int, ...], vocab: int) -> list[Tensor]:
    d2t = struct.pack(f"<{len(ids)}q", *(t - i for i, t in enumerate(ids)))
    t2d = bytearray(vocab)
    for t in ids:
        t2d[t] = 1
    return [Tensor("d2t", "I64", (len(ids),), d2t), Tensor("t2d", "BOOL", (vocab,), bytes(t2d))]


@dataclass(frozen=True)
class Dims:
    hidden: int
    inter: int
    draft_vocab: int = 32000
    vocab: int = 64000


def dims_for(total_bytes: int) -> Dims:
    """Drafter dimensions (bf16, EAGLE-3 shapes) whose weights come to about ``total_bytes``."""
    hidden = 256
    while True:
        d = Dims(hidden=hidden + 256, inter=int((hidden + 256) * 3.5) // 256 * 256)
        if _drafter_bytes(d) > total_bytes:
            return Dims(hidden=hidden, inter=int(hidden * 3.5) // 256 * 256)
        hidden += 256


def _drafter_tensors(d: Dims, ids: tuple[int, ...]) -> list[Tensor]:
    h, i = d.hidden, d.inter
    t = [Tensor(f"midlayer.self_attn.{p}_proj.weight", "BF16", (h, 2 * h)) for p in "qkv"]
    t += [Tensor("midlayer.self_attn.o_proj.weight", "BF16", (h, h)),
          Tensor("midlayer.mlp.gate_proj.weight", "BF16", (i, h)),
          Tensor("midlayer.mlp.up_proj.weight", "BF16", (i, h)),
          Tensor("midlayer.mlp.down_proj.weight", "BF16", (h, i))]
    t += [Tensor(f"midlayer.{n}.weight", "BF16", (h,)) for n in ("input_layernorm", "hidden_norm",
                                                                  "post_attention_layernorm")]
    t += [Tensor("fc.weight", "BF16", (h, 3 * h)), Tensor("norm.weight", "BF16", (h,)),
          Tensor("lm_head.weight", "BF16", (d.draft_vocab, h))]
    return t + _vocab_tensors(ids, d.vocab)


def _drafter_bytes(d: Dims) -> int:
    return sum(t.nbytes for t in _drafter_tensors(d, tuple(range(d.draft_vocab))))


def _pack(tensors: list[Tensor], shard_bytes: int) -> list[list[Tensor]]:
    shards: list[list[Tensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def native_config(d: Dims) -> dict[str, object]:
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": d.hidden,
            "intermediate_size": d.inter, "num_attention_heads": d.hidden // 128,
            "num_key_value_heads": d.hidden // 128, "head_dim": 128, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "max_position_embeddings": 131072, "vocab_size": d.vocab,
            "draft_vocab_size": d.draft_vocab, "torch_dtype": "bfloat16",
            # the verifier layers fc fuses (EAGLE's default 2, N/2, N-3 of Kimi-K2's 61): the
            # headline rule's require.config asserts them
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, VERIFIER_LAYERS // 2, VERIFIER_LAYERS - 3]}}


#: Kimi-K2 / K2.5's decoder layers (the verifier's text_config.num_hidden_layers)
VERIFIER_LAYERS = 61


def verifier_config(hidden: int, vocab: int) -> dict[str, object]:
    return {"model_type": "kimi_k25", "text_config": {"hidden_size": hidden, "vocab_size": vocab,
                                                       "num_hidden_layers": VERIFIER_LAYERS}}


def build_benchmark_sources(root: Path, total_bytes: int, *, shards: int = 4) -> dict[str, Path]:
    """A sharded drafter of ~total_bytes, a target-vocab drafter (vocab maps only) whose
    draft vocabulary shares ~80% of the drafter's, and a 2-shard verifier with a [vocab, H] lm_head."""
    d = dims_for(total_bytes)
    ids_a = make_draft_vocab(d.vocab, d.draft_vocab, seed=1)
    ids_b = make_draft_vocab(d.vocab, d.draft_vocab, seed=2)
    tensors = _drafter_tensors(d, ids_a)
    drafter = root / "drafter"
    write_sharded(drafter, _pack(tensors, -(-sum(t.nbytes for t in tensors) // shards)))
    (drafter / "config.json").write_text(json.dumps(native_config(d), indent=2))
    target = root / "target_vocab"
    target.mkdir(parents=True, exist_ok=True)
    write_safetensors(target / "model.safetensors", _vocab_tensors(ids_b, d.vocab))
    verifier = root / "verifier"
    write_sharded(verifier, [[Tensor("language_model.model.embed_tokens.weight", "BF16", (d.vocab, d.hidden))],
                             [Tensor("language_model.lm_head.weight", "BF16", (d.vocab, d.hidden))]])
    (verifier / "config.json").write_text(json.dumps(verifier_config(d.hidden, d.vocab), indent=2))
    return {"drafter": drafter, "target_vocab": target, "verifier": verifier}


def build_sparse_verifier(root: Path, *, hidden: int = 7168, vocab: int = 163840, shards: int = 61,
                          apparent_bytes: int = 1 << 40, rows: Iterable[int] = ()) -> Path:
    """A ~1 TB verifier of sparse files: valid headers, lm_head in the last shard, and real
    bytes only in ``rows`` of lm_head (the rows a conversion reads)."""
    row_bytes = hidden * 2
    per_shard = apparent_bytes // shards
    layer_rows = max(1, per_shard // 8 // row_bytes)
    groups: list[list[Tensor]] = []
    for s in range(shards - 1):
        groups.append([Tensor(f"language_model.model.layers.{s}.mlp.experts.{e}.weight", "BF16",
                              (layer_rows, hidden)) for e in range(8)])
    groups[0].insert(0, Tensor("language_model.model.embed_tokens.weight", "BF16", (vocab, hidden)))
    groups.append([Tensor("language_model.model.norm.weight", "BF16", (hidden,)),
                   Tensor("language_model.lm_head.weight", "BF16", (vocab, hidden))])
    ranges = [("language_model.lm_head.weight", r * row_bytes, row_bytes) for r in rows]
    root.mkdir(parents=True, exist_ok=True)
    n = len(groups)
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups, 1):
        name = f"model-{i:05d}-of-{n:05d}.safetensors"
        write_safetensors(root / name, group, sparse=True, real_ranges=ranges if i == n else ())
        weight_map.update({t.key: name for t in group})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps(verifier_config(hidden, vocab)))
    return root
