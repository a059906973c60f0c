"""Seeded tensor values and the files a stand-in is written as, shared by the builders.

A ``TensorSpec`` names one tensor; ``seeded_values`` fills it from (seed, key name) so a
key's values do not depend on which other keys are written. The savers write
safetensors, torch pickles and JSON deterministically, and ``built_checkpoint`` records
what was written. Values are numpy arrays (ml_dtypes for bf16): building the stand-ins
of the demo needs no torch; only pickles (``.bin``, ``training_state.pt``) and the
quantized builders import it, lazily.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ckptxform.dtypes import USER_DTYPES
from ckptxform.errors import UsageError
from ckptxform.standins.deepseek import DeepseekV3Dims
from ckptxform.standins.dims import DrafterDims

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = [
    "BuiltCheckpoint",
    "TensorSpec",
    "built_checkpoint",
    "derive_seed",
    "dtypes_of",
    "save_pickle",
    "save_safetensors",
    "seeded_values",
    "numpy_dtype_named",
    "shapes_of",
    "torch_dtype_named",
    "write_json",
]


@dataclass(frozen=True)
class BuiltCheckpoint:
    """What a builder wrote: where, with which dimensions and vocabulary map, which
    tensors (``shapes``/``dtypes`` use safetensors dtype names) and which files."""

    path: Path
    dims: DrafterDims | DeepseekV3Dims
    target_ids: tuple[int, ...] | None
    keys: tuple[str, ...]
    shapes: Mapping[str, tuple[int, ...]]
    dtypes: Mapping[str, str]
    files: tuple[str, ...]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor a builder writes, before its values are drawn."""

    key: str
    shape: tuple[int, ...]
    dtype: str  # torch-style name
    kind: Literal["linear", "norm", "packed", "shape"]
    #: for ``kind="shape"``: the logical shape of the packed weight it describes
    unpacked: tuple[int, ...] = ()


def derive_seed(seed: int, label: str) -> int:
    """A seed for ``label`` (a key name, a sub-builder) that no other label shares."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{label}".encode(),
                                          digest_size=8).digest(), "little") >> 1


def torch_dtype_named(name: str) -> torch.dtype:
    from ckptxform.dtypes import torch_dtype

    return torch_dtype(_safetensors_name(name))


def numpy_dtype_named(name: str) -> np.dtype:
    from ckptxform.dtypes import numpy_dtype

    return numpy_dtype(_safetensors_name(name))


def _safetensors_name(name: str) -> str:
    if name not in USER_DTYPES:
        raise UsageError(f"dtype: {name!r} is not one of {', '.join(USER_DTYPES)}")
    return USER_DTYPES[name]


def seeded_values(spec: TensorSpec, seed: int) -> np.ndarray:
    """Seeded values for one tensor: linear weights ~N(0, 0.02), norms and scales near 1,
    packed int4 words uniform, shape tensors the logical shape they describe."""
    import numpy as np

    gen = np.random.default_rng(derive_seed(seed, spec.key))
    dtype = numpy_dtype_named(spec.dtype)
    if spec.kind == "shape":
        return np.array(spec.unpacked, dtype=dtype)
    if spec.kind == "packed":
        return gen.integers(-(2**31), 2**31 - 1, spec.shape, dtype=dtype)
    values = gen.standard_normal(spec.shape, dtype=np.float32)
    if spec.kind == "norm":
        return (1.0 + 0.05 * values).astype(dtype)
    return (0.02 * values).astype(dtype)


def raw_of(value: Any) -> tuple[str, tuple[int, ...], bytes]:
    """(safetensors dtype, shape, bytes) of a numpy array or a torch tensor."""
    from ckptxform.dtypes import from_numpy_dtype, from_torch_dtype

    if hasattr(value, "tobytes") and not hasattr(value, "data_ptr"):
        return from_numpy_dtype(value.dtype), tuple(value.shape), value.tobytes()
    from ckptxform.ops.decode import tensor_bytes

    return from_torch_dtype(value.dtype), tuple(value.shape), tensor_bytes(value)


def save_safetensors(tensors: Mapping[str, Any], path: Path) -> None:
    """numpy arrays or torch tensors as a safetensors file (key order, header padded to
    8 bytes, ``format: pt`` as safetensors.torch writes it)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for key in sorted(tensors):
        dtype, shape, data = raw_of(tensors[key])
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for data in blobs:
            f.write(data)


