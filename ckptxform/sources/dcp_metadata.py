"""The ``.metadata`` file of a torch.distributed.checkpoint (DCP) directory, read safely.

``dcp.save`` pickles a ``Metadata`` object: ``state_dict_metadata`` maps each flattened
key (``layers.0.attention.wq.weight``, ``optimizer.state.<fqn>.exp_avg``) to a
``TensorStorageMetadata`` (dtype, global size, chunks: each an offset and size in every
dim) or a ``BytesStorageMetadata`` (a pickled object), and ``storage_data`` maps each
chunk, by ``MetadataIndex(fqn, offset)``, to a ``_StorageInfo(relative_path, offset,
length)``: where in which ``__R_N.distcp`` file its record lies. The pickle is read by
``restricted_pickle`` with stand-ins for exactly the classes torch writes (the names below,
torch 2.x); anything else is refused by name.
"""

from __future__ import annotations

import os
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from ckptxform.errors import CheckpointFormatError, FileTooLargeError, quote
from ckptxform.fileio import open_regular
from ckptxform.sources.restricted_pickle import Named, Record, load_restricted

METADATA = ".metadata"
#: a .metadata lists every chunk of every key: tens of MB for the largest models
MAX_METADATA_BYTES = 1 << 30
_WHAT = "a DCP .metadata file"
_DCP = "torch.distributed.checkpoint.metadata"
_PLANNER = "torch.distributed.checkpoint.planner"


