"""Strict parsing of safetensors headers and shard indexes: pure functions, no I/O.

A safetensors file is an 8-byte little-endian header length, a JSON header, then the
data. Everything ckptxform plans is built from these headers, so a malformed or hostile
one must fail here with one line naming the file and key, never as a ``KeyError`` deep
in the planner or a silent misread. The local source reads the bytes with ``os.pread``
and the Hub source with HTTP range requests; both hand them to these functions. The
JSON itself is read by ``strict_json`` (no key twice, no NaN, valid Unicode).

Example::

    n = header_length(first8, file_size=size, label="model.safetensors")
    tensors, metadata = parse_header_json(blob, file="model.safetensors", file_size=size)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from typing import Any

from ckptxform.dtypes import DTYPE_SIZES, nbytes
from ckptxform.errors import CheckpointFormatError, quote_keys
from ckptxform.sources.base import TensorInfo
from ckptxform.sources.header_columns import ShardColumns
from ckptxform.sources.strict_json import check_unicode, json_type, parse_json_object, quote_short, show_value, utf8_text

#: The largest header accepted, as in the safetensors Rust crate (``MAX_HEADER_SIZE``):
#: a bigger length is corruption or an attempt to make us allocate gigabytes.
MAX_HEADER_BYTES = 100_000_000

_METADATA_KEY = "__metadata__"
_NOT_SAFETENSORS = "the file is corrupt or not safetensors"
_ENTRY_FIELDS = ("dtype", "shape", "data_offsets")


def header_length(first8: bytes, *, file_size: int | None, label: str) -> int:
    """The JSON header's length from a file's first 8 bytes, checked against the bound
    and against ``file_size`` when it is known."""
    if len(first8) < 8:
        raise CheckpointFormatError(
            f"{label}: {len(first8)} bytes is too short for a safetensors file (it starts "
            "with an 8-byte header length); the file is truncated or not safetensors",
            path=label,
        )
    n = int.from_bytes(first8[:8], "little")
    if n > MAX_HEADER_BYTES:
        raise CheckpointFormatError(
            f"{label}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit of "
            f"safetensors; {_NOT_SAFETENSORS}",
            path=label,
        )
    if file_size is not None and 8 + n > file_size:
        raise CheckpointFormatError(
            f"{label}: header length {n} is larger than the file ({file_size} bytes); "
            "the file is truncated or not safetensors (re-download or re-save it)",
            path=label,
        )
    return n


def parse_header_json(
    blob: bytes, *, file: str, file_size: int | None, label: str | None = None
) -> tuple[list[TensorInfo], dict[str, str]]:
    """The tensors (sorted by offset) and ``__metadata__`` of a header ``blob`` (the
    bytes after the 8-byte length). ``file`` goes into each ``TensorInfo``; ``label``
    (default ``file``) names the file in error messages. Offsets are absolute:
    ``8 + len(blob) + begin``."""
    columns, metadata = parse_header_columns(blob, file=file, file_size=file_size, label=label)
    return columns.infos(), metadata


def parse_header_columns(
    blob: bytes, *, file: str, file_size: int | None, label: str | None = None
) -> tuple[ShardColumns, dict[str, str]]:
    """``parse_header_json``'s tensors as columns, no ``TensorInfo`` made: what a sharded
    checkpoint keeps of each header it reads (``sources/header_columns.py``)."""
    label = label or file
    header = parse_json_object(blob, label, what="header", fix=_NOT_SAFETENSORS)
    metadata = _parse_metadata(header.pop(_METADATA_KEY, None), label)
    data_size = None if file_size is None else file_size - 8 - len(blob)
    spans: list[tuple[int, int, str]] = []
    entries: list[tuple[str, str, tuple[int, ...], int]] = []
    for key, entry in header.items():
        dtype, shape, begin, end = _parse_entry(key, entry, label, data_size)
        spans.append((begin, end, key))
        entries.append((key, dtype, shape, begin))
    _check_no_overlap(spans, label)
    return ShardColumns(file, 8 + len(blob), entries), metadata


def read_header(
    read_at: Callable[[int, int], bytes],
    *,
    file: str,
    file_size: int | None,
    label: str | None = None,
) -> tuple[list[TensorInfo], dict[str, str]]:
    """Read and parse a header through ``read_at(offset, length)`` (which may return
    fewer bytes at the end of the file): two reads, 8 bytes then the JSON."""
    columns, metadata = read_header_columns(read_at, file=file, file_size=file_size, label=label)
    return columns.infos(), metadata


def read_header_columns(
    read_at: Callable[[int, int], bytes],
    *,
    file: str,
    file_size: int | None,
    label: str | None = None,
) -> tuple[ShardColumns, dict[str, str]]:
    """``read_header``'s tensors as columns (``parse_header_columns``)."""
    label = label or file
    n = header_length(read_at(0, 8), file_size=file_size, label=label)
    blob = read_at(8, n)
    if len(blob) != n:
        raise CheckpointFormatError(
            f"{label}: file ends {len(blob)} bytes into its {n}-byte header; "
            "the file is truncated (re-download it)",
            path=label,
        )
    return parse_header_columns(blob, file=file, file_size=file_size, label=label)


