"""Which file holds a key, in 8 bytes a key: no dict of every key, no key string kept.

A sharded checkpoint of a million tensors held its index as a dict (31 bytes a key) of
key strings (87 bytes each). ``KeyTable`` holds one 64-bit word a key instead: the key's
hash (``hash(str)``, 64 bits) and its file's number share it. The top ``bits`` bits of
the hash pick a bucket (an ``array('I')`` of bucket starts, about one a 4 keys), so a word
keeps the other ``64 - bits`` bits of the hash above the file number; each bucket's words
are sorted, and a lookup bisects one bucket.

Two keys may share a hash (about one pair in 3.6e7 indexes of a million keys): the
table says so (``clashes``) and lists every file whose key has that hash; its users read
the candidate headers, which hold the key strings, to tell them apart.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from itertools import accumulate, islice, repeat
from operator import eq, rshift

__all__ = ["KeyTable", "key_hash"]

_HASH_MASK = (1 << 64) - 1


def key_hash(key: str) -> int:
    """A key's 64-bit hash, unsigned (``hash`` of a str, cached on the string object)."""
    return hash(key) & _HASH_MASK


class KeyTable:
    """A set of 64-bit key hashes, each with a file number below ``2 ** file_bits``."""

    __slots__ = ("bits", "clashes", "_starts", "_words", "_low", "_files_mask", "_shift")

    def __init__(self, hashes: array, numbers: array, renumber: list[int], file_bits: int) -> None:
        """``hashes`` (``key_hash`` of each key) and ``numbers`` (its file's number, mapped
        through ``renumber``), in any order; ``file_bits`` (8 or 16): room for the numbers."""
        # ~4 words a bucket (1 byte a key of bucket starts): a lookup bisects 2 or 3 words (a
        # bisection of ~800 words at 200,000 keys in 256 buckets took 2 us, 4x a dict's lookup)
        self.bits = bits = max(file_bits, min(24, (len(hashes) // 4).bit_length()))
        self._shift = shift = 64 - bits
        self._low = low = (1 << shift) - 1
        self._files_mask = (1 << file_bits) - 1
        # a counting sort into the buckets, then a sort of each: no list of every key's int
        # is ever made (44 bytes a key)
        sizes = array("I", bytes(4 << bits))
        for value in hashes:
            sizes[value >> shift] += 1
        self._starts = starts = array("I", accumulate(sizes, initial=0))
        del sizes
        cursor = array("I", starts)
        words = array("Q", bytes(8 * len(hashes)))
        for value, number in zip(hashes, numbers):
            bucket = value >> shift
            at = cursor[bucket]
            cursor[bucket] = at + 1
            words[at] = ((value & low) << bits) | renumber[number]
        del cursor
        first = 0
        for stop in islice(starts, 1, None):
            if stop - first > 1:
                words[first:stop] = array("Q", sorted(words[first:stop]))
            first = stop
        self._words = words
        # equal hashes sit side by side (two neighbours of two buckets may agree too: looked at closer)
        hashed = map(rshift, words, repeat(bits))
        self.clashes = any(map(eq, hashed, map(rshift, islice(words, 1, None), repeat(bits)))) and self._clash()

    def _clash(self) -> bool:
        """Whether a bucket holds two words of one hash."""
        bits, starts, words = self.bits, self._starts, self._words
        return any(len({word >> bits for word in words[starts[b]:starts[b + 1]]}) < starts[b + 1] - starts[b]
                   for b in range(len(starts) - 1))

    def __len__(self) -> int:
        return len(self._words)

    def number(self, key: str) -> int:
        """The file number of ``key``'s hash (the first, if it clashes), or -1."""
        value = hash(key) & _HASH_MASK
        bucket = value >> self._shift
        words, bits = self._words, self.bits
        want = value & self._low
        stop = self._starts[bucket + 1]
        at = bisect_left(words, want << bits, self._starts[bucket], stop)
        if at < stop and words[at] >> bits == want:
            return words[at] & self._files_mask
        return -1

    def numbers(self, key: str) -> list[int]:
        """The file numbers of every key of ``key``'s hash (most often one, or none)."""
        value = hash(key) & _HASH_MASK
        bucket = value >> self._shift
        words, bits, mask = self._words, self.bits, self._files_mask
        want = value & self._low
        stop = self._starts[bucket + 1]
        at = bisect_left(words, want << bits, self._starts[bucket], stop)
        found = []
        while at < stop and words[at] >> bits == want:
            found.append(words[at] & mask)
            at += 1
        return found

    def held_bytes(self) -> int:
        return self._words.itemsize * len(self._words) + self._starts.itemsize * len(self._starts)


def bits_for(files: int) -> int:
    """The file-number width of a table over ``files`` files (8 or 16 bits)."""
    return 8 if files <= 1 << 8 else 16
