"""Tensor digests for the audit log: BLAKE3 by default, sha256 on request.

Every byte a conversion writes is hashed, so the hash's speed bounds the conversion's.
Measured on this project's 2-core vm (AVX-512, SHA-NI): sha256 1.2 GB/s a core, BLAKE3
(the ``blake3`` package, Rust) 5.8 GB/s a core, faster than the kernel copies the bytes;
both release the GIL, so tensors are hashed on several threads at once.

A ``written`` audit record names its algorithm and keeps the digest under that name:
``"digest": "blake3", "blake3": HEX`` (``--digest sha256``: ``"digest": "sha256",
"sha256": HEX``). Records without ``digest``, from audits written before the choice
existed, hold ``sha256``; ``verify`` reads both.

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
#: what a ``written`` record without a ``digest`` field (an older audit) holds
LEGACY_DIGEST = "sha256"


class Hasher(Protocol):
    def update(self, data: Any, /) -> object: ...

    def hexdigest(self) -> str: ...


def check_digest(algorithm: str) -> str:
    """``algorithm`` when it is one of DIGESTS; a UsageError naming them otherwise."""
    if algorithm not in DIGESTS:
        raise UsageError(f"unknown digest {algorithm!r}; choose one of {', '.join(map(repr, DIGESTS))}")
    return algorithm


def new_hasher(algorithm: str) -> Hasher:
    """A fresh hasher for ``algorithm`` (one of DIGESTS)."""
    if check_digest(algorithm) == "blake3":
        from blake3 import blake3

        hasher: Hasher = blake3()
        return hasher
    return hashlib.sha256()


def recorded_digest(event: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(algorithm, hex)`` of a ``written`` audit record, or None when it names no
    algorithm this ckptxform knows or holds no digest under that name."""
    algorithm = event.get("digest", LEGACY_DIGEST)
    value = event.get(algorithm) if algorithm in DIGESTS else None
    return (algorithm, value) if isinstance(value, str) else None
