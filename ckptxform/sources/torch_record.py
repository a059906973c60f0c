"""Where the raw bytes of a tensor lie inside a ``torch.save`` archive, found without torch.

DCP's default writer stores each chunk as ``torch.save(tensor)`` at a byte range of its
``.distcp`` file: an uncompressed zip holding ``data.pkl`` (which storage, offset, size and
stride make the tensor) and ``data/0`` (the storage's bytes, little-endian). This module
reads the zip's directory and ``data.pkl`` (restricted: the rebuild functions and storage
classes only) and returns the absolute file offset of the tensor's first byte, after
checking that the record holds exactly the dtype and shape the metadata claims, contiguous.
Its allow-list and record types also index whole state dicts (``torch_zip``).
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
from dataclasses import dataclass
from typing import Any

from ckptxform.errors import CheckpointFormatError
from ckptxform.sources.restricted_pickle import Named, load_restricted
from ckptxform.sources.zip_members import read_member

_WHAT = "a torch.save'd DCP chunk"
#: bytes per element of the dtypes a torch.save record may hold, by torch's name
ITEM_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
              "int8": 1, "uint8": 1, "bool": 1, "uint16": 2, "uint32": 4, "uint64": 8, "float8_e4m3fn": 1,
              "float8_e5m2": 1, "float8_e8m0fnu": 1, "complex64": 8, "complex128": 16}
#: the legacy typed storages torch.save names, by the dtype they hold
_TYPED = {"DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
          "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16",
          "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
          "ComplexFloatStorage": "complex64", "ComplexDoubleStorage": "complex128"}
#: data.pkl of one tensor is ~200 bytes; a bound keeps a crafted record from filling memory
_MAX_PICKLE = 1 << 20


@dataclass(frozen=True)
class StoredStorage:
    """A storage a record names: ``data/<key>`` of the archive, ``numel`` elements of
    ``dtype`` (None: an UntypedStorage, ``numel`` bytes; the tensor names its dtype)."""

    dtype: str | None
    key: str
    numel: int


@dataclass(frozen=True)
class StoredTensor:
    """A tensor a record rebuilds: a view of ``storage`` (sizes and strides in elements)."""

    storage: StoredStorage
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str  # torch's name ("bfloat16"); "" when the record does not say


def _rebuild_v2(storage: Any, storage_offset: Any, size: Any, stride: Any, *rest: Any) -> StoredTensor:
    return StoredTensor(storage, storage_offset, tuple(size), tuple(stride), getattr(storage, "dtype", None) or "")


def _rebuild_v3(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any,
                dtype: Any, *rest: Any) -> StoredTensor:
    return StoredTensor(storage, storage_offset, tuple(size), tuple(stride), getattr(dtype, "name", ""))


def _rebuild_parameter(data: Any, *rest: Any) -> Any:
    return data  # an nn.Parameter saved as such: its tensor


class _OrderedDict(dict):  # type: ignore[type-arg]
    """``collections.OrderedDict`` (a dict keeps order); a ``state_dict()``'s also carries a
    ``_metadata`` attribute, which pickle sets on the instance."""


#: what a record of dense tensors names: the rebuild functions, storages and dtypes
TENSOR_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("collections", "OrderedDict"): _OrderedDict,
    ("torch.storage", "UntypedStorage"): Named("torch.storage", "UntypedStorage"),
    **{("torch", name): Named("torch", name) for name in (*_TYPED, *ITEM_BYTES)},
}


def stored_storage(pid: Any) -> StoredStorage:
    """The storage of persistent id ``('storage', type, key, location, numel)``."""
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], Named)
            and pid[1].name in (*_TYPED, "UntypedStorage") and isinstance(pid[2], str) and type(pid[4]) is int
            and pid[4] >= 0):
        raise ValueError(f"unexpected persistent id {pid!r}")
    kind = pid[1].name
    return StoredStorage(None if kind == "UntypedStorage" else _TYPED[kind], pid[2], pid[4])


def is_row_major(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether ``stride`` lays ``size`` out contiguously, as torch's ``is_contiguous``
    decides (a dimension of size 1 may have any stride; an empty tensor is contiguous)."""
    if 0 in size:
        return True
    step = 1
    for dim, st in zip(reversed(size), reversed(stride)):
        if dim != 1 and st != step:
            return False
        step *= dim
    return True