def checked_header_columns(blob: bytes, *, file: str) -> ShardColumns:
    """The tensors of a header ``blob`` that ``parse_header_columns`` read once already (the
    same bytes: its file's pin unchanged), without its checks again: a header dropped from a
    sharded checkpoint's cache and asked for again (~80 ms, not ~230, for 15,625 tensors)."""
    header = json.loads(blob)
    header.pop(_METADATA_KEY, None)
    return ShardColumns(file, 8 + len(blob), ((key, entry["dtype"], tuple(entry["shape"]), entry["data_offsets"][0])
                                              for key, entry in header.items()))


def parse_index_json(blob: bytes, *, label: str, shard_suffix: str) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> shard file) of a shard index such as
    ``model.safetensors.index.json``. Every shard must be a plain file name ending with
    ``shard_suffix``: an index must not point outside its own directory."""
    fix = "the index is corrupt (re-download it)"
    text = utf8_text(blob, label, what="index", fix=fix)
    # a caller that passed its bytes inline holds them no longer: freed before the parse,
    # whose peak was the peak of planning a million tensors (the file is ~80 bytes a tensor)
    del blob
    index = parse_json_object(text, label, what="index", fix=fix)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointFormatError(
            f"{label}: has no 'weight_map' object (got {show_value(weight_map)}); a shard "
            "index maps each tensor name to its shard file (re-download the index)",
            path=label,
        )
    for key, shard in weight_map.items():
        if not isinstance(shard, str):
            raise CheckpointFormatError(
                f"{label}: weight_map maps {quote_short(key)} to {show_value(shard)}; "
                "each tensor must map to a shard file name",
                path=label,
                key=key,
            )
        if not is_plain_file_name(shard):
            raise CheckpointFormatError(
                f"{label}: weight_map maps {quote_short(key)} to {quote_short(shard)}, which is not "
                "a plain file name; shards must sit next to the index (no '/', '\\', "
                "'..' or absolute paths)",
                path=label,
                key=key,
            )
        if not shard.endswith(shard_suffix):
            raise CheckpointFormatError(
                f"{label}: weight_map maps {quote_short(key)} to {quote_short(shard)}, but this "
                f"index must name {shard_suffix} shards",
                path=label,
                key=key,
            )
    # one string per shard name: JSON gives every tensor its own copy (~80 bytes a tensor,
    # held as long as the checkpoint is open)
    names: dict[str, str] = {}
    for key, shard in weight_map.items():
        weight_map[key] = names.setdefault(shard, shard)
    return weight_map


def check_index_matches_shards(
    weight_map: Mapping[str, str], shard_keys: Mapping[str, Collection[str]], *, label: str
) -> None:
    """Raise unless the shards' own headers hold exactly the tensors the index maps to
    them. ``shard_keys`` holds the keys read from every shard the index names. A tensor
    in two shards is ambiguous, and one the index does not list would be silently
    dropped by every loader that trusts the index."""
    homes: dict[str, list[str]] = {}
    for shard in sorted(shard_keys):
        for key in shard_keys[shard]:
            homes.setdefault(key, []).append(shard)
    for key in sorted(homes):
        if len(homes[key]) > 1:
            raise CheckpointFormatError(
                f"{label}: tensor {quote_short(key)} is stored in both {quote_short(homes[key][0])} "
                f"and {quote_short(homes[key][1])}; a tensor must live in one shard "
                "(re-save the checkpoint)",
                path=label,
                key=key,
            )
    absent: dict[str, list[str]] = {}
    for key, shard in weight_map.items():
        if shard not in homes.get(key, ()):
            absent.setdefault(shard, []).append(key)
    if absent:
        shard = min(absent)
        keys = sorted(absent[shard])
        elsewhere = [f"{quote_short(k)} is in {quote_short(homes[k][0])}" for k in keys if k in homes]
        hint = f" ({elsewhere[0]})" if elsewhere else ""
        raise CheckpointFormatError(
            f"{label}: maps {quote_keys(keys, 3)} to shard {quote_short(shard)}, which does not "
            f"hold {'it' if len(keys) == 1 else 'them'}{hint}; the index and the shards "
            "disagree (re-download both)",
            path=label,
            key=keys[0],
        )
    unlisted = {
        shard: sorted(k for k in keys if k not in weight_map)
        for shard, keys in shard_keys.items()
        if any(k not in weight_map for k in keys)
    }
    if unlisted:
        shard = min(unlisted)
        keys = unlisted[shard]
        them = "it" if len(keys) == 1 else "them"
        raise CheckpointFormatError(
            f"{label}: shard {quote_short(shard)} holds {quote_keys(keys, 3)}, which the index "
            f"does not list, so loaders would silently drop {them}; add {them} to weight_map "
            "or re-save the checkpoint",
            path=label,
            key=keys[0],
        )


def check_shard_matches_index(weight_map: Mapping[str, str], listed: Mapping[str, str], shard: str,
                              keys: Collection[str], *, label: str) -> None:
    """Raise unless shard ``shard``'s own header (``keys``) holds exactly what the index
    (``weight_map``; ``listed``: its part naming ``shard``) maps to it: one shard checked as
    it is read, the others perhaps never (a lazily read checkpoint: sources/lazy_index.py)."""
    elsewhere = sorted(k for k in keys if k in weight_map and weight_map[k] != shard)
    if elsewhere:
        raise CheckpointFormatError(
            f"{label}: shard {quote_short(shard)} holds {quote_keys(elsewhere, 3)}, which the index maps to "
            f"{quote_short(weight_map[elsewhere[0]])}; a tensor must live in the one shard the index names "
            "(re-download both, or re-save the checkpoint)",
            path=label,
            key=elsewhere[0],
        )
    check_index_matches_shards(listed, {shard: keys}, label=label)


def _parse_metadata(raw: Any, label: str) -> dict[str, str]:
    # The safetensors crate reads ``"__metadata__": null`` as no metadata; so do we.
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise CheckpointFormatError(
            f"{label}: __metadata__ must be an object of strings, got {json_type(raw)}",
            path=label,
        )
    for key, value in raw.items():
        if not isinstance(value, str):
            raise CheckpointFormatError(
                f"{label}: __metadata__ must map strings to strings; {quote_short(key)} holds "
                f"{json_type(value)} {show_value(value)}",
                path=label,
                key=key,
            )
        check_unicode(key, label, "__metadata__ key")
        check_unicode(value, label, f"__metadata__ value of {quote_short(key)}")
    return raw


def _parse_entry(
    key: str, entry: Any, label: str, data_size: int | None
) -> tuple[str, tuple[int, ...], int, int]:
    def fail(problem: str) -> CheckpointFormatError:
        return CheckpointFormatError(
            f"{label}: tensor {quote_short(key)}: {problem}", path=label, key=key
        )

    # Fields other than these three are ignored, as the safetensors crate does.
    if not isinstance(entry, dict):
        raise fail(
            f"entry must be an object with dtype, shape and data_offsets, got {json_type(entry)}"
        )
    missing = [field for field in _ENTRY_FIELDS if field not in entry]
    if missing:
        raise fail(f"entry has no {', '.join(repr(m) for m in missing)}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise fail(f"unknown dtype {show_value(dtype)} (known: {', '.join(sorted(DTYPE_SIZES))})")
    if not isinstance(shape, list) or not all(_is_u64(d) for d in shape):
        raise fail(f"shape must be a list of non-negative 64-bit integers, got {show_value(shape)}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_u64(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise fail(
            "data_offsets must be two non-negative 64-bit integers [begin, end] with "
            f"begin <= end, got {show_value(offsets)}"
        )
    begin, end = offsets
    if data_size is not None and end > data_size:
        raise fail(
            f"data_offsets [{begin}, {end}] run past the end of the data ({data_size} "
            "bytes); the file is truncated (re-download it)"
        )
    need = nbytes(dtype, shape)
    if end - begin != need:
        raise fail(
            f"data_offsets [{begin}, {end}] span {end - begin} bytes but dtype {dtype} with "
            f"shape {shape} needs {need}"
        )
    return dtype, tuple(shape), begin, end


def _check_no_overlap(spans: list[tuple[int, int, str]], label: str) -> None:
    # Overlapping tensors would alias each other's bytes: refused. Gaps are allowed,
    # although the safetensors crate wants the data section covered exactly: a gap
    # cannot make us misread a tensor, since each is read by its own byte range.
    previous: tuple[int, int, str] | None = None
    for begin, end, key in sorted(s for s in spans if s[0] < s[1]):
        if previous is not None and begin < previous[1]:
            raise CheckpointFormatError(
                f"{label}: tensors {quote_short(previous[2])} [{previous[0]}, {previous[1]}] and "
                f"{quote_short(key)} [{begin}, {end}] overlap; each tensor needs its own bytes "
                "(the file is corrupt or crafted)",
                path=label,
                key=key,
            )
        if previous is None or end > previous[1]:
            previous = (begin, end, key)


def is_plain_file_name(name: str) -> bool:
    return name not in ("", ".", "..") and not any(c in name for c in "/\\\0")


def _is_u64(value: Any) -> bool:
    # JSON true/false arrive as bool, a subclass of int. The safetensors crate reads
    # shapes and offsets as 64-bit unsigned integers, so larger ones are refused too.
    return type(value) is int and 0 <= value < 2**64