def save_pickle(obj: Any, path: Path) -> None:
    from ckptxform.ops.decode import require_torch

    torch = require_torch(f"{path.name} (a pickled stand-in)")
    # torch's zip writer derives the archive's serialization id from its content, so
    # equal objects give equal bytes (the determinism test guards this).
    torch.save(_as_torch(obj, torch), path)


def _as_torch(obj: Any, torch: Any) -> Any:
    """``obj`` with its numpy arrays as torch tensors (bf16 by its bits)."""
    if isinstance(obj, dict):
        return {k: _as_torch(v, torch) for k, v in obj.items()}
    if hasattr(obj, "tobytes") and not hasattr(obj, "data_ptr"):
        from ckptxform.dtypes import torch_dtype

        dtype, shape, data = raw_of(obj)
        return torch.frombuffer(bytearray(data), dtype=torch_dtype(dtype)).reshape(shape) if data else \
            torch.empty(shape, dtype=torch_dtype(dtype))
    return obj


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def shapes_of(tensors: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in tensors.items()}


def dtypes_of(tensors: Mapping[str, Any]) -> dict[str, str]:
    from ckptxform.dtypes import from_numpy_dtype, from_torch_dtype

    return {k: from_torch_dtype(v.dtype) if hasattr(v, "data_ptr") else from_numpy_dtype(v.dtype)
            for k, v in tensors.items()}


def built_checkpoint(out: Path, dims: DrafterDims, ids: tuple[int, ...] | None,
                     tensors: Mapping[str, Any], files: list[str]) -> BuiltCheckpoint:
    return BuiltCheckpoint(path=out, dims=dims, target_ids=ids, keys=tuple(sorted(tensors)),
                           shapes=shapes_of(tensors), dtypes=dtypes_of(tensors),
                           files=tuple(sorted(files)))


def meta_llama_specs(*, vocab: int, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                     layers: int, dtype: str, head_key: str, qkv_prefix: str = "") -> list[TensorSpec]:
    """A Llama under Meta's key names (``tok_embeddings``, ``layers.N.attention.wq``, ...), which
    torchtitan keeps too: its head is ``lm_head.weight`` where Meta's is ``output.weight``, and
    torchtitan 0.3 puts q/k/v under ``attention.qkv_linear.``."""
    specs = [TensorSpec("tok_embeddings.weight", (vocab, hidden), dtype, "linear"),
             TensorSpec("norm.weight", (hidden,), dtype, "norm"),
             TensorSpec(head_key, (vocab, hidden), dtype, "linear")]
    for n in range(layers):
        a, f = f"layers.{n}.attention.", f"layers.{n}.feed_forward."
        specs += [TensorSpec(f"{a}{qkv_prefix}wq.weight", (heads * head_dim, hidden), dtype, "linear"),
                  TensorSpec(f"{a}{qkv_prefix}wk.weight", (kv_heads * head_dim, hidden), dtype, "linear"),
                  TensorSpec(f"{a}{qkv_prefix}wv.weight", (kv_heads * head_dim, hidden), dtype, "linear"),
                  TensorSpec(f"{a}wo.weight", (hidden, heads * head_dim), dtype, "linear"),
                  TensorSpec(f"{f}w1.weight", (intermediate, hidden), dtype, "linear"),
                  TensorSpec(f"{f}w2.weight", (hidden, intermediate), dtype, "linear"),
                  TensorSpec(f"{f}w3.weight", (intermediate, hidden), dtype, "linear"),
                  TensorSpec(f"layers.{n}.attention_norm.weight", (hidden,), dtype, "norm"),
                  TensorSpec(f"layers.{n}.ffn_norm.weight", (hidden,), dtype, "norm")]
    return specs