def tensor_data_offset(fd: int, offset: int, length: int, *, dtype: str, shape: tuple[int, ...],
                       label: str) -> int:
    """The absolute offset in ``fd`` of the bytes of the tensor saved at
    ``[offset, offset + length)``, checked to be ``dtype`` (torch's name) of ``shape``,
    contiguous; ``label`` (file, key and chunk) words the errors."""
    window = _Window(fd, offset, length, label)
    try:
        archive = zipfile.ZipFile(window)
        names = {info.filename: info for info in archive.infolist()}
        pkl = next((n for n in names if n.endswith("/data.pkl") or n == "data.pkl"), None)
        if pkl is None:
            raise ValueError("no data.pkl")
        prefix = pkl[: -len("data.pkl")]
        pickled = read_member(archive, names[pkl], _MAX_PICKLE, label=label, what=_WHAT)
        order = (read_member(archive, names[prefix + "byteorder"], 16, label=label, what=_WHAT)
                 if prefix + "byteorder" in names else b"little")
    except CheckpointFormatError:
        raise
    except (zipfile.BadZipFile, ValueError, KeyError, OSError, EOFError, struct.error) as exc:
        raise CheckpointFormatError(f"{label}: the chunk's record is not the torch.save archive DCP writes "
                                    f"({exc}); the file is damaged or was not written by dcp.save", path=label) from None
    if order != b"little":
        raise CheckpointFormatError(f"{label}: the chunk was saved {order!r}-endian; only little-endian "
                                    "checkpoints are read", path=label)
    tensor = load_restricted(pickled, TENSOR_GLOBALS, label=label, what=_WHAT, persistent=stored_storage)
    if not isinstance(tensor, StoredTensor):
        raise CheckpointFormatError(f"{label}: the chunk's record holds a {type(tensor).__name__}, not a tensor; "
                                    "the metadata and the .distcp file disagree (save the checkpoint again)", path=label)
    _check(tensor, dtype, shape, label)
    item = ITEM_BYTES[dtype]
    record = names.get(f"{prefix}data/{tensor.storage.key}")
    storage_bytes = tensor.storage.numel * (1 if tensor.storage.dtype is None else item)
    nbytes = item * _numel(shape)
    if record is None or record.compress_type != zipfile.ZIP_STORED or record.file_size != storage_bytes:
        raise CheckpointFormatError(f"{label}: the chunk's storage record is missing, compressed or not the "
                                    f"{storage_bytes} bytes its data.pkl names", path=label)
    start = tensor.storage_offset * item
    if start + nbytes > storage_bytes:
        raise short_chunk(label, storage_bytes - start, nbytes)
    data = window.data_start(record)
    if data + storage_bytes > length:
        raise short_chunk(label, length - data - start, nbytes)
    return offset + data + start


def short_chunk(label: str, have: int, want: int) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{label}: the chunk holds {max(have, 0)} bytes but the metadata says {want}; the file was truncated "
        "or belongs to another save: copy the checkpoint again", path=label)


def _check(tensor: StoredTensor, dtype: str, shape: tuple[int, ...], label: str) -> None:
    if tensor.dtype != dtype:
        raise CheckpointFormatError(f"{label}: the chunk holds {tensor.dtype or 'an unknown dtype'} but the "
                                    f"metadata says {dtype}; the checkpoint is inconsistent (save it again)", path=label)
    if tensor.size != shape:
        raise CheckpointFormatError(f"{label}: the chunk holds shape {list(tensor.size)} but the metadata says "
                                    f"{list(shape)}; the checkpoint is inconsistent (save it again)", path=label)
    if len(tensor.stride) != len(shape) or not is_row_major(shape, tensor.stride):
        raise CheckpointFormatError(f"{label}: the chunk is saved with strides {list(tensor.stride)}, not "
                                    "contiguous; save the checkpoint again", path=label)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


class _Window(io.RawIOBase):
    """Bytes ``[start, start + length)`` of a file as a seekable file (for ``zipfile``)."""

    def __init__(self, fd: int, start: int, length: int, label: str) -> None:
        self._fd, self._start, self._length, self._pos, self._label = fd, start, length, 0, label

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = max(0, pos + (0, self._pos, self._length)[whence])
        return self._pos

    def read(self, size: int = -1) -> bytes:
        stop = self._length if size is None or size < 0 else min(self._length, self._pos + size)
        want = max(0, stop - self._pos)
        blob = os.pread(self._fd, want, self._start + self._pos) if want else b""
        if len(blob) < want:
            raise short_chunk(self._label, self._pos + len(blob), self._length)
        self._pos += len(blob)
        return blob

    def readinto(self, buffer: Any) -> int:
        blob = self.read(len(buffer))
        buffer[: len(blob)] = blob
        return len(blob)

    def data_start(self, info: zipfile.ZipInfo) -> int:
        """Where the data of member ``info`` starts, from its local header."""
        self.seek(info.header_offset)
        header = self.read(30)
        if header[:4] != b"PK\x03\x04":
            raise CheckpointFormatError(f"{self._label}: bad zip local header in the chunk's record", path=self._label)
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        return info.header_offset + 30 + name_len + extra_len
