"""A torch.distributed.checkpoint (DCP) directory as a source: ``.metadata`` + ``__R_N.distcp``.

Opening reads the metadata (``dcp_metadata``, a restricted unpickler) and, for every chunk
of every model tensor, its record's zip directory and ``data.pkl`` (``torch_record``): the
chunk is then a byte range of its file, checked against the metadata's dtype and shape, and
the chunks of a tensor are checked to tile it (``chunks``). A tensor held by one chunk is a
plain byte range (copied in the kernel like a safetensors tensor); a tensor spread over
ranks is read by byte range, each range mapped to runs of its chunks. Nothing needs torch.

What a trainer saves beside the model (torchtitan's ``optimizer``, ``lr_scheduler``,
``dataloader``, ``train_state``; Megatron's ``*._extra_state``; any pickled object) is not
a weight: each entry is listed in ``unread`` with why, and never read.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ckptxform.dtypes import DTYPE_SIZES, from_torch_dtype, nbytes
from ckptxform.errors import CheckpointFormatError, CkptxformError, SourceNotFoundError, quote
from ckptxform.fileio import read_into
from ckptxform.sources.base import TensorInfo, Unread
from ckptxform.sources.chunks import ChunkGrid
from ckptxform.sources.dcp_metadata import METADATA, DcpIndex, DcpTensor, read_dcp_metadata
from ckptxform.sources.local import LocalCheckpoint, _pread
from ckptxform.sources.local_layout import check_inside
from ckptxform.sources.pins import FilePin, pin_fd, pin_path
from ckptxform.sources.torch_record import short_chunk, tensor_data_offset

#: the top-level entries a trainer saves beside the model, and what they are
TRAINING_STATE = {
    "optimizer": "optimizer state",
    "optim": "optimizer state",
    "lr_scheduler": "learning-rate scheduler state",
    "lr_schedulers": "learning-rate scheduler state",
    "dataloader": "dataloader state",
    "train_state": "training progress",
}


def is_dcp_dir(path: Path) -> bool:
    return path.is_dir() and (path / METADATA).is_file()


@dataclass(frozen=True)
class _Chunked:
    grid: ChunkGrid
    places: tuple[tuple[str, int], ...]  # each chunk's file and the offset of its first data byte


class DcpCheckpoint(LocalCheckpoint):
    """A DCP directory; build it with ``open_dcp``. ``unread`` lists the entries that are
    not model weights."""

    kind = "dcp"

    def __init__(self, *, chunked: dict[str, _Chunked], unread: tuple[Unread, ...], index: DcpIndex,
                 **kwargs: object) -> None:
        super().__init__(metadata={}, bin_tensors={}, **kwargs)  # type: ignore[arg-type]
        self._chunked = chunked
        self.unread = unread
        #: the parsed .metadata (Megatron's torch_dist source reads its own fields from it)
        self.index = index

    def read(self, info: TensorInfo, start: int = 0, length: int | None = None) -> bytes:
        chunked = self._chunked.get(info.key)
        if chunked is None:
            return super().read(info, start, length)
        length = self._checked_range(info, start, length)
        self._check_readable(info)
        parts = []  # one pread per piece, joined: a single-piece range is never copied again
        try:
            for piece in chunked.grid.pieces(start, length):
                file, data = chunked.places[piece.chunk]
                part = _pread(self._descriptor(file), data + piece.at, piece.length)
                if len(part) < piece.length:
                    raise self._truncated(TensorInfo(info.key, info.dtype, info.shape, file, data, info.nbytes))
                parts.append(part)
        except OSError as exc:
            raise SourceNotFoundError(f"{self.root}: cannot be read ({exc.strerror or exc})",
                                      path=str(self.root), source=self.name) from None
        return b"".join(parts)

    def read_runs_into(self, info: TensorInfo, runs: Sequence[tuple[int, int]], out: memoryview,
                       at: Sequence[int]) -> None:
        chunked = self._chunked.get(info.key)
        if chunked is None:
            return super().read_runs_into(info, runs, out, at)
        self._check_readable(info)
        width = info.row_nbytes
        for (first, count), pos in zip(runs, at, strict=True):
            self._checked_range(info, first * width, count * width)
            self._read_pieces(info, chunked, first * width, out[pos * width:(pos + count) * width])

    def local_segments(self, info: TensorInfo, start: int, length: int) -> list[tuple[Path, int, int]] | None:
        chunked = self._chunked.get(info.key)
        if chunked is None:
            return super().local_segments(info, start, length)
        self._checked_range(info, start, length)
        segments = []
        for piece in chunked.grid.pieces(start, length):
            file, data = chunked.places[piece.chunk]
            path = self.local_path(file)
            if path is None:
                return None
            segments.append((path, data + piece.at, piece.length))
        return segments

    def _read_pieces(self, info: TensorInfo, chunked: _Chunked, start: int, out: memoryview) -> None:
        try:
            for piece in chunked.grid.pieces(start, len(out)):
                file, data = chunked.places[piece.chunk]
                target = out[piece.out:piece.out + piece.length]
                if read_into(self._descriptor(file), target, data + piece.at) < piece.length:
                    raise self._truncated(TensorInfo(info.key, info.dtype, info.shape, file, data, info.nbytes))
        except OSError as exc:
            raise SourceNotFoundError(f"{self.root}: cannot be read ({exc.strerror or exc})",
                                      path=str(self.root), source=self.name) from None


def open_dcp(path: str | Path, *, name: str | None = None, location: str | None = None,
             cls: type[DcpCheckpoint] = DcpCheckpoint) -> DcpCheckpoint:
    """Index the DCP checkpoint in directory ``path`` from its metadata and chunk headers
    (``cls``: a subclass that reads more, Megatron's torch_dist)."""
    root = Path(path)
    try:
        return _open(root, location or str(path), name, cls)
    except CkptxformError as err:
        err.source = err.source or name
        raise
    except OSError as exc:
        where = exc.filename or root
        raise SourceNotFoundError(f"{where}: cannot be read ({exc.strerror or exc}); check that it is readable",
                                  path=str(where), source=name) from None


@dataclass(frozen=True)
class DcpListing:
    """A DCP directory's keys as its ``.metadata`` alone says them (``ckptxform inspect``):
    no chunk is opened. A tensor's ``file`` is its first chunk's, ``offset`` -1."""

    location: str
    files: tuple[str, ...]
    tensors: dict[str, TensorInfo]
    unread: tuple[Unread, ...]
    revision: None = None
    commit: None = None

    def __enter__(self) -> DcpListing:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def list_dcp(path: str | Path) -> DcpListing:
    root = Path(path)
    index = read_dcp_metadata(root)
    tensors, unread = {}, []
    for key, tensor in index.tensors.items():
        dtype = _dtype_or_torch(tensor.torch_dtype)
        reason = training_state_reason(key)
        if reason is not None:
            unread.append(Unread(key, dtype, tensor.shape, reason))
            continue
        size = nbytes(dtype, tensor.shape) if dtype in DTYPE_SIZES else 0
        held = sorted({c.file for c in tensor.chunks})
        where = held[0] if len(held) == 1 else f"{held[0]} +{len(held) - 1}" if held else ""
        tensors[key] = TensorInfo(key, dtype, tensor.shape, where, -1, size)
    unread += [Unread(key, "object", (), training_state_reason(key) or "a pickled Python object") for key in index.objects]
    files = sorted({c.file for t in index.tensors.values() for c in t.chunks})
    return DcpListing(str(path), tuple(files), tensors, tuple(unread))


def training_state_reason(key: str) -> str | None:
    """Why entry ``key`` of a trainer's checkpoint is not a model weight, or None."""
    head = key.split(".", 1)[0]
    if head in TRAINING_STATE:
        return f"{TRAINING_STATE[head]} saved by the trainer (entry {head!r}): not a model weight, never read"
    # Megatron's: "...linear_qkv._extra_state/shard_0_2", an expert's "..._extra_state/shard_0.3_2.4"
    if key.split("/", 1)[0].rsplit(".", 1)[-1].startswith("_extra_state"):
        return "a module's extra state (e.g. TransformerEngine's FP8 scaling metadata): not a weight, never read"
    return None


def _open(root: Path, location: str, name: str | None, cls: type[DcpCheckpoint]) -> DcpCheckpoint:
    pins: dict[str, FilePin] = {METADATA: pin_path(root / METADATA)}
    index = read_dcp_metadata(root)
    unread = [Unread(key, "object", (), training_state_reason(key) or "a pickled Python object, not a tensor: never read")
              for key in index.objects]
    weights: list[DcpTensor] = []
    for key, tensor in index.tensors.items():
        reason = training_state_reason(key)
        if reason is None:
            weights.append(tensor)
        else:
            unread.append(Unread(key, _dtype_or_torch(tensor.torch_dtype), tensor.shape, reason))
    files = sorted({chunk.file for tensor in weights for chunk in tensor.chunks})
    descriptors = {file: _open_chunk_file(root, file, pins) for file in files}
    try:
        tensors: dict[str, TensorInfo] = {}
        chunked: dict[str, _Chunked] = {}
        for tensor in weights:
            info, spread = _index_tensor(root, tensor, descriptors, pins)
            tensors[info.key] = info
            if spread is not None:
                chunked[info.key] = spread
    finally:
        for fd in descriptors.values():
            os.close(fd)
    ordered = dict(sorted(tensors.items(), key=lambda kv: (kv[1].file, _first_place(kv[0], kv[1], chunked))))
    return cls(location=location, name=name, root=root, tensors=ordered, files=tuple(files),
                         pins=pins, chunked=chunked, unread=tuple(unread), index=index)


def _first_place(key: str, info: TensorInfo, chunked: dict[str, _Chunked]) -> int:
    if key in chunked:
        return min((data for _, data in chunked[key].places), default=0)
    return info.offset


def _dtype_or_torch(torch_dtype: str) -> str:
    try:
        return from_torch_dtype(torch_dtype)
    except KeyError:
        return torch_dtype


def _open_chunk_file(root: Path, file: str, pins: dict[str, FilePin]) -> int:
    parts = PurePosixPath(file).parts
    if not parts or PurePosixPath(file).is_absolute() or ".." in parts or "\\" in file:
        raise CheckpointFormatError(f"{root / METADATA}: stores chunks in {quote(file)}, which is not a file name "
                                    "inside the checkpoint directory; the metadata is damaged or hostile",
                                    path=str(root / METADATA))
    path = root / file
    if not path.exists():
        raise SourceNotFoundError(f"{path}: named by {root / METADATA} but missing; copy every __R_N.distcp file "
                                  "of the checkpoint", path=str(path))
    check_inside(path, root)
    if not path.is_file():
        raise CheckpointFormatError(f"{path}: is not a regular file", path=str(path))
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    pins[file] = pin_fd(path, fd)
    return fd


def _index_tensor(root: Path, tensor: DcpTensor, descriptors: dict[str, int],
                  pins: dict[str, FilePin]) -> tuple[TensorInfo, _Chunked | None]:
    key = tensor.key
    try:
        dtype = from_torch_dtype(tensor.torch_dtype)
    except KeyError:
        raise CheckpointFormatError(f"{root / METADATA}: tensor {quote(key)} has dtype {tensor.torch_dtype}, which "
                                    "safetensors cannot hold", path=str(root / METADATA), key=key) from None
    size = DTYPE_SIZES[dtype]
    label = f"{root}: tensor {quote(key)}"
    names = [f"at {list(c.offsets)} ({c.file})" for c in tensor.chunks]
    grid = ChunkGrid(tensor.shape, size, [(c.offsets, c.sizes) for c in tensor.chunks], label=label, names=names)
    places = []
    for chunk, where in zip(tensor.chunks, names):
        chunk_label = f"{root / chunk.file}: tensor {quote(key)}, chunk {where.split(' (')[0]}"
        if chunk.offset + chunk.length > pins[chunk.file].size:
            raise short_chunk(chunk_label, pins[chunk.file].size - chunk.offset, chunk.length)
        data = tensor_data_offset(descriptors[chunk.file], chunk.offset, chunk.length, dtype=tensor.torch_dtype,
                                  shape=chunk.sizes, label=chunk_label)
        places.append((chunk.file, data))
    total = nbytes(dtype, tensor.shape)
    whole = [(c, p) for c, p in zip(tensor.chunks, places) if c.sizes == tensor.shape]
    if whole and total:
        file, data = whole[0][1]
        return TensorInfo(key, dtype, tensor.shape, file, data, total), None
    first = tensor.chunks[0].file if tensor.chunks else ""
    return TensorInfo(key, dtype, tensor.shape, first, -1, total), _Chunked(grid, tuple(places))
