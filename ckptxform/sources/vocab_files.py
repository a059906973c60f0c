"""Read a draft-vocabulary map (``d2t``, optionally ``t2d``) from a standalone file.

A rule can take a vocabulary map from a file instead of a checkpoint source: a
``.safetensors`` file (a whole drafter's ``model.safetensors`` works: only the header and
the ``d2t``/``t2d`` bytes are read), a pickled ``.pt``/``.pth``/``.bin`` as SpecForge
writes its vocab-mapping files, ``d2t.npy`` (with ``t2d.npy`` beside it, or a folder
holding both) as speculators writes them, or ``.json``. Each format is decoded into the values
``VocabMap.from_d2t`` checks; the map's logic lives in ``ckptxform.vocab.maps``.

speculators (since vllm-project/speculators#1081) names its cached maps by the draft
vocabulary size, ``d2t-32000.npy`` and ``t2d-32000.npy``: that size is checked against
d2t. SGLang's hot-token map (``--speculative-token-map``, FR-Spec's ``freq_32768.pt``) is a
``.pt`` holding the hot target ids themselves, a list or a tensor (SGLang's
``load_token_map``: ``torch.tensor(torch.load(path, weights_only=True))``), read as d2t with
``encoding: absolute``; it has no t2d, and its ids need not be ascending.

Only ``.pt``/``.pth``/``.bin`` files import torch, lazily, so ``plan`` with a safetensors
or JSON vocab file stays torch-free.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ckptxform.errors import (
    CheckpointFormatError,
    SourceNotFoundError,
    UsageError,
    VocabMapError,
    quote,
)
from ckptxform.fileio import refuse_non_regular
from ckptxform.sources.safetensors_header import read_header
from ckptxform.sources.strict_json import parse_json
from ckptxform.vocab.maps import Encoding, VocabMap, vocab_map_from_bytes

__all__ = ["load_vocab_file"]

#: speculators' vocabulary-map files: ``d2t.npy``/``t2d.npy``, or named by the draft
#: vocabulary size, ``d2t-32000.npy``/``t2d-32000.npy`` (group 1: the size)
_NPY_D2T, _NPY_T2D = "d2t.npy", "t2d.npy"
_NPY_SIZED = re.compile(r"^d2t-([0-9]+)\.npy$")


def load_vocab_file(
    path: str | Path,
    *,
    name: str,
    encoding: Encoding,
    vocab_size: int | None = None,
) -> VocabMap:
    """A ``VocabMap`` from a standalone vocabulary file holding ``d2t`` (and optionally
    ``t2d``): ``.safetensors``; ``.pt``/``.pth``/``.bin`` (a dict with ``d2t``/``t2d`` or
    a bare ``d2t`` tensor, as SpecForge's vocab-mapping files; loaded with
    ``weights_only=True``; a list of target ids, SGLang's hot-token map, read with
    ``encoding="absolute"``); ``.npy`` (numpy arrays, no pickles: a ``d2t.npy`` reads
    ``t2d.npy`` beside it when there is one, a ``d2t-N.npy`` its ``t2d-N.npy``; a folder
    means its one ``d2t.npy`` or ``d2t-N.npy``); or ``.json``
    (a list of ints or ``{"d2t": [...], "t2d": [...]}``).

    >>> load_vocab_file("vocab_mapping.pt", name="k25", encoding="offset")  # doctest: +SKIP
    """
    path = Path(path)
    if path.is_dir():
        path = _d2t_in_folder(path)
    refuse_non_regular(path)  # a FIFO exists but would block its reader
    if not path.is_file():
        raise SourceNotFoundError(
            f"vocab file {quote(str(path))} does not exist; fix: check the path", path=str(path)
        )
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        return _load_safetensors(path, name, encoding, vocab_size)
    if suffix in (".pt", ".pth", ".bin"):
        return _load_torch(path, name, encoding, vocab_size)
    if suffix == ".json":
        return _load_json(path, name, encoding, vocab_size)
    if suffix == ".npy":
        return _load_npy(path, name, encoding, vocab_size)
    raise UsageError(
        f"vocab file {quote(str(path))}: unsupported file type {suffix or '(none)'!r}; fix: give a "
        ".safetensors, .pt, .pth, .bin, .npy or .json file holding d2t",
        path=str(path),
    )


def _load_safetensors(
    path: Path, name: str, encoding: Encoding, vocab_size: int | None
) -> VocabMap:
    """Reads the header (with the project's strict header parser) and only the d2t/t2d
    bytes, so a whole drafter's model.safetensors works as a vocab file too."""
    size = path.stat().st_size
    with path.open("rb") as f:

        def read_at(offset: int, length: int) -> bytes:
            f.seek(offset)
            return f.read(length)

        infos, _ = read_header(read_at, file=path.name, file_size=size, label=f"vocab file {quote(str(path))}")
        raw: dict[str, tuple[bytes, str]] = {}
        for info in infos:
            if info.key in ("d2t", "t2d"):
                _check_one_dim(path, info.key, info.shape)
                raw[info.key] = (read_at(info.offset, info.nbytes), info.dtype)
    if "d2t" not in raw:
        tensors = ", ".join(repr(i.key) for i in sorted(infos, key=lambda i: i.key))
        raise VocabMapError(
            f"vocab file {quote(str(path))} has no tensor 'd2t' (has: {tensors or '(none)'}); fix: "
            "give a file holding the drafter's d2t",
            path=str(path),
            key="d2t",
        )
    t2d_raw, t2d_dtype = raw.get("t2d", (None, None))
    return vocab_map_from_bytes(
        name,
        raw["d2t"][0],
        raw["d2t"][1],
        t2d_raw,
        t2d_dtype,
        encoding=encoding,
        vocab_size=vocab_size,
        origin=f"file {quote(str(path))}",
    )


def _check_one_dim(path: Path, key: str, shape: Sequence[int]) -> None:
    if len(shape) != 1:
        expected = "[draft_vocab]" if key == "d2t" else "[vocab]"
        raise VocabMapError(
            f"vocab file {quote(str(path))}: tensor {key!r} has shape {list(shape)}; fix: {key} must "
            f"be one-dimensional, {expected}",
            path=str(path),
            key=key,
        )


def _first_line(err: BaseException) -> str:
    """The first line of ``err``'s message, or its type's name when it has none."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _load_torch(path: Path, name: str, encoding: Encoding, vocab_size: int | None) -> VocabMap:
    import pickle
    import warnings

    import torch

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns of pickle protocols it "might not support"
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a damaged file: torch raises anything from KeyError to AssertionError
        first_line = _first_line(err)
        if not isinstance(err, (pickle.UnpicklingError, RuntimeError, EOFError, ValueError)):
            first_line = f"{type(err).__name__}: {first_line}"
        raise CheckpointFormatError(
            f"vocab file {quote(str(path))} cannot be loaded with weights_only=True ({first_line}); "
            "fix: save the map as plain tensors (torch.save({'d2t': d2t, 't2d': t2d}, ...))",
            path=str(path),
        ) from None
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(v, int) and not isinstance(v, bool) for v in obj):
        obj = torch.tensor(obj, dtype=torch.int64)  # SGLang's hot-token map: a list of target ids
    tensors = {"d2t": obj} if isinstance(obj, torch.Tensor) else obj
    if not isinstance(tensors, dict) or not isinstance(tensors.get("d2t"), torch.Tensor):
        found = (
            ", ".join(repr(k) for k in sorted(map(str, tensors)))
            if isinstance(tensors, dict)
            else type(obj).__name__
        )
        raise VocabMapError(
            f"vocab file {quote(str(path))} holds no tensor 'd2t' (found: {found or '(none)'}); fix: "
            "give a dict with a 'd2t' tensor (and optionally 't2d'), a bare d2t tensor or a list of target ids",
            path=str(path),
            key="d2t",
        )
    d2t = tensors["d2t"]
    t2d = tensors.get("t2d")
    _check_one_dim(path, "d2t", tuple(d2t.shape))
    if d2t.is_floating_point() or d2t.is_complex() or d2t.dtype == torch.bool:
        raise VocabMapError(
            f"vocab file {quote(str(path))}: d2t has dtype {d2t.dtype}; fix: d2t must be an integer "
            "tensor (torch.int64)",
            path=str(path),
            key="d2t",
        )
    flags = None
    if t2d is not None:  # a t2d given in another form is refused, not read as "no t2d"
        if not isinstance(t2d, torch.Tensor):
            raise VocabMapError(
                f"vocab file {quote(str(path))}: t2d is a {type(t2d).__name__}, not a tensor; fix: t2d must be a "
                "boolean tensor, one flag per target id (or leave it out)",
                path=str(path),
                key="t2d",
            )
        _check_one_dim(path, "t2d", tuple(t2d.shape))
        flags = t2d.tolist()
    return VocabMap.from_d2t(
        name,
        d2t.tolist(),
        encoding=encoding,
        vocab_size=vocab_size,
        t2d=flags,
        origin=f"file {quote(str(path))}",
    )


def _load_json(path: Path, name: str, encoding: Encoding, vocab_size: int | None) -> VocabMap:
    data = parse_json(path.read_bytes(), f"vocab file {quote(str(path))}", what="its text",
                      fix='fix: give a list of ints or {"d2t": [...], "t2d": [...]}')
    d2t, t2d = (data, None) if isinstance(data, list) else (None, None)
    if isinstance(data, dict):
        d2t, t2d = data.get("d2t"), data.get("t2d")
    if not isinstance(d2t, list) or (t2d is not None and not isinstance(t2d, list)):
        raise VocabMapError(
            f"vocab file {quote(str(path))} holds no d2t list; fix: give a list of ints or "
            '{"d2t": [...], "t2d": [...]}',
            path=str(path),
            key="d2t",
        )
    for i, v in enumerate(d2t):
        if isinstance(v, bool) or not isinstance(v, int):
            raise VocabMapError(
                f"vocab file {quote(str(path))}: d2t[{i}] is {v!r}, not an integer; fix: d2t must be "
                "a list of integers",
                path=str(path),
                key="d2t",
            )
    return VocabMap.from_d2t(
        name, d2t, encoding=encoding, vocab_size=vocab_size, t2d=t2d, origin=f"file {quote(str(path))}"
    )


def _d2t_in_folder(folder: Path) -> Path:
    """The one d2t file of a speculators vocab-mapping folder: ``d2t.npy`` or ``d2t-N.npy``."""
    found = sorted(p.name for p in folder.iterdir() if p.name == _NPY_D2T or _NPY_SIZED.match(p.name))
    if len(found) > 1:
        raise UsageError(
            f"vocab file {quote(str(folder))}: the folder holds {len(found)} d2t files "
            f"({', '.join(map(repr, found))}), one per draft vocabulary size; fix: give the path of the one "
            "the drafter was trained with", path=str(folder))
    return folder / (found[0] if found else _NPY_D2T)


def _load_npy(path: Path, name: str, encoding: Encoding, vocab_size: int | None) -> VocabMap:
    d2t = _npy_array(path, "d2t")
    sized = _NPY_SIZED.match(path.name)
    if sized is not None and len(d2t) != int(sized.group(1)):
        raise VocabMapError(
            f"vocab file {quote(str(path))}: its name says {int(sized.group(1))} draft tokens but d2t has "
            f"{len(d2t)}; fix: give the file of the draft vocabulary size the drafter was trained with",
            path=str(path), key="d2t")
    t2d_name = _NPY_T2D if path.name == _NPY_D2T else f"t2d-{sized.group(1)}.npy" if sized else None
    t2d_path = path.with_name(t2d_name) if t2d_name is not None else None
    if t2d_path is not None:
        refuse_non_regular(t2d_path)  # not silently read as "no t2d"
    t2d = _npy_array(t2d_path, "t2d") if t2d_path is not None and t2d_path.is_file() else None
    if d2t.dtype.kind not in "iu":
        raise VocabMapError(f"vocab file {quote(str(path))}: d2t has dtype {d2t.dtype}; fix: d2t must be an integer "
                            "array (int64)", path=str(path), key="d2t")
    if t2d is not None and t2d.dtype.kind not in "bu":
        raise VocabMapError(f"vocab file {quote(str(t2d_path))}: t2d has dtype {t2d.dtype}; fix: t2d must be a boolean "
                            "array, one flag per target id", path=str(t2d_path), key="t2d")
    return VocabMap.from_d2t(name, d2t.tolist(), encoding=encoding, vocab_size=vocab_size,
                             t2d=None if t2d is None else [bool(v) for v in t2d.tolist()],
                             origin=f"file {quote(str(path))}")


def _npy_array(path: Path, key: str) -> Any:
    """A one-dimensional array from a ``.npy`` file; pickled object arrays are refused."""
    import tokenize
    import warnings

    import numpy

    fix = f"fix: save {key} with numpy.save('{path.name}', {key}.numpy())"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # numpy warns of a size that overflows, then refuses it
            # mapped, not read: a header declaring terabytes is refused, not allocated
            array = numpy.load(path, mmap_mode="r", allow_pickle=False)
    # a damaged header: numpy's parser raises any of these
    except (ValueError, OSError, EOFError, OverflowError, SyntaxError, tokenize.TokenError) as err:
        reason = _first_line(err)
        if isinstance(err, (SyntaxError, tokenize.TokenError)):
            reason = "its header does not parse"
        elif "mmap length is greater than file size" in reason:
            reason = "its header declares more data than the file holds"
        elif "Python objects in dtype" in reason:  # refused as mapped, as numpy.load refuses it unmapped
            reason = "Object arrays cannot be loaded when allow_pickle=False"
        raise CheckpointFormatError(
            f"vocab file {quote(str(path))} is not a plain numpy array ({reason}); {fix}", path=str(path)) from None
    if not isinstance(array, numpy.ndarray):  # numpy.load opens a zip as an .npz archive
        raise CheckpointFormatError(
            f"vocab file {quote(str(path))} is an .npz archive, not a plain numpy array; {fix}", path=str(path))
    _check_one_dim(path, key, array.shape)
    return array
