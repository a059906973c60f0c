"""Checkpoints on the local disk, indexed from headers only and read by byte range.

``open_local`` accepts what people have on disk (which files that is: ``local_layout``).
Safetensors are indexed with two ``os.pread`` calls per file (a sharded checkpoint's
shard by shard, when one of its tensors is first asked for) and read by byte range; a
``.bin`` in torch's zip format is indexed from its pickle, read with an allow-list that
runs no pickled code, and read by byte range too; a legacy one is loaded with
``torch.load(weights_only=True)`` (``ckptxform.sources.torch_bin``). Every file read is
pinned, so a file replaced or rewritten under the run fails it.

Example::

    with open_local("stand-ins/drafter") as ckpt:
        info = ckpt.tensors["lm_head.weight"]
        first_row = ckpt.read(info, 0, info.row_nbytes)
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptxform.errors import (
    CheckpointFormatError,
    CkptxformError,
    SourceNotFoundError,
    UsageError,
    quote_keys,
)
from ckptxform.fileio import MAX_PREAD, read_into, read_small_file
from ckptxform.sources.base import Checkpoint, TensorInfo
from ckptxform.sources.file_listing import local_files
from ckptxform.sources.header_columns import ShardColumns
from ckptxform.sources.lazy_index import LazyShards, LazyTensors, weak_loader
from ckptxform.sources.local_layout import Layout, check_inside, find_layout
from ckptxform.sources.pins import FilePin, changed_error, pin_fd, pin_path
from ckptxform.sources.safetensors_header import (
    check_index_matches_shards,
    checked_header_columns,
    header_length,
    read_header_columns,
)
from ckptxform.sources.strict_json import parse_json_object

if TYPE_CHECKING:
    from ckptxform.sources.torch_zip import StridedTensor

CONFIG = "config.json"
#: a model's config.json is a few KiB; a bound keeps a crafted one from filling memory
MAX_CONFIG_BYTES = 16 << 20


def open_local(path: str | Path, *, name: str | None = None) -> Checkpoint:
    """Index the checkpoint at ``path`` from its headers. ``name`` (the source's name in
    the rule file) is set as ``source`` on any error raised.

    >>> ckpt = open_local("out/drafter")            # doctest: +SKIP
    >>> ckpt.tensors["fc.weight"].shape             # doctest: +SKIP
    (64, 192)
    """
    try:
        return _open(Path(path), location=str(path), name=name)
    except CkptxformError as err:
        err.source = err.source or name
        raise
    except OSError as exc:  # permissions, I/O errors, a directory where a file belongs
        raise _unreadable(exc, path, source=name) from None


def has_weights(directory: Path) -> bool:
    """Whether ``directory`` holds any weight file (safetensors, .bin/.pt/.pth)."""
    return any(p.name.endswith((".safetensors", ".bin", ".pt", ".pth")) for p in directory.iterdir())


def open_assets(path: str | Path, *, name: str | None = None) -> LocalCheckpoint:
    """A directory of a model's config.json and tokenizer files without weights (what
    torchtitan's ``--hf_assets_path`` names): a source of config and files, no tensors."""
    root = Path(path)
    return LocalCheckpoint(location=str(path), name=name, root=root, tensors={}, files=(), metadata={},
                           bin_tensors={}, pins={})


