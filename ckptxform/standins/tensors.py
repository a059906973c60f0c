"""Seeded tensor values and the files a stand-in is written as, shared by the builders.

A ``TensorSpec`` names one tensor; ``seeded_values`` fills it from (seed, key name) so a
key's values do not depend on which other keys are written. The savers write
safetensors, torch pickles and JSON deterministically, and ``built_checkpoint`` records
what was written. torch is imported lazily, inside the functions that make tensors.
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

    if name not in USER_DTYPES:
        raise UsageError(f"dtype: {name!r} is not one of {', '.join(USER_DTYPES)}")
    return torch_dtype(USER_DTYPES[name])


def seeded_values(spec: TensorSpec, seed: int) -> torch.Tensor:
    """Seeded values for one tensor: linear weights ~N(0, 0.02), norms and scales near 1,
    packed int4 words uniform, shape tensors the logical shape they describe."""
    import torch

    gen = torch.Generator().manual_seed(derive_seed(seed, spec.key))
    dtype = torch_dtype_named(spec.dtype)
    if spec.kind == "shape":
        return torch.tensor(spec.unpacked, dtype=dtype)
    if spec.kind == "packed":
        return torch.randint(-(2**31), 2**31 - 1, spec.shape, generator=gen, dtype=dtype)
    values = torch.randn(spec.shape, generator=gen, dtype=torch.float32)
    if spec.kind == "norm":
        return (1.0 + 0.05 * values).to(dtype)
    return (0.02 * values).to(dtype)


def save_safetensors(tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(dict(tensors), str(path), metadata={"format": "pt"})


def save_pickle(obj: Any, path: Path) -> None:
    import torch

    # torch's zip writer derives the archive's serialization id from its content, so
    # equal objects give equal bytes (the determinism test guards this).
    torch.save(obj, path)


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def shapes_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in tensors.items()}


def dtypes_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    from ckptxform.dtypes import from_torch_dtype

    return {k: from_torch_dtype(v.dtype) for k, v in tensors.items()}


def built_checkpoint(out: Path, dims: DrafterDims, ids: tuple[int, ...] | None,
                     tensors: Mapping[str, torch.Tensor], files: list[str]) -> BuiltCheckpoint:
    return BuiltCheckpoint(path=out, dims=dims, target_ids=ids, keys=tuple(sorted(tensors)),
                           shapes=shapes_of(tensors), dtypes=dtypes_of(tensors),
                           files=tuple(sorted(files)))