@dataclass(frozen=True)
class Chunk:
    """One saved piece of a tensor: its place in the global tensor and its record."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class DcpTensor:
    key: str
    torch_dtype: str  # torch's name, e.g. "bfloat16"
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class DcpIndex:
    tensors: Mapping[str, DcpTensor]
    #: keys saved as pickled objects (an lr scheduler's state, a step count): never read
    objects: tuple[str, ...]
    #: the whole Metadata stand-in, for fields a trainer adds (Megatron's ``mcore_data``)
    raw: Record


class _Metadata(Record):
    pass


class _TensorStorage(Record):
    pass


class _BytesStorage(Record):
    pass


class _ChunkStorage(Record):
    pass


class _StorageMeta(Record):
    pass


class _StorageInfo(Record):
    pass


class _TensorProperties(Record):
    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 5:  # torch's __getstate__: a tuple
            self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state
            return
        super().__setstate__(state)


class _MetadataIndex(Record):
    def __hash__(self) -> int:
        return hash((self.get("fqn"), self.get("offset")))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _MetadataIndex) and (self.get("fqn"), self.get("offset")) == (
            other.get("fqn"), other.get("offset"))


def _size(*args: Any) -> tuple[int, ...]:
    return tuple(args[0]) if args else ()


_DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
           "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "float8_e4m3fnuz",
           "float8_e5m2fnuz", "complex64", "complex128", "float4_e2m1fn_x2")

ALLOWED: dict[tuple[str, str], Any] = {
    (_DCP, "Metadata"): _Metadata,
    (_DCP, "TensorStorageMetadata"): _TensorStorage,
    (_DCP, "BytesStorageMetadata"): _BytesStorage,
    (_DCP, "ChunkStorageMetadata"): _ChunkStorage,
    (_DCP, "TensorProperties"): _TensorProperties,
    (_DCP, "MetadataIndex"): _MetadataIndex,
    (_DCP, "StorageMeta"): _StorageMeta,
    (_DCP, "_MEM_FORMAT_ENCODING"): int,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    # Megatron-Core's torch_dist saves cache every rank's save plan in the metadata
    # (``all_local_plans``): torch's plan classes, kept as plain records, never used
    (_PLANNER, "SavePlan"): Record,
    (_PLANNER, "WriteItem"): Record,
    (_PLANNER, "WriteItemType"): int,
    (_PLANNER, "TensorWriteData"): Record,
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): str,
    ("collections", "OrderedDict"): dict,
    # StorageMeta.checkpoint_id: the path it was saved to (pure paths: nothing is touched)
    ("pathlib", "PosixPath"): PurePosixPath,
    ("pathlib", "WindowsPath"): PureWindowsPath,
    ("pathlib", "PurePosixPath"): PurePosixPath,
    ("pathlib", "PureWindowsPath"): PureWindowsPath,
    **{("torch", name): Named("torch", name) for name in _DTYPES},
}


def read_dcp_metadata(root: Path) -> DcpIndex:
    """The keys of the DCP checkpoint in directory ``root``, from its ``.metadata``."""
    path = root / METADATA
    label = str(path)
    _check_pickle_start(path)
    with open_regular(path) as f:
        # streamed: a file past its pickle's first bytes (a sparse gigabyte behind a pickle's
        # start) fails at its first bad opcode, never read whole nor copied
        size = os.fstat(f.fileno()).st_size
        if size > MAX_METADATA_BYTES:
            raise FileTooLargeError(f"{quote(label)}: more than {MAX_METADATA_BYTES:,} bytes, too large for {_WHAT}; "
                                    "check that it is the right file", path=label, limit=MAX_METADATA_BYTES)
        meta = load_restricted(f, ALLOWED, label=label, what=_WHAT)
    if not isinstance(meta, _Metadata) or not isinstance(meta.get("state_dict_metadata"), dict):
        raise CheckpointFormatError(f"{label}: holds a {type(meta).__name__}, not torch's DCP Metadata; give the "
                                    "directory dcp.save wrote", path=label)
    storage = meta.get("storage_data")
    if not isinstance(storage, dict):
        raise _bad(label, "its storage_data (where each chunk is stored) is missing")
    if not all(isinstance(k, _MetadataIndex) and isinstance(v, _StorageInfo) for k, v in storage.items()):
        bad = next(f"{type(k).__name__} key" if isinstance(v, _StorageInfo) else type(v).__name__
                   for k, v in storage.items() if not (isinstance(k, _MetadataIndex) and isinstance(v, _StorageInfo)))
        raise _bad(label, f"a storage entry (where a chunk is stored) is a {bad}, not torch's record")
    tensors: dict[str, DcpTensor] = {}
    objects: list[str] = []
    for key, item in meta.state_dict_metadata.items():
        if not isinstance(key, str):
            raise _bad(label, f"it has a {type(key).__name__} key {_short(key)}")
        if not _is_text(key):
            raise _bad(label, f"key {quote(key)} is not valid UTF-8 text")
        if isinstance(item, _BytesStorage):
            objects.append(key)
        elif isinstance(item, _TensorStorage):
            tensors[key] = _tensor(label, key, item, storage)
        else:
            raise _bad(label, f"key {quote(key)} is a {type(item).__name__}")
    return DcpIndex(tensors, tuple(objects), meta)


def _check_pickle_start(path: Path) -> None:
    """``path`` starts as the pickle ``dcp.save`` writes (protocol 2 to 5), checked before
    the file is read whole: a sparse or foreign file of a gigabyte is refused at its first bytes."""
    with open_regular(path) as f:
        start = f.read(2)
    if len(start) < 2 or start[0] != 0x80 or not 2 <= start[1] <= 5:
        raise CheckpointFormatError(f"{path}: does not start as a pickle (first bytes {start!r}); {_WHAT} is a "
                                    "pickle dcp.save writes: the file is damaged or is another file (copy the "
                                    "checkpoint again)", path=str(path))


def _tensor(label: str, key: str, item: _TensorStorage, storage: dict[Any, Any]) -> DcpTensor:
    props = item.get("properties")
    dtype = getattr(props, "dtype", None)
    shape = item.get("size")
    if not isinstance(dtype, Named) or not _ints(shape):
        raise _bad(label, f"tensor {quote(key)} has no dtype or size")
    if getattr(props, "layout", "torch.strided") not in ("torch.strided", None):
        raise CheckpointFormatError(f"{label}: tensor {quote(key)} is a {props.layout} tensor; only dense "
                                    "(strided) tensors can be converted", path=label, key=key)
    chunks = []
    listed = item.get("chunks")
    if not isinstance(listed, list) or not all(isinstance(chunk, _ChunkStorage) for chunk in listed):
        raise _bad(label, f"the chunks of tensor {quote(key)} are not a list of chunk records")
    for chunk in listed:
        offsets, sizes = chunk.get("offsets"), chunk.get("sizes")
        if not (_ints(offsets) and _ints(sizes) and len(offsets) == len(sizes) == len(shape)):
            raise _bad(label, f"a chunk of tensor {quote(key)} has offsets {_short(offsets)} and sizes "
                              f"{_short(sizes)} for a tensor of shape {list(shape)}")
        where = storage.get(_index(key, offsets))
        if where is None:
            raise CheckpointFormatError(
                f"{label}: the chunk of tensor {quote(key)} at offsets {list(offsets)} has no storage entry "
                "(the save did not finish on every rank?); save the checkpoint again", path=label, key=key)
        file, offset, length = where.get("relative_path"), where.get("offset"), where.get("length")
        if not isinstance(file, str) or not _ints((offset, length)):
            raise _bad(label, f"the storage entry of tensor {quote(key)} at {list(offsets)} is "
                              f"{_short(where.__dict__)}")
        if not _is_text(file):
            raise _bad(label, f"the storage entry of tensor {quote(key)} at {list(offsets)} names file {quote(file)}, "
                              "which is not valid UTF-8 text")
        if where.get("transform_descriptors"):
            raise CheckpointFormatError(
                f"{label}: the chunk of tensor {quote(key)} at {list(offsets)} was saved through storage "
                f"transforms {_short(where.transform_descriptors)} (compression); save without extensions to convert it",
                path=label, key=key)
        chunks.append(Chunk(tuple(offsets), tuple(sizes), file, offset, length))
    return DcpTensor(key, dtype.name, tuple(shape), tuple(chunks))


def _index(fqn: str, offsets: tuple[int, ...]) -> _MetadataIndex:
    index = _MetadataIndex()
    index.__dict__.update(fqn=fqn, offset=tuple(offsets))
    return index


def _ints(values: Any) -> bool:
    return isinstance(values, tuple) and all(type(v) is int and v >= 0 for v in values)


def _short(value: Any) -> str:
    """``value`` as a message shows it: a bounded repr, even of a list nested ten thousand
    deep (``repr`` itself would recurse past the interpreter's limit)."""
    try:
        text = reprlib.repr(value)
    except (RecursionError, ValueError):
        text = f"a {type(value).__name__}"
    return text


def _is_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _bad(label: str, why: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{label}: not a DCP Metadata torch wrote: {why}; give the directory "
                                 "dcp.save wrote, or save it again", path=label)
