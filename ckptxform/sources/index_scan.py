"""A safetensors shard index read a block at a time, its ``weight_map`` pair by pair,
holding neither the text nor a dict of its keys (``json.loads`` of a million tensors'
82 MB index peaked at ~230 bytes a key above the text).

The fast path accepts only what the strict reader (``parse_index_json``) accepts and
reads it the same: every string decoded by JSON's own decoder, the document around the
``weight_map`` object (with that object emptied) read by ``parse_index_json`` itself
(no key twice, no NaN, a dict ``weight_map``...). Whatever it does not take (an error,
a key given twice, a value that is not a string, a shard name refused) is read again by
``parse_index_json``, whose error is the one raised: the messages stay the same.

What the scan keeps: each key's hash and file number (for ``KeyTable``), each file's key
count and the byte runs of the index where its pairs lie (``runs``): a file's keys are
read again from there when asked for (``pairs_in``).
"""

from __future__ import annotations

import codecs
import json
import re
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

__all__ = ["IndexScan", "NotScanned", "pairs_in", "scan_index"]

_WS = rb"[ \t\n\r]*"
_STRING = rb'"([^"\\\x00-\x1f]*(?:\\.[^"\\\x00-\x1f]*)*)"'
#: one ``"key": "file"`` pair of the weight map and the comma or brace after it
PAIR = re.compile(_WS + _STRING + _WS + rb":" + _WS + _STRING + _WS + rb"([,}])")
_EMPTY = re.compile(_WS + rb"}")
_BLOCK = 1 << 20
#: pairs of one file this close are one run (re-read with the pairs between them): a
#: file's runs stay few however its keys interleave with others'
RUN_GAP = 1 << 16
_HASH_MASK = (1 << 64) - 1


class NotScanned(Exception):
    """The fast path does not take this index: the strict reader reads it (and says why)."""


@dataclass
class IndexScan:
    """What ``scan_index`` keeps of an index."""

    #: file names in order of first appearance, and each one's key count
    names: list[str]
    counts: list[int]
    #: each key's 64-bit hash and file number, in the index's order
    hashes: array
    numbers: array
    #: each file's byte runs of the index text, flat (start, stop, start, stop...)
    runs: list[array]
    #: the raw (escaped) name bytes of each file as written, to its number
    raw_numbers: dict[bytes, int]
    #: the byte span of the weight map's pairs
    span: tuple[int, int]


def decode_string(raw: bytes) -> str:
    """A JSON string's content (between its quotes) as json reads it."""
    if b"\\" not in raw:
        return raw.decode("utf-8")
    return json.decoder.scanstring(raw.decode("utf-8") + '"', 0)[0]  # type: ignore[attr-defined]


def scan_index(stream: BinaryIO, *, limit: int, shard_ok: Callable[[str], bool],
               check_document: Callable[[str], None]) -> IndexScan:
    """Read ``stream``, an index of at most ``limit`` bytes. ``shard_ok(name)``: whether a
    file name may be a shard; ``check_document(text)``: the strict read of the document
    with its weight map emptied (raises on any problem). NotScanned when the fast path
    does not take it."""
    reader = _Reader(stream, limit)
    head, at = _head(reader)
    names: list[str] = []
    counts: list[int] = []
    runs: list[array] = []
    open_runs: list[list[int]] = []
    raw_numbers: dict[bytes, int] = {}
    hashes, numbers = array("Q"), array("H")
    buf, base, pos = reader.buffer, reader.base, at - reader.base
    first = at
    empty = _EMPTY.match(buf, pos)
    done, end = empty is not None, empty.end() if empty is not None else 0
    append_hash, append_number = hashes.append, numbers.append
    while not done:
        for match in PAIR.finditer(buf, pos):
            if match.start() != pos:
                break
            raw_key, raw_file, close = match.groups()
            number = raw_numbers.get(raw_file)
            if number is None:
                number = raw_numbers[raw_file] = _new_file(raw_file, names, counts, runs, open_runs, shard_ok)
            key = raw_key.decode("utf-8") if b"\\" not in raw_key else decode_string(raw_key)
            append_hash(hash(key) & _HASH_MASK)
            append_number(number)
            counts[number] += 1
            start, pos = base + pos, match.end()
            run = open_runs[number]
            if start - run[1] > RUN_GAP:  # (a file's first pair too: its run ends at -inf)
                if run[0] >= 0:
                    runs[number].extend(run)
                run[0] = start
            run[1] = base + pos
            if close == b"}":
                done, end = True, pos
                break
        if done:
            break
        if reader.eof:
            raise NotScanned("the weight map does not end as a run of string pairs")
        reader.consume(pos)
        reader.more()
        buf, base, pos = reader.buffer, reader.base, 0
    for number, run in enumerate(open_runs):
        runs[number].extend(run)
    rest = reader.rest(base + end)
    try:
        tail = codecs.decode(rest, "utf-8")
    except UnicodeDecodeError:
        raise NotScanned("not UTF-8 after the weight map") from None
    check_document(head + "}" + tail)
    return IndexScan(names, counts, hashes, numbers, runs, raw_numbers, (first, base + end))


