"""Byte ranges of remote files: which requests to send, what they cost, and a disk cache
of what came back.

A row gather from a large remote tensor needs many small scattered byte spans. Each
request costs a round trip (shared among the requests in flight) and some client CPU;
each byte costs its transfer time. ``LinkCost`` prices both, so ``plan_requests`` joins
two neighbouring spans exactly when moving the gap between them is cheaper than one more
request, and ``LinkCost.ranges_time`` / ``download_time`` say which of ranges or a whole
download is faster.

``RangeCache`` keeps every fetched span on disk, next to the repo's Hugging Face cache
folder, keyed by commit (whose bytes never change): a second run, or an offline run
(``HF_HUB_OFFLINE=1``), reads headers and rows from it without the network.

Pure stdlib: no huggingface_hub import here.
"""

from __future__ import annotations

import bisect
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from ...digits import is_ascii_digits

#: One response is held in memory whole, and up to ``parallel`` of them at once, so a
#: request never grows past this size.
MAX_REQUEST = 2 * 1024 * 1024
#: CPU per request (httpx, the answer's checks, the range cache; under the GIL, so
#: requests in flight do not share it). Measured by benchmarks/hub_bench.py on this
#: project's 2-core machines: 4,176 requests in ~8 s of a 20 ms run, about 2 ms each.
REQUEST_CPU = 0.002


@dataclass(frozen=True)
class Span:
    """Bytes ``[start, stop)`` of a file."""

    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class LinkCost:
    """What a request and a byte cost on a link: ``rtt`` seconds per round trip,
    ``bandwidth`` bytes per second, ``parallel`` requests in flight.

    >>> LinkCost(rtt=0.05, bandwidth=25e6, parallel=16).gap_worth_bridging
    78125
    """

    rtt: float
    bandwidth: float
    parallel: int
    request_cpu: float = REQUEST_CPU

    @property
    def per_request(self) -> float:
        """Wall time one more request adds: its share of a round trip, or its CPU."""
        return max(self.rtt / self.parallel, self.request_cpu)

    @property
    def gap_worth_bridging(self) -> int:
        """The largest gap cheaper to transfer than to skip with a second request."""
        return int(self.per_request * self.bandwidth)

    def ranges_time(self, requests: int, nbytes: int) -> float:
        """``requests`` of ``nbytes`` in all: a first round trip, then ``requests x RTT /
        parallel`` (or their CPU) and the bytes' transfer."""
        return (self.rtt if requests else 0.0) + requests * self.per_request + nbytes / self.bandwidth

    def download_time(self, size: int) -> float:
        """A whole file: its redirect and its bytes."""
        return 2 * self.rtt + size / self.bandwidth


def plan_requests(spans: list[Span], cost: LinkCost, *, max_request: int = MAX_REQUEST) -> list[Span]:
    """The requests that bring every byte of ``spans``: sorted, overlapping and adjacent
    spans joined, a gap bridged when it is at most ``cost.gap_worth_bridging``, and no
    request larger than ``max_request`` (a larger span is cut into pieces).

    >>> plan_requests([Span(0, 10), Span(10, 20), Span(1000, 1010)], LinkCost(0.05, 1e5, 32))
    [Span(start=0, stop=20), Span(start=1000, stop=1010)]
    """
    bridge = cost.gap_worth_bridging
    joined: list[Span] = []
    for span in sorted(spans, key=lambda s: s.start):
        if span.size <= 0:
            continue
        if joined and span.start - joined[-1].stop <= bridge:
            last = joined[-1]
            joined[-1] = Span(last.start, max(last.stop, span.stop))
        else:
            joined.append(span)
    requests: list[Span] = []
    for span in joined:
        requests += [Span(at, min(at + max_request, span.stop)) for at in range(span.start, span.stop, max_request)]
    return requests


class RangeCache:
    """Spans of one file at one commit, as files ``START-STOP`` in ``folder``; the
    file's total size in ``folder/size``. Stored spans do not overlap (``put`` writes
    only what is new), so a lookup is a bisection. Writes are atomic (temporary file +
    rename): a killed run leaves no half-written span. Safe to share between threads."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._spans: list[Span] | None = None  # sorted by start
        self._lock = threading.Lock()

    @classmethod
    def for_file(cls, repo_cache: Path, commit: str, file: str) -> RangeCache:
        return cls(repo_cache / "ckptxform-ranges" / commit / quote(file, safe=""))

    def size(self) -> int | None:
        try:
            return int((self.folder / "size").read_text())
        except (OSError, ValueError):
            return None

    def set_size(self, size: int) -> None:
        if self.size() != size:
            self._write(self.folder / "size", str(size).encode())

    def get(self, span: Span) -> bytes | None:
        """The bytes of ``span`` when the stored spans cover all of it, else None."""
        with self._lock:
            spans = list(self._list())
        starts = [s.start for s in spans]
        out = bytearray()
        cursor = span.start
        while cursor < span.stop:
            i = bisect.bisect_right(starts, cursor) - 1
            if i < 0 or spans[i].stop <= cursor:
                return None
            piece = spans[i]
            stop = min(span.stop, piece.stop)
            try:
                with (self.folder / f"{piece.start}-{piece.stop}").open("rb") as fh:
                    fh.seek(cursor - piece.start)
                    chunk = fh.read(stop - cursor)
            except OSError:
                return None
            if len(chunk) != stop - cursor:
                return None
            out += chunk
            cursor = stop
        return bytes(out)

    def missing(self, span: Span) -> list[Span]:
        """The parts of ``span`` not stored (without reading what is)."""
        with self._lock:
            spans = list(self._list())
        out: list[Span] = []
        cursor = span.start
        for piece in spans[max(0, bisect.bisect_right([s.start for s in spans], cursor) - 1):]:
            if piece.start >= span.stop:
                break
            if piece.stop <= cursor:
                continue
            if piece.start > cursor:
                out.append(Span(cursor, piece.start))
            cursor = max(cursor, piece.stop)
        if cursor < span.stop:
            out.append(Span(cursor, span.stop))
        return out

    def put(self, start: int, data: bytes) -> None:
        """Store the parts of ``data`` (the bytes from ``start``) not stored yet."""
        with self._lock:
            spans = self._list()
            cursor, stop = start, start + len(data)
            new: list[Span] = []
            for piece in spans:
                if piece.stop <= cursor or piece.start >= stop:
                    continue
                if piece.start > cursor:
                    new.append(Span(cursor, piece.start))
                cursor = max(cursor, piece.stop)
            if cursor < stop:
                new.append(Span(cursor, stop))
            for piece in new:
                blob = data[piece.start - start : piece.stop - start]
                if self._write(self.folder / f"{piece.start}-{piece.stop}", blob):
                    bisect.insort(spans, piece, key=lambda s: s.start)

    def _list(self) -> list[Span]:
        if self._spans is None:
            found: list[Span] = []
            if self.folder.is_dir():
                for entry in os.listdir(self.folder):
                    first, sep, last = entry.partition("-")
                    if sep and is_ascii_digits(first) and is_ascii_digits(last):
                        found.append(Span(int(first), int(last)))
            self._spans = sorted(found, key=lambda s: s.start)
        return self._spans

    def _write(self, path: Path, data: bytes) -> bool:
        # A read-only or full cache must not fail the run: the bytes are in memory
        # already; only the next run loses the shortcut.
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(data)
            os.replace(tmp, path)
            return True
        except OSError:
            tmp.unlink(missing_ok=True)
            return False