class LocalCheckpoint(LazyShards):
    """A checkpoint on the local disk; build it with ``open_local``. Safetensors bytes
    are read with ``os.pread`` on one descriptor per file, opened at its first read; a
    sharded one's headers are read shard by shard as its tensors are asked for
    (``LazyTensors``), so a plan of two shards of a 60-shard verifier reads two headers.
    A ``.bin`` tensor without a byte range (``offset == -1``) is read from what torch
    loaded (a legacy non-zip pickle: ``local_path`` is None) or gathered from its storage
    (a strided view)."""

    def __init__(
        self,
        *,
        location: str,
        name: str | None,
        root: Path,
        tensors: Mapping[str, TensorInfo],
        files: tuple[str, ...],
        metadata: Mapping[str, Mapping[str, str]],
        bin_tensors: Mapping[str, Mapping[str, Any]],
        pins: Mapping[str, FilePin],
        strided: Mapping[str, Mapping[str, StridedTensor]] | None = None,
    ) -> None:
        self.location = location
        self.name = name
        #: the directory file names are relative to
        self.root = root
        self.tensors = tensors
        self.files = files
        #: each safetensors file's ``__metadata__`` (e.g. ``{"format": "pt"}``)
        self.metadata: dict[str, Mapping[str, str]] = dict(metadata)
        self._descriptors: dict[str, int] = {}
        #: each file's resolved path, once asked for (a gather asks once a row run: the 2 GB
        #: headline resolved 14,192 times, 85,853 lstat calls)
        self._resolved: dict[str, Path] = {}
        self._bin_tensors = bin_tensors
        self._strided = strided or {}
        #: every file read so far (weight files, index, config.json), keyed by relative name
        self._pins = dict(pins)
        self._lock = threading.Lock()
        self._closed = False

    def config(self, name: str = CONFIG) -> dict[str, Any] | None:
        path = self.root / name
        if not path.exists():
            return None
        check_inside(path, self.root)
        try:
            self._pins[CONFIG] = pin_path(path)  # before reading: a later write must show
            return _load_config(path)
        except CkptxformError:
            raise  # already one clear line (a FIFO, a duplicate key...)
        except OSError as exc:
            raise _unreadable(exc, path, source=self.name) from None

    def read(self, info: TensorInfo, start: int = 0, length: int | None = None) -> bytes:
        length = self._checked_range(info, start, length)
        self._check_readable(info)
        if length == 0:
            return b""
        if info.file in self._bin_tensors:
            from ckptxform.sources.torch_bin import tensor_bytes

            return tensor_bytes(self._bin_tensors[info.file][info.key], start, length)
        view = self._strided.get(info.file, {}).get(info.key)
        if view is not None:
            try:
                blob = view.read(self._descriptor(info.file), start, length)
            except OSError as exc:
                raise _unreadable(exc, self.root / info.file, source=self.name) from None
            if blob is None:
                raise self._truncated(info)
            return blob
        try:
            blob = _pread(self._descriptor(info.file), info.offset + start, length)
        except OSError as exc:
            raise _unreadable(exc, self.root / info.file, source=self.name) from None
        if len(blob) != length:
            raise self._truncated(info)
        return blob

    def read_runs_into(self, info: TensorInfo, runs: Sequence[tuple[int, int]], out: memoryview,
                       at: Sequence[int]) -> None:
        if info.offset < 0 or not runs:
            return super().read_runs_into(info, runs, out, at)
        width = info.row_nbytes
        low, high = min(first for first, _ in runs), max(first + count for first, count in runs)
        self._checked_range(info, low * width, (high - low) * width)
        _check_places(runs, at, width, len(out))
        self._check_readable(info)
        try:
            fd = self._descriptor(info.file)
            for (first, count), pos in zip(runs, at, strict=True):
                # straight into place: no intermediate bytes object, no second copy
                if read_into(fd, out[pos * width:(pos + count) * width], info.offset + first * width) < count * width:
                    raise self._truncated(info)
        except OSError as exc:
            raise _unreadable(exc, self.root / info.file, source=self.name) from None

    def _check_readable(self, info: TensorInfo) -> None:
        if self.tensors.get(info.key) != info:
            raise UsageError(
                f"{self.location}: tensor {info.key!r} of file {info.file!r} is not part of "
                "this checkpoint; read a TensorInfo taken from its .tensors",
                key=info.key,
            )
        if self._closed:
            raise UsageError(f"{self.location}: read after close(); open the checkpoint again")

    def _truncated(self, info: TensorInfo) -> CheckpointFormatError:
        return CheckpointFormatError(
            f"{self.root / info.file}: file ends before the end of tensor {info.key!r}; "
            "it was truncated after it was indexed (re-download it)",
            path=str(self.root / info.file),
            key=info.key,
        )

    def list_files(self) -> tuple[str, ...]:
        return local_files(self.root, label=self.location)

    def file_path(self, name: str) -> Path:
        path = self.root / name
        check_inside(path, self.root)
        return path

    def local_path(self, file: str) -> Path | None:
        if file not in self.files or file in self._bin_tensors:
            return None
        path = self._resolved.get(file)
        if path is None:
            path = self._resolved[file] = (self.root / file).resolve()
        return path

    def pins(self) -> tuple[FilePin, ...]:
        return tuple(self._pins[name] for name in sorted(self._pins))

    def local_paths(self) -> tuple[Path, ...]:
        return (Path(self.location).resolve(), *(Path(pin.path) for pin in self.pins()))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for fd in self._descriptors.values():
                os.close(fd)
            self._descriptors.clear()
            self._bin_tensors, self._strided = {}, {}

    def raw_header(self, file: str) -> bytes:
        if file not in self.files or file in self._bin_tensors or not file.endswith(".safetensors"):
            return super().raw_header(file)
        self.tensors_of_file(file)  # its header read and the file pinned, if not yet
        label = str(self.root / file)
        try:
            fd = self._descriptor(file)  # refuses a file changed since it was pinned
            n = header_length(_pread(fd, 0, 8), file_size=self._pins[file].size, label=label)
            blob = _pread(fd, 0, 8 + n)
        except OSError as exc:
            raise _unreadable(exc, label, source=self.name) from None
        if len(blob) != 8 + n:
            raise CheckpointFormatError(f"{label}: file ends inside its header; it was truncated after it was "
                                        "indexed (re-download it)", path=label)
        return blob

    def _load_shard(self, index: str, file: str) -> ShardColumns:
        """The tensors of shard ``file`` from its header, read now (the file pinned the
        first time, checked against its pin after), checked against what ``index`` maps to it."""
        try:
            assert isinstance(self.tensors, LazyTensors)
            if self.tensors.is_loaded(file):  # read and checked before, then dropped
                return _read_header_again(self.root, file, self._pins[file])
            columns, self.metadata[file] = _read_one_header(self.root, file, self._pins)
            self.tensors.check_shard(file, columns, label=index)
        except CkptxformError as err:  # raised while planning, far from open_local
            err.source = err.source or self.name
            raise
        except OSError as exc:
            raise _unreadable(exc, self.root / file, source=self.name) from None
        return columns

    def _descriptor(self, file: str) -> int:
        with self._lock:
            if file not in self._descriptors:
                fd = os.open(self.root / file, os.O_RDONLY | os.O_CLOEXEC)
                moved = self._pins[file].difference(pin_fd(self.root / file, fd))
                if moved is not None:  # replaced or rewritten since its header was read
                    os.close(fd)
                    raise changed_error(self._pins[file].path, moved)
                self._descriptors[file] = fd
            return self._descriptors[file]


