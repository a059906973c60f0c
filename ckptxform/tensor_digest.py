"""Tensor digests for the audit log: BLAKE3 by default, sha256 on request.

Every byte a conversion writes is hashed, so the hash's speed bounds the conversion's.
Measured on this project's 2-core vm (AVX-512, SHA-NI): sha256 1.2 GB/s a core, BLAKE3
(the ``blake3`` package, Rust) 5.8 GB/s a core, faster than the kernel copies the bytes;
both release the GIL, so tensors are hashed on several threads at once, and a large tensor
is hashed by BLAKE3 on every core (``max_threads``): BLAKE3 is a tree hash, the same
function of the bytes however many threads compute it, so audits verify either way.

A ``written`` audit record names its algorithm and keeps the digest under that name:
``"digest": "blake3", "blake3": HEX`` (``--digest sha256``: ``"digest": "sha256",
"sha256": HEX``). Records without ``digest``, from audits written before the choice
existed, hold ``sha256``; ``verify`` reads both.

``--digest none`` hashes nothing: on a filesystem that clones (XFS, btrfs) a rename then
costs no data I/O at all, where the digest would read every byte back. Its records say
``"digest": "none"`` (key, file, shape, dtype, offset, size and source still listed), and
``verify`` checks structure and sizes and says that it did not check the bytes.

>>> hasher = new_hasher("sha256"); hasher.update(b"abc"); hasher.hexdigest()[:12]
'ba7816bf8f01'
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, Protocol

from .errors import UsageError

#: the algorithms a run can record, the default first
DIGESTS: tuple[str, ...] = ("blake3", "sha256")
DEFAULT_DIGEST = DIGESTS[0]
#: no digest at all (``apply --digest none``): the bytes are never read back
NO_DIGEST = "none"
#: what ``apply --digest`` takes
DIGEST_CHOICES: tuple[str, ...] = (*DIGESTS, NO_DIGEST)
#: what a ``written`` record without a ``digest`` field (an older audit) holds
LEGACY_DIGEST = "sha256"
#: tensors at least this big are hashed on every core (BLAKE3; smaller ones gain nothing
#: from splitting, and the writer hashes several tensors at once anyway)
PARALLEL_MIN = 64 << 20
#: bytes a multi-threaded hasher is given at once: each update is split across the cores
#: (1 MiB updates gain nothing from the threads)
PARALLEL_BLOCK = 4 << 20


class Hasher(Protocol):
    def update(self, data: Any, /) -> object: ...

    def hexdigest(self) -> str: ...

    def digest(self) -> bytes: ...


def check_digest(algorithm: str) -> str:
    """``algorithm`` when it is one of DIGEST_CHOICES; a UsageError naming them otherwise."""
    if algorithm not in DIGEST_CHOICES:
        raise UsageError(f"unknown digest {algorithm!r}; choose one of {', '.join(map(repr, DIGEST_CHOICES))}")
    return algorithm


def new_hasher(algorithm: str, nbytes: int = 0) -> Hasher:
    """A fresh hasher for ``algorithm`` (one of DIGESTS), of ``nbytes`` bytes to come: from
    PARALLEL_MIN on, BLAKE3 on every core."""
    if check_digest(algorithm) == NO_DIGEST:
        raise ValueError("no hasher for --digest none")
    if algorithm == "blake3":
        from blake3 import blake3

        hasher: Hasher = blake3(max_threads=blake3.AUTO if nbytes >= PARALLEL_MIN else 1)
        return hasher
    return hashlib.sha256()


def update_size(algorithm: str, nbytes: int) -> int | None:
    """Bytes to feed ``new_hasher(algorithm, nbytes)`` at once (None: fileio.hash_range's default)."""
    return PARALLEL_BLOCK if algorithm == "blake3" and nbytes >= PARALLEL_MIN else None


def recorded_digest(event: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(algorithm, hex)`` of a ``written`` audit record, or None when it names no
    algorithm this ckptxform knows, holds no digest under that name or was written
    with ``--digest none`` (``unhashed``)."""
    algorithm = event.get("digest", LEGACY_DIGEST)
    value = event.get(algorithm) if algorithm in DIGESTS else None
    return (algorithm, value) if isinstance(value, str) else None


def unhashed(event: Mapping[str, Any]) -> bool:
    """True for a ``written`` record of ``apply --digest none``: its bytes were not hashed."""
    return event.get("digest") == NO_DIGEST
