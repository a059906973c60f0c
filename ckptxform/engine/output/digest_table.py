"""A shard's tensor digests, held as one bytes object of binary digests.

A record holds a digest for every tensor of its shard until the run commits: as ``(key,
hex)`` pairs that was ~170 bytes a tensor (a 64-character str and a tuple), the largest
per-tensor item at the peak of a many-tensor run; as binary in one ``bytes`` it is the
digest's 32 bytes. The hex is made when a pair is asked for (the record file, the audit).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence


class TensorDigests(Sequence[tuple[str, str]]):
    """``(key, hex digest)`` of each tensor of a shard, in file order. Every digest has the
    same width (one algorithm a record); with ``--digest none`` each is ``""``.

    >>> d = TensorDigests.from_pairs([("a", "00ff"), ("b", "0102")])
    >>> list(d), d.raw(1)
    ([('a', '00ff'), ('b', '0102')], b'\\x01\\x02')
    """

    __slots__ = ("_blob", "_width", "keys")

    def __init__(self, keys: tuple[str, ...], blob: bytes, width: int) -> None:
        if len(blob) != len(keys) * width:
            raise ValueError(f"{len(blob)} digest bytes for {len(keys)} tensors of {width} bytes each")
        self.keys, self._blob, self._width = keys, blob, width

    @classmethod
    def from_raw(cls, keys: Iterable[str], digests: Iterable[bytes]) -> TensorDigests:
        """From binary digests (all of one width, or all empty)."""
        keys, digests = tuple(keys), list(digests)
        width = len(digests[0]) if digests else 0
        return cls(keys, b"".join(digests), width)

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[str, str]]) -> TensorDigests:
        """From ``(key, hex)`` pairs (a record file); ValueError when a digest is not hex
        or not as wide as the others."""
        pairs = list(pairs)
        return cls.from_raw((key for key, _ in pairs), (bytes.fromhex(digest) for _, digest in pairs))

    def raw(self, i: int) -> bytes:
        """Tensor ``i``'s digest, binary."""
        return self._blob[i * self._width:(i + 1) * self._width]

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> tuple[str, str]:  # type: ignore[override]
        if not -len(self.keys) <= i < len(self.keys):
            raise IndexError(i)
        i %= len(self.keys)
        return self.keys[i], self.raw(i).hex()

    def __iter__(self) -> Iterator[tuple[str, str]]:
        width = self._width
        for i, key in enumerate(self.keys):
            yield key, self._blob[i * width:(i + 1) * width].hex()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TensorDigests):
            return self.keys == other.keys and self._blob == other._blob and self._width == other._width
        if isinstance(other, (tuple, list)):
            return list(self) == [tuple(pair) for pair in other]
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.keys, self._blob))

    def __repr__(self) -> str:
        return f"TensorDigests({list(self)!r})"
