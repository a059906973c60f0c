"""PyTorch ``.bin`` checkpoints (pickled state dicts), loaded without running pickled code.

``torch.load(weights_only=True)`` refuses pickled code; what it accepts is then checked to
be a state dict of dense CPU tensors that safetensors can hold. A pickled tensor has no
byte range in its file, so its bytes are read from the loaded (memory-mapped) tensor.
"""

from __future__ import annotations

import ctypes
import pickle
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckptxform.dtypes import from_torch_dtype
from ckptxform.errors import CheckpointFormatError
from ckptxform.sources.base import TensorInfo


def load_torch_file(path: Path) -> dict[str, Any]:
    """The tensors of a pickled state dict, loaded without running pickled code."""
    from ckptxform.ops.decode import require_torch

    torch = require_torch(f"{path}: a pickled .bin/.pth checkpoint")  # only torch reads the pickle

    with open(path, "rb") as f:
        # mmap needs the zip format torch.save writes since 1.6; older files load whole.
        is_zip = f.read(4) == b"PK\x03\x04"
    try:
        with warnings.catch_warnings():
            # torch warns about pickle protocols it "might not support"; the load
            # either succeeds or raises, and we report the failure ourselves.
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=is_zip)
    except pickle.UnpicklingError as exc:
        raise CheckpointFormatError(
            f"{path}: contains pickled code that weights_only loading refuses "
            f"({_refusal_reason(str(exc))}); re-save it as safetensors from a trusted "
            "environment (torch.load there, then safetensors.torch.save_file)",
            path=str(path),
        ) from None
    except Exception as exc:  # torch raises anything from KeyError to RuntimeError
        raise CheckpointFormatError(
            f"{path}: not a readable PyTorch checkpoint ({type(exc).__name__}: "
            f"{_first_line(str(exc))}); re-download it, or re-save it as safetensors",
            path=str(path),
        ) from None
    if not isinstance(state, dict):
        raise CheckpointFormatError(
            f"{path}: holds a {type(state).__name__}, not a state dict (tensor name -> "
            "tensor); save model.state_dict()",
            path=str(path),
        )
    for key, value in state.items():
        _check_bin_entry(path, key, value, torch)
    return state


def _check_bin_entry(path: Path, key: Any, value: Any, torch: Any) -> None:
    if not isinstance(key, str):
        raise CheckpointFormatError(
            f"{path}: has a {type(key).__name__} key {key!r}; a state dict maps tensor names "
            "(strings) to tensors",
            path=str(path),
        )
    if not isinstance(value, torch.Tensor):
        nested = (
            f" (the weights may be nested: save state[{key!r}] instead)"
            if isinstance(value, dict)
            else ""
        )
        raise CheckpointFormatError(
            f"{path}: entry {key!r} is a {type(value).__name__}, not a tensor; a state dict "
            f"maps tensor names to tensors{nested}",
            path=str(path),
            key=key,
        )
    if value.layout != torch.strided or value.is_quantized or value.device.type != "cpu":
        raise CheckpointFormatError(
            f"{path}: tensor {key!r} is a {value.layout} {value.device.type} tensor"
            f"{' (quantized)' if value.is_quantized else ''}; only dense CPU tensors can be "
            "converted (re-save it with .to_dense().cpu())",
            path=str(path),
            key=key,
        )
    try:
        from_torch_dtype(value.dtype)
    except KeyError:
        raise CheckpointFormatError(
            f"{path}: tensor {key!r} has dtype {value.dtype}, which safetensors cannot hold",
            path=str(path),
            key=key,
        ) from None


def bin_infos(file: str, state: Mapping[str, Any]) -> list[TensorInfo]:
    return [
        TensorInfo(
            key,
            from_torch_dtype(t.dtype),
            tuple(t.shape),
            file,
            -1,  # a pickled tensor has no byte range in its file
            t.numel() * t.element_size(),
        )
        for key, t in state.items()
    ]


def tensor_bytes(tensor: Any, start: int, length: int) -> bytes:
    import torch  # already imported by the .bin load that made ``tensor``

    # reshape before view: a 0-d tensor cannot be viewed as bytes. ctypes copies the
    # bytes out without a numpy dependency.
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    piece = flat[start : start + length]
    return ctypes.string_at(piece.data_ptr(), length)


def _refusal_reason(message: str) -> str:
    found = re.search(r"GLOBAL (\S+)", message)
    if found:
        return f"it references {found.group(1)!r}"
    unsupported = re.search(r"Unsupported [^\n]*", message)
    return _first_line(unsupported.group(0) if unsupported else message)


def _first_line(text: str, limit: int = 160) -> str:
    line = next((part.strip() for part in text.splitlines() if part.strip()), "no details")
    return line if len(line) <= limit else line[: limit - 3] + "..."
