"""Megatron-Core ``torch_dist`` checkpoints: a DCP directory (the tensors, tensor-parallel
shards already placed by their global offsets) plus ``metadata.json`` and ``common.pt``.

Megatron-LM's ``save_checkpoint`` writes ``latest_checkpointed_iteration.txt`` beside
``iter_NNNNNNN/``; either the save directory or an iteration directory opens. The model's
config is the training ``args`` Megatron-LM puts in ``common.pt`` (a ``torch.save``'d dict):
``config("common.pt")`` returns ``args`` as a flat dict of its plain values (numbers,
strings, booleans, lists; a torch dtype as its name), which a rule reads as
``${config.num_layers}``. ``common.pt`` is read with the restricted unpickler: only
``argparse.Namespace``, torch dtypes and plain containers are built; any other global (an
enum of Megatron's, a tensor's storage) becomes an inert placeholder that is never called
and never read, so nothing of the file is imported or run.
"""

from __future__ import annotations

import io
import math
import zipfile
from pathlib import Path
from typing import Any

from ckptxform.errors import CheckpointFormatError, quote
from ckptxform.fileio import read_small_file
from ckptxform.sources.dcp import DcpCheckpoint, open_dcp
from ckptxform.sources.kind import megatron_iteration
from ckptxform.sources.pins import pin_path
from ckptxform.sources.restricted_pickle import Named, Record, load_restricted
from ckptxform.sources.zip_members import read_member

COMMON = "common.pt"
#: common.pt holds args and small counters; a bound keeps a crafted one from filling memory
_MAX_COMMON = 64 << 20
#: and its pickle, however its zip member is compressed, inflates to no more than that
_MAX_PICKLE = _MAX_COMMON
_WHAT = "Megatron's common.pt"


class TorchDistCheckpoint(DcpCheckpoint):
    """A Megatron-Core torch_dist iteration directory; build it with ``open_torch_dist``."""

    kind = "torch_dist"

    def config(self, name: str = "config.json") -> dict[str, Any] | None:
        if name != COMMON:
            return super().config(name)
        path = self.root / COMMON
        if not path.is_file():
            return None
        self._pins[COMMON] = pin_path(path)
        return megatron_args(path)


def open_torch_dist(path: str | Path, *, name: str | None = None) -> TorchDistCheckpoint:
    root = Path(path)
    if (root / "latest_checkpointed_iteration.txt").is_file():
        root = megatron_iteration(root)
    ckpt = open_dcp(root, name=name, location=str(path), cls=TorchDistCheckpoint)
    assert isinstance(ckpt, TorchDistCheckpoint)
    return ckpt


def megatron_args(path: Path) -> dict[str, Any]:
    """The plain fields of the ``args`` Namespace Megatron-LM saved in ``common.pt``."""
    blob = read_small_file(path, _MAX_COMMON, what=_WHAT)
    try:
        archive = zipfile.ZipFile(io.BytesIO(blob))
        pkl = next(info for info in archive.infolist() if info.filename.endswith("data.pkl"))
    except (zipfile.BadZipFile, StopIteration, KeyError, ValueError, OSError, EOFError) as exc:
        raise CheckpointFormatError(f"{path}: is not the torch.save archive Megatron writes ({exc}); the file is "
                                    "damaged", path=str(path)) from None
    pickled = read_member(archive, pkl, _MAX_PICKLE, label=str(path), what=_WHAT)
    common = load_restricted(pickled, _Lenient(), label=str(path), what=_WHAT, persistent=lambda pid: _Inert())
    args = common.get("args") if isinstance(common, dict) else None
    if not isinstance(args, Record):
        raise CheckpointFormatError(f"{path}: holds no Megatron-LM 'args' (the training arguments the model's "
                                    "config is built from); save with Megatron-LM's save_checkpoint, or give the "
                                    "config another way", path=str(path))
    plain = {}
    for key, value in vars(args).items():
        if not isinstance(key, str) or not _is_text(key):
            raise CheckpointFormatError(f"{path}: args has a field named {quote(key)}, which is not text; the file "
                                        "is damaged or was not written by Megatron-LM", path=str(path))
        value = _plain(value, f"args.{key}", str(path), 0)
        if value is not _DROP:
            plain[key] = value
    return plain


_DROP = object()
#: a Megatron-LM argument is a number, a string or a short list of them
_MAX_DEPTH = 16
_MAX_INT = 1 << 64


def _plain(value: Any, field: str, path: str, depth: int) -> Any:
    """``value`` as plain data, or ``_DROP`` (an object of another kind); a value no config
    can hold (NaN, a number past 64 bits, text that is not UTF-8, a list nested past
    ``_MAX_DEPTH`` or holding itself) is refused naming ``field``."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if not -_MAX_INT <= value <= _MAX_INT:
            raise _bad_field(path, field, "is a number too large (more than 64 bits)")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _bad_field(path, field, f"is {value}, which a config (JSON) cannot hold")
        return value
    if isinstance(value, str):
        if not _is_text(value):
            raise _bad_field(path, field, "is not valid UTF-8 text")
        return value
    if isinstance(value, Named):
        return value.name
    if isinstance(value, (list, tuple)):
        if depth >= _MAX_DEPTH:
            raise _bad_field(path, field, f"is nested too deep (more than {_MAX_DEPTH} lists, or a list that holds "
                                          "itself)")
        items = [_plain(v, f"{field}[{i}]", path, depth + 1) for i, v in enumerate(value)]
        return _DROP if any(v is _DROP for v in items) else items
    return _DROP


def _is_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _bad_field(path: str, field: str, why: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{path}: {field} {why}; the file is damaged, or fix the argument and save the "
                                 "checkpoint again", path=path)


class _Inert:
    """What an unknown global of common.pt becomes: called or built, it stays inert."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Inert:
        return _Inert()

    def __setstate__(self, state: Any) -> None:
        pass


class _Lenient(dict):  # type: ignore[type-arg]
    """The globals common.pt may name: Namespace and dtypes as such, anything else inert."""

    def get(self, key: Any, default: Any = None) -> Any:
        module, name = key
        if (module, name) == ("argparse", "Namespace"):
            return Record
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name[:1].islower():
            return Named("torch", name)
        return _Inert
