"""A state dict ``torch.save`` wrote in its zip format, indexed without torch.

The archive holds ``<name>/data.pkl`` (the dict: for each tensor its storage, offset,
size and stride) and each storage's raw little-endian bytes, stored uncompressed, in a
member ``<name>/data/<key>``. ``data.pkl`` is read with ``restricted_pickle`` (the rebuild
functions, storage classes and dtypes only: nothing is imported and no code of the file
runs), so each tensor is a byte range of the file, read like a safetensors file's. A
strided view (``t.T`` saved as is) has no one range: it is read from its storage's range
and laid out row-major on numpy (``StridedTensor``). What this reader cannot do that torch
can (a big-endian archive) raises ``NeedsTorch``; ``torch_bin`` then loads the file.
"""

from __future__ import annotations

import math
import os
import struct
import threading
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptxform.dtypes import from_torch_dtype
from ckptxform.errors import CheckpointFormatError, quote
from ckptxform.fileio import read_into
from ckptxform.sources.base import TensorInfo
from ckptxform.sources.restricted_pickle import load_restricted
from ckptxform.sources.torch_record import (
    ITEM_BYTES,
    TENSOR_GLOBALS,
    StoredStorage,
    StoredTensor,
    is_row_major,
    stored_storage,
)
from ckptxform.sources.zip_members import damaged_archive, read_member

_WHAT = "a torch.save'd state dict"
#: ~150 bytes a tensor: 64 MiB is some 400,000 tensors, far more than any model file holds
_MAX_PICKLE = 64 << 20
_RESAVE = ("re-save it as safetensors from a trusted environment (torch.load there, then "
           "safetensors.torch.save_file)")


class NeedsTorch(Exception):
    """A valid file this reader does not read (``str``: what it is, e.g. "a big-endian .bin")."""


@dataclass
class StridedTensor:
    """A tensor saved as a strided view of its storage: ``read`` gathers it row-major from
    the storage's bytes at ``start`` (the view's first element) in the file."""

    start: int
    itemsize: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    _laid_out: bytes | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def span(self) -> int:
        """Bytes of the storage from the first element to past the last."""
        return (sum((d - 1) * s for d, s in zip(self.size, self.stride)) + 1) * self.itemsize

    def read(self, fd: int, start: int, length: int) -> bytes | None:
        """Bytes ``[start, start + length)`` of the tensor row-major; None when the file
        ends before the storage does (truncated since it was indexed)."""
        with self._lock:  # laid out once (a row-by-row read asks many times), then kept
            if self._laid_out is None:
                import numpy as np

                raw = bytearray(self.span)
                if read_into(fd, memoryview(raw), self.start) < self.span:
                    return None
                items = np.frombuffer(raw, dtype=f"V{self.itemsize}")
                view = np.lib.stride_tricks.as_strided(
                    items, self.size, [s * self.itemsize for s in self.stride], writeable=False)
                self._laid_out = np.ascontiguousarray(view).tobytes()
            return self._laid_out[start:start + length]


def read_zip_state_dict(path: Path, file: str) -> tuple[list[TensorInfo], dict[str, StridedTensor]]:
    """The tensors of the zip-format state dict at ``path`` (``file``: its name in the
    checkpoint), in the dict's order, and those saved as strided views (``offset == -1``)."""
    with open(path, "rb") as f:  # (an unreadable file is the caller's OSError)
        file_size = os.fstat(f.fileno()).st_size
        try:
            return _index(path, file, f, file_size)
        except (CheckpointFormatError, NeedsTorch):
            raise
        except (zipfile.BadZipFile, EOFError, struct.error, ValueError, OSError) as exc:  # a damaged directory
            raise CheckpointFormatError(
                f"{path}: not a readable PyTorch checkpoint ({type(exc).__name__}: {str(exc)[:160]}); "
                "re-download it, or re-save it as safetensors", path=str(path)) from None


def _index(path: Path, file: str, f: Any, file_size: int) -> tuple[list[TensorInfo], dict[str, StridedTensor]]:
    with zipfile.ZipFile(f) as archive:
        prefix, pickled, members = _read_records(path, archive)
    state = load_restricted(pickled, TENSOR_GLOBALS, label=str(path), what=_WHAT, persistent=stored_storage,
                            fix=_RESAVE)
    if not isinstance(state, dict):
        raise CheckpointFormatError(f"{path}: holds a {type(state).__name__}, not a state dict (tensor name -> "
                                    "tensor); save model.state_dict()", path=str(path))
    starts: dict[str, int] = {}
    infos, strided = [], {}
    for key, value in state.items():
        tensor = _checked_tensor(path, key, value)
        itemsize = ITEM_BYTES[tensor.dtype]
        nbytes = itemsize * math.prod(tensor.size)
        if not nbytes:
            infos.append(TensorInfo(key, from_torch_dtype(tensor.dtype), tensor.size, file, 0, 0))
            continue
        if tensor.storage.key not in starts:
            starts[tensor.storage.key] = _storage_start(path, f, file_size, members, prefix, tensor)
        first = starts[tensor.storage.key] + tensor.storage_offset * itemsize
        view = StridedTensor(first, itemsize, tensor.size, tensor.stride)
        if tensor.storage_offset * itemsize + view.span > _storage_bytes(tensor):
            raise _damaged(path, f"tensor {quote(key)} reaches past the end of its storage "
                                 f"{quote(tensor.storage.key)}")
        contiguous = is_row_major(tensor.size, tensor.stride)
        if not contiguous:
            strided[key] = view
        infos.append(TensorInfo(key, from_torch_dtype(tensor.dtype), tensor.size, file,
                                first if contiguous else -1, nbytes))
    return infos, strided


