"""What a local input file holds, keyed cheaply, so that a rerun tells a touched file from a changed one.

A pin (``ckptxform.sources.pins``) says whether a file was written to; ``touch``, a copy
with ``cp -p`` or a checkout moves it without changing a byte. A rerun therefore compares
content where that is cheap:

- a file of at most ``SMALL_FILE`` bytes (configs, indexes, vocab maps, drafters) by the
  sha256 of all of it: ``"sha256:HEX"``;
- a larger file by its size and the sha256 of its head, which for a safetensors file is
  the whole header (every key, dtype, shape and offset; other formats: the first MiB):
  ``"size=N head-sha256=HEX"``. That key cannot see new values in the same layout (a
  fine-tuned checkpoint), so a large file is also pinned, and when its pin moved but its
  key did not, the rerun hashes it whole (``whole_digest``) and compares that with the
  digest the earlier run recorded after reading it (``file_digests`` in the run record).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..tensor_digest import DEFAULT_DIGEST, new_hasher

__all__ = ["SMALL_FILE", "content_key", "is_whole", "whole_digest"]

#: files up to this size are keyed by the hash of every byte (64 MiB: ~50 ms of sha256)
SMALL_FILE = 64 << 20
#: the head of a large file that is not safetensors
_HEAD = 1 << 20
#: a safetensors header larger than this is not trusted to be one (the format's own limit)
_MAX_HEADER = 100_000_000
_CHUNK = 8 << 20


def content_key(path: str | Path) -> str:
    """The cheap content key of the file at ``path`` (see the module docstring).

    >>> content_key("config.json")                      # doctest: +SKIP
    'sha256:9f86d0...'
    """
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        if size <= SMALL_FILE:
            digest = hashlib.sha256()
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
            return f"sha256:{digest.hexdigest()}"
        return f"size={size} head-sha256={hashlib.sha256(_head(f, size)).hexdigest()}"


def is_whole(key: str) -> bool:
    """Whether ``key`` covers every byte of its file (no pin needed beside it)."""
    return key.startswith("sha256:")


def whole_digest(path: str | Path) -> str:
    """The digest of every byte of the file at ``path`` (the audit's default algorithm,
    tagged with its name): what settles a large file whose pin moved but key did not."""
    with open(path, "rb") as f:
        hasher = new_hasher(DEFAULT_DIGEST, f.seek(0, 2))  # a large file: BLAKE3 on every core
        f.seek(0)
        while chunk := f.read(_CHUNK):
            hasher.update(chunk)
    return f"{DEFAULT_DIGEST}:{hasher.hexdigest()}"


def _head(f, size: int) -> bytes:  # type: ignore[no-untyped-def]
    """A safetensors file's length prefix and JSON header, else the first ``_HEAD`` bytes."""
    prefix = f.read(8)
    length = int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
    if 2 <= length <= min(_MAX_HEADER, size - 8):
        header = f.read(length)
        if header[:1] == b"{":
            try:
                json.loads(header)
                return prefix + header
            except ValueError:
                pass
    f.seek(0)
    return f.read(_HEAD)
