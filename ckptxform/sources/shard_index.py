"""The ``weight_map`` of a sharded safetensors checkpoint without a string per key held:
a ``KeyTable`` (8 bytes a key) says which file holds a key, and a file's keys, when
asked for, are read again from the index file (the byte runs where its pairs lie,
``index_scan``): a million tensors' index held 118 bytes a key as a dict of strings.

A ``ShardIndex`` is a read-only ``Mapping[str, str]`` (key -> file): iterating it reads
the index file's pairs again, in its order; membership and lookup go by the key's 64-bit
hash (``KeyTable``: a clash between a key and another is resolved by the caller, who
reads the candidate headers). An index the fast scan does not take (a key's hash equal to
another's, or a test's dict) keeps its keys in memory, as before (``from_mapping``).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from ckptxform.errors import CheckpointFormatError
from ckptxform.fileio import open_regular
from ckptxform.sources.index_scan import IndexScan, NotScanned, decode_string, pairs_in, scan_index
from ckptxform.sources.key_table import KeyTable, bits_for

__all__ = ["ShardIndex", "open_shard_index"]


class ShardIndex(Mapping[str, str]):
    """Key -> shard file of a shard index; ``files`` sorted."""

    def __init__(self, files: tuple[str, ...], table: KeyTable, counts: Sequence[int],
                 keys: Callable[[int], list[str]], ordered: Callable[[], Iterator[tuple[str, str]]]) -> None:
        self.files = files
        self._numbers = {file: number for number, file in enumerate(files)}
        self._table = table
        self._counts = counts
        self._read_keys = keys  # a file's number -> its keys, in the index's order
        self._ordered = ordered  # every (key, file), in the index's order
        self._last: tuple[int, tuple[str, ...]] | None = None
        #: read by the scan, its keys read again from the file when asked for (not held)
        self.scanned = False

    @classmethod
    def from_scan(cls, scan: IndexScan, path: Path, *, label: str, check: Callable[[], None]) -> ShardIndex:
        """The index ``scan`` read from ``path``; ``check()`` raises if the file changed
        since (its pin), before it is read again."""
        files = tuple(sorted(scan.names))
        renumber = [files.index(name) for name in scan.names]
        table = KeyTable(scan.hashes, scan.numbers, renumber, bits_for(len(files)))
        counts = [0] * len(files)
        runs: list[array] = [array("q")] * len(files)
        raw_numbers = {raw: renumber[number] for raw, number in scan.raw_numbers.items()}
        for number, name in enumerate(scan.names):
            counts[renumber[number]], runs[renumber[number]] = scan.counts[number], scan.runs[number]
        reread = _Reread(path, label, check, raw_numbers, files)
        if table.clashes:
            raise NotScanned("two keys share a hash")  # told apart by their strings, kept
        span = scan.span
        index = cls(files, table, counts, lambda number: reread.keys(runs[number], number),
                    lambda: reread.pairs([span[0], span[1]] if len(table) else []))
        reread.index = index
        index.scanned = True
        return index

    @classmethod
    def from_mapping(cls, weight_map: Mapping[str, str], files: tuple[str, ...] | None = None) -> ShardIndex:
        """An index of ``weight_map``'s keys, held as they are (a sorted tuple a file)."""
        files = files if files is not None else tuple(sorted(set(weight_map.values())))
        number_of = {file: number for number, file in enumerate(files)}
        by_file: list[list[str]] = [[] for _ in files]
        hashes, numbers = array("Q"), array("H" if len(files) <= 1 << 16 else "I")
        for key, file in weight_map.items():
            by_file[number_of[file]].append(key)
            hashes.append(hash(key) & ((1 << 64) - 1))
            numbers.append(number_of[file])
        if len(files) > 1 << 16:
            raise CheckpointFormatError(f"the index names {len(files):,} shard files; at most 65,536 are read")
        table = KeyTable(hashes, numbers, list(range(len(files))), bits_for(len(files)))
        sorted_keys = [tuple(sorted(keys)) for keys in by_file]
        return cls(files, table, [len(keys) for keys in by_file], lambda number: list(sorted_keys[number]),
                   lambda: iter(weight_map.items()))

    # -- the Mapping -------------------------------------------------------------------
    def __getitem__(self, key: str) -> str:
        number = self._table.number(key) if isinstance(key, str) else -1
        if number < 0:
            raise KeyError(key)
        return self.files[number]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._table.number(key) >= 0

    def __iter__(self) -> Iterator[str]:
        return (key for key, _ in self._ordered())

    def __len__(self) -> int:
        return len(self._table)

    def items(self):  # type: ignore[override]
        """Every ``(key, file)``, in the index's order, read again from the index."""
        return self._ordered()

    # -- by file -----------------------------------------------------------------------
    @property
    def clashes(self) -> bool:
        """Whether two keys share a hash (``numbers_of`` then lists more than one file)."""
        return self._table.clashes

    def number(self, key: str) -> int:
        """The number (in ``files``) of the file ``key`` is in, -1 if none (by its hash)."""
        return self._table.number(key)

    def numbers(self, key: str) -> list[int]:
        """The numbers of every file holding a key of ``key``'s hash."""
        return self._table.numbers(key)

    def file_number(self, file: str) -> int:
        return self._numbers[file]

    def count(self, file: str) -> int:
        """How many keys the index maps to ``file``."""
        number = self._numbers.get(file)
        return 0 if number is None else self._counts[number]

    def keys_of(self, file: str) -> tuple[str, ...]:
        """The keys the index maps to ``file``, sorted (read again from the index; the
        last file asked is kept, since a file's keys are asked several times in a row)."""
        number = self._numbers.get(file)
        if number is None:
            return ()
        last = self._last
        if last is not None and last[0] == number:
            return last[1]
        keys = tuple(sorted(self._read_keys(number)))
        self._last = (number, keys)
        return keys

    def held_bytes(self) -> int:
        return self._table.held_bytes()