def _read_records(path: Path, archive: zipfile.ZipFile) -> tuple[str, bytes, dict[str, zipfile.ZipInfo]]:
    """The archive's record prefix (``"name/"``), its ``data.pkl`` and its members by name,
    refusing a big-endian archive (``NeedsTorch``)."""
    members = {info.filename: info for info in archive.infolist()}
    pickles = sorted(n for n in members if n.endswith("/data.pkl") and n.count("/") == 1)
    if len(pickles) != 1:
        raise _damaged(path, f"it holds {len(pickles)} top-level data.pkl records, not one")
    prefix = pickles[0].removesuffix("data.pkl")
    order = members.get(prefix + "byteorder")
    if order is not None and read_member(archive, order, 16, label=str(path), what=_WHAT) != b"little":
        raise NeedsTorch("a big-endian .bin/.pth")
    return prefix, read_member(archive, members[pickles[0]], _MAX_PICKLE, label=str(path), what=_WHAT), members


def _checked_tensor(path: Path, key: Any, value: Any) -> StoredTensor:
    """``value`` as a dense tensor of a dtype safetensors holds, with sane sizes and strides."""
    if not isinstance(key, str):
        raise CheckpointFormatError(f"{path}: has a {type(key).__name__} key {key!r}; a state dict maps tensor "
                                    "names (strings) to tensors", path=str(path))
    if not isinstance(value, StoredTensor):
        kind, nested = type(value).__name__, ""
        if isinstance(value, dict):
            kind, nested = "dict", f" (the weights may be nested: save state[{key!r}] instead)"
        raise CheckpointFormatError(f"{path}: entry {key!r} is a {kind}, not a tensor; a state dict maps tensor "
                                    f"names to tensors{nested}", path=str(path), key=key)
    if not isinstance(value.storage, StoredStorage):
        raise _damaged(path, f"tensor {quote(key)} is rebuilt from a {type(value.storage).__name__}, not a storage")
    numbers = (value.storage_offset, *value.size, *value.stride)
    if (any(type(n) is not int or n < 0 for n in numbers) or len(value.size) != len(value.stride)
            or value.dtype not in ITEM_BYTES or value.storage.dtype not in (None, value.dtype)):
        raise _damaged(path, f"tensor {quote(key)} has storage offset {value.storage_offset!r}, size "
                             f"{list(value.size)!r}, stride {list(value.stride)!r} and dtype "
                             f"{value.dtype or 'unknown'!r}, which no tensor has")
    try:
        from_torch_dtype(value.dtype)
    except KeyError:
        raise CheckpointFormatError(f"{path}: tensor {key!r} has dtype torch.{value.dtype}, which safetensors "
                                    "cannot hold", path=str(path), key=key) from None
    return value


def _storage_bytes(tensor: StoredTensor) -> int:
    storage = tensor.storage
    return storage.numel * (1 if storage.dtype is None else ITEM_BYTES[storage.dtype])


def _storage_start(path: Path, f: Any, file_size: int, members: dict[str, zipfile.ZipInfo], prefix: str,
                   tensor: StoredTensor) -> int:
    """Where the bytes of ``tensor``'s storage begin in the file, checked to be stored
    raw, whole, and inside the file."""
    name = f"{prefix}data/{tensor.storage.key}"
    member, want = members.get(name), _storage_bytes(tensor)
    if member is None:
        raise _damaged(path, f"its data.pkl names storage {quote(tensor.storage.key)}, but the archive has no "
                             f"member {quote(name)}")
    if member.compress_type != zipfile.ZIP_STORED or member.flag_bits & 0x1:
        raise _damaged(path, f"its member {quote(name)} is compressed or encrypted, which torch.save never writes")
    if member.file_size != want:
        raise _damaged(path, f"its member {quote(name)} holds {member.file_size:,} bytes, but data.pkl says "
                             f"{want:,}")
    header = os.pread(f.fileno(), 30, member.header_offset)
    if len(header) < 30 or header[:4] != b"PK\x03\x04":
        raise _damaged(path, f"its member {quote(name)} has no local header")
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    start = member.header_offset + 30 + name_length + extra_length
    if start + want > file_size:
        raise _damaged(path, f"its member {quote(name)} ends at byte {start + want:,}, past the end of the "
                             f"{file_size:,}-byte file (truncated?)")
    return start


def _damaged(path: Path, why: str) -> CheckpointFormatError:
    return damaged_archive(str(path), _WHAT, why)
