"""Which files make up a checkpoint on the local disk, decided before a weight file is read:
a ``.safetensors`` file; a directory holding, in transformers' order, a safetensors shard
index, ``model.safetensors``, a single other ``*.safetensors``, a ``.bin`` shard index,
``pytorch_model.bin`` or Meta's ``consolidated.NN.pth`` model-parallel shards; a shard index given by path; a ``.bin``/``.pt``/``.pth`` file. A link
that leads out of the checkpoint directory is refused (``check_inside``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ckptxform.errors import CheckpointFormatError, SourceNotFoundError, quote_keys
from ckptxform.fileio import read_small_file
from ckptxform.sources.model_parallel import shard_files
from ckptxform.sources.pins import FilePin, changed_error, pin_path
from ckptxform.sources.safetensors_header import MAX_HEADER_BYTES, parse_index_json
from ckptxform.sources.shard_index import open_shard_index

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"
_BIN_SUFFIXES = (".bin", ".pt", ".pth")
_LOOKED_FOR = (SAFETENSORS_INDEX, SAFETENSORS_SINGLE, "*.safetensors", BIN_INDEX, BIN_SINGLE, "consolidated.NN.pth")


@dataclass(frozen=True)
class Layout:
    """Which files make up a checkpoint, before any of them is read."""

    root: Path
    kind: Literal["safetensors", "bin"]
    files: tuple[str, ...]
    #: the shard index and its weight map, for sharded checkpoints
    index: Path | None = None
    weight_map: Mapping[str, str] | None = None
    index_pin: FilePin | None = None
    #: the files were found by looking into ``root``: refuse links that leave it
    confined: bool = True
    #: each file holds one rank's piece of every tensor (Meta's consolidated.NN.pth)
    model_parallel: bool = False


def find_layout(path: Path) -> Layout:
    if not path.exists():
        raise SourceNotFoundError(
            f"{path}: does not exist; give a local directory or file, or a Hub repo "
            "ORG/NAME[@REVISION]",
            path=str(path),
        )
    if path.is_dir():
        return _directory_layout(path)
    name = path.name
    if name.endswith(".safetensors.index.json"):
        return _index_layout(path, "safetensors")
    if name.endswith(".bin.index.json"):
        return _index_layout(path, "bin")
    # A file the user names is read even if it is a link: they chose it.
    if name.endswith(".safetensors"):
        return Layout(path.parent, "safetensors", (name,), confined=False)
    if name.endswith(_BIN_SUFFIXES):
        return Layout(path.parent, "bin", (name,), confined=False)
    raise CheckpointFormatError(
        f"{path}: not a checkpoint file; give a .safetensors, .bin, .pt or .pth file, a "
        "*.index.json shard index, or the directory holding them",
        path=str(path),
    )


def _directory_layout(directory: Path) -> Layout:
    # The order is transformers': a safetensors index, model.safetensors, then .bin.
    # Files an index does not name (e.g. Mistral's consolidated.safetensors) are ignored.
    if (directory / SAFETENSORS_INDEX).exists():
        return _index_layout(directory / SAFETENSORS_INDEX, "safetensors")
    if (directory / SAFETENSORS_SINGLE).exists():
        return Layout(directory, "safetensors", (SAFETENSORS_SINGLE,))
    singles = sorted(p.name for p in directory.iterdir() if p.name.endswith(".safetensors"))
    if len(singles) == 1:
        return Layout(directory, "safetensors", (singles[0],))
    if len(singles) > 1:
        raise SourceNotFoundError(
            f"{directory}: holds {len(singles)} .safetensors files ({quote_keys(singles, 4)}) "
            f"but no {SAFETENSORS_INDEX} saying which tensors each holds; download the "
            "index, or give one file's path",
            path=str(directory),
        )
    if (directory / BIN_INDEX).exists():
        return _index_layout(directory / BIN_INDEX, "bin")
    if (directory / BIN_SINGLE).exists():
        return Layout(directory, "bin", (BIN_SINGLE,))
    shards = shard_files(directory)
    if shards:
        return Layout(directory, "bin", shards, model_parallel=len(shards) > 1)
    raise SourceNotFoundError(
        f"{directory}: no checkpoint weights found (looked for {', '.join(_LOOKED_FOR)}); "
        "give the directory or file that holds the weights",
        path=str(directory),
    )


def _index_layout(index: Path, kind: Literal["safetensors", "bin"]) -> Layout:
    root = index.parent
    check_inside(index, root)
    pin = pin_path(index)  # before reading: a later write must show
    read = functools.partial(read_small_file, index, MAX_HEADER_BYTES, what="a shard index")
    if kind == "safetensors":  # scanned, no dict of every key (a .bin source holds them all anyway)
        weight_map: Mapping[str, str] = open_shard_index(index, label=str(index), shard_suffix=f".{kind}",
                                                         limit=MAX_HEADER_BYTES, read_bytes=read,
                                                         check=functools.partial(_check_pin, pin))
        files = weight_map.files  # type: ignore[attr-defined]
    else:
        # the bytes passed inline: parse_index_json frees them once decoded
        weight_map = parse_index_json(read(), label=str(index), shard_suffix=f".{kind}")
        files = tuple(sorted(set(weight_map.values())))
    return Layout(root, kind, files, index=index, weight_map=weight_map, index_pin=pin)


def _check_pin(pin: FilePin) -> None:
    """Refuse a file read again that changed since it was pinned."""
    moved = pin.difference(pin_path(pin.path))
    if moved is not None:
        raise changed_error(pin.path, moved)


def check_inside(path: Path, root: Path) -> None:
    """Refuse a file that is a link leading out of the checkpoint directory: a crafted
    repo could otherwise make us read, and copy into the output, any file of the host."""
    real_root = root.resolve()
    allowed = [real_root]
    # The Hugging Face cache links snapshots/REV/FILE to ../../blobs/HASH: that is home.
    if real_root.parent.name == "snapshots":
        allowed.append(real_root.parent.parent / "blobs")
    real = path.resolve()
    if not any(real.is_relative_to(a) for a in allowed):
        raise CheckpointFormatError(
            f"{path}: links to {real}, outside the checkpoint directory {real_root}; "
            "replace the link with the file itself",
            path=str(path),
        )
