"""PyTorch ``.bin`` checkpoints (pickled state dicts), loaded without running pickled code.

``torch.load(weights_only=True)`` refuses pickled code; what it accepts is then checked to
be a state dict of dense CPU tensors that safetensors can hold. The pickle says where no
tensor's bytes are, but torch's zip format stores each storage raw in an entry of its own,
which the memory-mapped load maps in file order: ``stored_offsets`` finds each tensor's
byte range in the file from that (and checks it), so the tensors are read by range like a
safetensors file's and the mapping is released. Where it cannot (a legacy non-zip file, a
compressed or big-endian archive, a strided view), bytes are read from the loaded tensor.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import re
import struct
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckptxform.dtypes import from_torch_dtype
from ckptxform.errors import CheckpointFormatError
from ckptxform.sources.base import TensorInfo
from ckptxform.sources.zip_members import read_member


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


def bin_infos(file: str, state: Mapping[str, Any], offsets: Mapping[str, int] | None = None) -> list[TensorInfo]:
    """The tensors of ``file``; ``offsets`` (``stored_offsets``): where each one's bytes are
    in the file, else -1 (read from the loaded tensor)."""
    return [
        TensorInfo(key, from_torch_dtype(t.dtype), tuple(t.shape), file,
                   offsets[key] if offsets is not None else -1, t.numel() * t.element_size())
        for key, t in state.items()
    ]


def stored_offsets(path: Path, state: Mapping[str, Any]) -> dict[str, int] | None:
    """Each tensor's first byte in the zip file ``path`` that ``state`` was memory-mapped
    from, or None when that cannot be known for every tensor.

    The storages of a memory-mapped load lie in one mapping of the whole file, so each is
    at (the mapping's address + its entry's data offset): paired in address order with the
    archive's ``data/`` entries, every pair must agree on that base and on the size."""
    try:
        with zipfile.ZipFile(path) as archive:
            entries = [e for e in archive.infolist() if e.filename.rsplit("/", 2)[-2:-1] == ["data"]]
            order = next((read_member(archive, e, 16, label=str(path), what="a torch.save archive")
                          for e in archive.infolist() if e.filename.endswith("/byteorder")), b"little")
    except (OSError, zipfile.BadZipFile, CheckpointFormatError):
        return None  # torch read it all the same: its tensors are read from the load
    if order.strip() != b"little" or any(e.compress_type != zipfile.ZIP_STORED for e in entries):
        return None
    storages = {}
    for t in state.values():
        if not t.is_contiguous():
            return None
        storage = t.untyped_storage()
        if storage.nbytes():
            storages[storage.data_ptr()] = storage.nbytes()
    places = sorted((_data_offset(path, e), e.file_size) for e in entries if e.file_size)
    if len(places) != len(storages):
        return None
    bases = {ptr - offset for ptr, (offset, _) in zip(sorted(storages), places)}
    if len(bases) != 1 or any(storages[ptr] != size for ptr, (_, size) in zip(sorted(storages), places)):
        return None
    (base,) = bases
    return {key: (t.untyped_storage().data_ptr() - base + t.storage_offset() * t.element_size()) if t.numel() else 0
            for key, t in state.items()}


def _data_offset(path: Path, entry: zipfile.ZipInfo) -> int:
    """Where ``entry``'s bytes begin: after its local header (whose extra field may differ
    from the central directory's)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        header = os.pread(fd, 30, entry.header_offset)
    finally:
        os.close(fd)
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    return entry.header_offset + 30 + name_length + extra_length


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