def _open(path: Path, *, location: str, name: str | None) -> Checkpoint:
    layout = find_layout(path)
    if layout.model_parallel:
        from ckptxform.sources.model_parallel import open_model_parallel

        return open_model_parallel(
            layout.root, layout.files, location=location, name=name,
            open_file=lambda file: _open_layout(Layout(layout.root, "bin", (file,)), location=location, name=name))
    return _open_layout(layout, location=location, name=name)


def _open_layout(layout: Layout, *, location: str, name: str | None) -> LocalCheckpoint:
    for file in layout.files:
        shard = layout.root / file
        if not shard.exists():
            keys = [k for k, s in (layout.weight_map or {}).items() if s == file]  # an error: read again
            raise SourceNotFoundError(
                f"{layout.index}: maps {quote_keys(keys, 3)} to shard {file!r}, which does "
                f"not exist in {layout.root}; download the missing shard or fix the index",
                path=str(shard),
                key=sorted(keys)[0] if keys else None,
            )
        if layout.confined:
            check_inside(shard, layout.root)
        if not shard.is_file():
            raise CheckpointFormatError(
                f"{shard}: is not a regular file; give a checkpoint file or directory",
                path=str(shard),
            )
    pins: dict[str, FilePin] = {}
    if layout.index is not None and layout.index_pin is not None:
        pins[layout.index.name] = layout.index_pin
    if layout.kind == "safetensors" and layout.weight_map is not None and layout.index is not None:
        # Sharded: no header read yet (each shard's when one of its tensors is asked for);
        # every shard the index names exists (checked above: a stat, not a read).
        ckpt = LocalCheckpoint(location=location, name=name, root=layout.root, tensors={}, files=layout.files,
                               metadata={}, bin_tensors={}, pins=pins)
        ckpt.tensors = LazyTensors(layout.weight_map, layout.files,
                                   functools.partial(weak_loader(ckpt._load_shard), str(layout.index)))
        return ckpt
    if layout.kind == "safetensors":
        per_file, metadata = _read_safetensors_headers(layout, pins)
        bin_tensors: dict[str, dict[str, Any]] = {}
        strided: dict[str, dict[str, StridedTensor]] = {}
    else:
        pins.update((f, pin_path(layout.root / f)) for f in layout.files)  # before loading
        from ckptxform.sources.torch_bin import index_bin  # zipfile, pickle: for .bin/.pth only

        bin_tensors, strided, per_file = {}, {}, {}
        for f in layout.files:
            indexed = index_bin(layout.root / f, f)
            per_file[f] = indexed.infos
            if indexed.loaded:  # torch loaded it: every tensor is read from the load
                bin_tensors[f] = indexed.loaded
            if indexed.strided:
                strided[f] = indexed.strided
        metadata = {}
    if layout.weight_map is not None:
        check_index_matches_shards(
            layout.weight_map,
            {f: [t.key for t in infos] for f, infos in per_file.items()},
            label=str(layout.index),
        )
    tensors = {t.key: t for f in layout.files for t in per_file[f]}
    return LocalCheckpoint(
        location=location,
        name=name,
        root=layout.root,
        tensors=tensors,
        files=layout.files,
        metadata=metadata,
        bin_tensors=bin_tensors,
        pins=pins,
        strided=strided,
    )


