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
import zipfile
from pathlib import Path
from typing import Any

from ckptxform.errors import CheckpointFormatError
from ckptxform.fileio import read_small_file
from ckptxform.sources.dcp import DcpCheckpoint, open_dcp
from ckptxform.sources.kind import megatron_iteration
from ckptxform.sources.pins import pin_path
from ckptxform.sources.restricted_pickle import Named, Record, load_restricted

COMMON = "common.pt"
#: common.pt holds args and small counters; a bound keeps a crafted one from filling memory
_MAX_COMMON = 64 << 20
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
        pkl = next(n for n in archive.namelist() if n.endswith("data.pkl"))
        pickled = archive.read(pkl)
    except (zipfile.BadZipFile, StopIteration, KeyError) as exc:
        raise CheckpointFormatError(f"{path}: is not the torch.save archive Megatron writes ({exc}); the file is "
                                    "damaged", path=str(path)) from None
    common = load_restricted(pickled, _Lenient(), label=str(path), what=_WHAT, persistent=lambda pid: _Inert())
    args = common.get("args") if isinstance(common, dict) else None
    if not isinstance(args, Record):
        raise CheckpointFormatError(f"{path}: holds no Megatron-LM 'args' (the training arguments the model's "
                                    "config is built from); save with Megatron-LM's save_checkpoint, or give the "
                                    "config another way", path=str(path))
    return {k: v for k, v in ((k, _plain(v)) for k, v in vars(args).items()) if v is not _DROP}


_DROP = object()


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Named):
        return value.name
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return _DROP if any(v is _DROP for v in items) else items
    return _DROP


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