def pairs_in(blob: bytes) -> Iterator[tuple[bytes, bytes]]:
    """The raw ``(key, file)`` pairs of a run of the weight map, in order; NotScanned
    where the run is not a run of pairs (the index changed since it was scanned)."""
    pos = 0
    for match in PAIR.finditer(blob):
        if match.start() != pos:
            break
        yield match.group(1), match.group(2)
        pos = match.end()
    if pos != len(blob):
        raise NotScanned("not a run of pairs")


def _new_file(raw: bytes, names: list[str], counts: list[int], runs: list[array], open_runs: list[list[int]],
              shard_ok: Callable[[str], bool]) -> int:
    try:
        name = decode_string(raw)
    except ValueError:  # UnicodeDecodeError, JSONDecodeError
        raise NotScanned("a file name json does not read") from None
    if not shard_ok(name) or len(names) >= 1 << 16:
        raise NotScanned("a file name the strict reader refuses")
    if name in names:  # the same name escaped another way: one number
        return names.index(name)
    names.append(name)
    counts.append(0)
    runs.append(array("q"))
    open_runs.append([-1, -(1 << 62)])
    return len(names) - 1


def _head(reader: _Reader) -> tuple[str, int]:
    """The text up to the ``{`` of the top-level ``weight_map`` (read as far as needed)
    and the byte offset just after it."""
    decoder = json.JSONDecoder()
    while True:
        try:
            text = reader.buffer.decode("utf-8")
        except UnicodeDecodeError as exc:
            if exc.reason != "unexpected end of data" or reader.eof:
                raise NotScanned("not UTF-8") from None
            text = reader.buffer[: exc.start].decode("utf-8")
        found = _weight_map_start(text, decoder)
        if found is not None:
            head = text[:found]
            return head, reader.base + len(head.encode("utf-8"))
        if reader.eof:
            raise NotScanned("no top-level weight_map object")
        reader.more(len(reader.buffer))  # doubling: a large member before it is read ~twice


def _weight_map_start(text: str, decoder: json.JSONDecoder) -> int | None:
    """Where the top-level ``"weight_map": {`` of ``text`` ends, or None when ``text``
    (a prefix of the document) does not reach it; NotScanned when the fast path cannot
    take what comes before it."""
    ws = re.compile(r"[ \t\n\r]*")
    try:
        pos = ws.match(text, 0).end()  # type: ignore[union-attr]
        if text[pos] != "{":
            raise NotScanned("not an object")
        pos = ws.match(text, pos + 1).end()  # type: ignore[union-attr]
        while True:
            if text[pos] != '"':
                raise NotScanned("no key")
            key, pos = json.decoder.scanstring(text, pos + 1)  # type: ignore[attr-defined]
            pos = ws.match(text, pos).end()  # type: ignore[union-attr]
            if text[pos] != ":":
                raise NotScanned("no colon")
            pos = ws.match(text, pos + 1).end()  # type: ignore[union-attr]
            if key == "weight_map":
                if text[pos] != "{":
                    raise NotScanned("weight_map is not an object")
                return pos + 1
            _, pos = decoder.raw_decode(text, pos)
            pos = ws.match(text, pos).end()  # type: ignore[union-attr]
            if text[pos] != ",":
                raise NotScanned("the document ends before a weight_map")
            pos = ws.match(text, pos + 1).end()  # type: ignore[union-attr]
    except (IndexError, ValueError, RecursionError):  # ran out of text, or what json refuses
        return None


class _Reader:
    """A binary stream read a block at a time into ``buffer`` (which starts at byte
    ``base``), refusing to read past ``limit`` bytes (NotScanned: the strict reader
    says it is too large)."""

    def __init__(self, stream: BinaryIO, limit: int) -> None:
        self._stream, self._limit = stream, limit
        self.buffer, self.base, self.eof = b"", 0, False
        self.more()

    def more(self, size: int = _BLOCK) -> None:
        block = self._stream.read(max(size, _BLOCK))
        if not block:
            self.eof = True
        self.buffer += block
        if self.base + len(self.buffer) > self._limit:
            raise NotScanned("too large")

    def consume(self, count: int) -> None:
        self.buffer, self.base = self.buffer[count:], self.base + count

    def rest(self, offset: int) -> bytes:
        """Every byte from ``offset`` (within the buffer) to the end of the stream."""
        self.consume(offset - self.base)
        while not self.eof:
            self.more()
        return self.buffer