class _Reread:
    """Reads runs of an index file's weight map again and checks they say what they said."""

    def __init__(self, path: Path, label: str, check: Callable[[], None], raw_numbers: dict[bytes, int],
                 files: tuple[str, ...]) -> None:
        self._path, self._label, self._check = path, label, check
        self._raw_numbers, self._files = raw_numbers, files
        self.index: ShardIndex | None = None

    def keys(self, runs: array, number: int) -> list[str]:
        found = [key for key, file in self._pairs(runs) if file == number]
        assert self.index is not None
        if len(found) != self.index._counts[number]:
            raise self._changed()
        return found

    def pairs(self, runs: Sequence[int]) -> Iterator[tuple[str, str]]:
        files = self._files
        return ((key, files[number]) for key, number in self._pairs(runs))

    def _pairs(self, runs: Sequence[int]) -> Iterator[tuple[str, int]]:
        # the file is the one scanned (``check``: its pin, for a local one; a Hub one is a
        # blob of the Hugging Face cache, named by its hash): its pairs are not looked up in
        # the table again (1 us a key, a third of the time)
        self._check()
        raw_numbers = self._raw_numbers
        with open_regular(self._path) as stream:
            for at in range(0, len(runs), 2):
                stream.seek(runs[at])
                try:
                    for raw_key, raw_file in pairs_in(stream.read(runs[at + 1] - runs[at])):
                        number = raw_numbers.get(raw_file, -1)
                        if number < 0:
                            raise self._changed()
                        yield raw_key.decode("utf-8") if b"\\" not in raw_key else decode_string(raw_key), number
                except (NotScanned, ValueError):
                    raise self._changed() from None

    def _changed(self) -> CheckpointFormatError:
        return CheckpointFormatError(
            f"{self._label}: changed since it was read (its weight map no longer says what it said); "
            "do not modify a source during a run", path=self._label)


def open_shard_index(path: Path, *, label: str, shard_suffix: str, limit: int,
                     read_bytes: Callable[[], bytes], check: Callable[[], None] = lambda: None) -> ShardIndex:
    """The shard index at ``path`` (at most ``limit`` bytes), scanned a block at a time;
    one the scan does not take is read by ``parse_index_json`` from ``read_bytes()``
    (which raises the error, if there is one). ``check()``: raises if the file changed
    since it was read (called before each later read of it)."""
    from ckptxform.sources.safetensors_header import is_plain_file_name, parse_index_json
    from ckptxform.sources.strict_json import parse_json_object

    fix = "the index is corrupt (re-download it)"

    def check_document(text: str) -> None:
        if not isinstance(parse_json_object(text, label, what="index", fix=fix).get("weight_map"), dict):
            raise NotScanned("no weight_map object")

    try:
        with open_regular(path) as stream:
            scan = scan_index(stream, limit=limit, check_document=check_document,
                              shard_ok=lambda name: is_plain_file_name(name) and name.endswith(shard_suffix))
        return ShardIndex.from_scan(scan, path, label=label, check=check)
    except (NotScanned, ValueError, RecursionError, CheckpointFormatError):
        pass  # read again strictly, for its error (or, two keys of one hash: as a dict)
    return ShardIndex.from_mapping(parse_index_json(read_bytes(), label=label, shard_suffix=shard_suffix))
