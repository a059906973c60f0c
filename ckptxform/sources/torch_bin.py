"""PyTorch ``.bin``/``.pth`` checkpoints (pickled state dicts), read without running pickled code.

A file in torch's zip format (every ``torch.save`` since 1.6) is indexed without torch
(``torch_zip``): its tensors are byte ranges of the file, read like a safetensors file's.
A legacy non-zip pickle, or a big-endian archive, is loaded with
``torch.load(weights_only=True)``, which refuses pickled code; what it accepts is then
checked to be a state dict of dense CPU tensors that safetensors can hold, and its tensors
are read from the load.
"""

from __future__ import annotations

import ctypes
import pickle
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptxform.dtypes import from_torch_dtype
from ckptxform.errors import CheckpointFormatError
from ckptxform.sources.base import TensorInfo
from ckptxform.sources.torch_zip import NeedsTorch, StridedTensor, read_zip_state_dict


@dataclass(frozen=True)
class BinFile:
    """One indexed ``.bin``/``.pth``: its tensors, and where those without a byte range
    (``offset == -1``) are read from: the tensors torch loaded, or strided views."""

    infos: list[TensorInfo]
    loaded: dict[str, Any]
    strided: dict[str, StridedTensor]


def index_bin(path: Path, file: str) -> BinFile:
    """The tensors of the state dict at ``path`` (``file``: its name in the checkpoint)."""
    with open(path, "rb") as f:
        is_zip = f.read(4) == b"PK\x03\x04"
    what = "a legacy (non-zip) pickled .bin/.pth"
    if is_zip:
        try:
            infos, strided = read_zip_state_dict(path, file)
            return BinFile(infos, {}, strided)
        except NeedsTorch as exc:
            what = str(exc)
    state = load_torch_file(path, what=what, is_zip=is_zip)
    return BinFile(bin_infos(file, state), state, {})


def load_torch_file(path: Path, *, what: str, is_zip: bool) -> dict[str, Any]:
    """The tensors of a pickled state dict, loaded with torch without running pickled code;
    ``what`` (e.g. "a big-endian .bin/.pth") words the error when torch is not installed."""
    from ckptxform.ops.decode import require_torch

    torch = require_torch(f"{path}: {what}")
    try:
        with warnings.catch_warnings():
            # torch warns about pickle protocols it "might not support"; the load
            # either succeeds or raises, and we report the failure ourselves.
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=is_zip)  # mmap: zip only
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


def bin_infos(file: str, state: dict[str, Any]) -> list[TensorInfo]:
    """The tensors of ``file`` that torch loaded as ``state``, read from the load (offset -1)."""
    return [TensorInfo(key, from_torch_dtype(t.dtype), tuple(t.shape), file, -1, t.numel() * t.element_size())
            for key, t in state.items()]


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