def _unreadable(exc: OSError, path: str | Path, *, source: str | None) -> SourceNotFoundError:
    where = exc.filename or path
    return SourceNotFoundError(
        f"{where}: cannot be read ({exc.strerror or exc}); check that it is a readable file",
        path=str(where),
        source=source,
    )


def _read_safetensors_headers(
    layout: Layout, pins: dict[str, FilePin],
) -> tuple[dict[str, list[TensorInfo]], dict[str, dict[str, str]]]:
    # Descriptors are closed after the header: a plan may read a single shard of a
    # 60-shard verifier, and ``read`` opens only the files it needs.
    per_file: dict[str, list[TensorInfo]] = {}
    metadata: dict[str, dict[str, str]] = {}
    for file in layout.files:
        columns, metadata[file] = _read_one_header(layout.root, file, pins)
        per_file[file] = columns.infos()
    return per_file, metadata


def _read_one_header(root: Path, file: str, pins: dict[str, FilePin]) -> tuple[ShardColumns, dict[str, str]]:
    """The tensors and ``__metadata__`` of safetensors ``file``, the file pinned in ``pins``."""
    fd = os.open(root / file, os.O_RDONLY | os.O_CLOEXEC)
    try:
        pins[file] = pin_fd(root / file, fd)
        return read_header_columns(functools.partial(_pread, fd), file=file, file_size=pins[file].size,
                                   label=str(root / file))
    finally:
        os.close(fd)


def _read_header_again(root: Path, file: str, pin: FilePin) -> ShardColumns:
    """The tensors of safetensors ``file``, whose header was read and checked when it was
    pinned: refused if the file changed since, else read without the checks again."""
    fd = os.open(root / file, os.O_RDONLY | os.O_CLOEXEC)
    try:
        moved = pin.difference(pin_fd(root / file, fd))
        if moved is not None:
            raise changed_error(pin.path, moved)
        n = int.from_bytes(_pread(fd, 0, 8), "little")
        blob = _pread(fd, 8, n)
        if len(blob) != n:  # cannot be, the file unchanged; a read error all the same
            raise OSError(f"{file}: short read of its header")
        return checked_header_columns(blob, file=file)
    finally:
        os.close(fd)


def _check_places(runs: Sequence[tuple[int, int]], at: Sequence[int], width: int, room: int) -> None:
    """Each run fits ``out`` where it goes (a short buffer would otherwise get fewer bytes)."""
    if len(runs) != len(at):
        raise UsageError(f"read_runs_into: {len(runs)} runs but {len(at)} places")
    for (_, count), pos in zip(runs, at):
        if count < 0 or pos < 0 or (pos + count) * width > room:
            raise UsageError(f"read_runs_into: rows [{pos}, {pos + count}) of {width} bytes do not fit "
                             f"a buffer of {room} bytes")


def _pread(fd: int, offset: int, length: int) -> bytes:
    """``length`` bytes from ``offset``, or fewer at the end of the file."""
    parts: list[bytes] = []
    while length > 0:
        part = os.pread(fd, min(length, MAX_PREAD), offset)
        if not part:
            break
        parts.append(part)
        offset += len(part)
        length -= len(part)
    return b"".join(parts)


def _load_config(path: Path) -> dict[str, Any]:
    blob = read_small_file(path, MAX_CONFIG_BYTES, what="a config.json")
    config = parse_json_object(blob, str(path), what="config", fix="fix or remove the file")
    try:  # a value's "\ud800" escape parses, but no UTF-8 config.json can hold it
        json.dumps(config, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise CheckpointFormatError(f"{path}: config holds a lone surrogate escape (such as \\ud800), which is "
                                    "not valid Unicode; fix or remove the file", path=str(path)) from None
    return config
