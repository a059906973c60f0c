"""Byte ranges of remote files: which requests to send, and a disk cache of what came back.

A row gather from a large remote tensor needs many small scattered byte spans. Sending
one request per span costs a round trip each; merging spans across the gaps between
them costs the gap's bytes. ``plan_requests`` merges adjacent spans always, and spans
separated by a gap only while the merged gaps stay under a small share of the bytes
actually needed, so the bytes moved stay within ``max_waste`` of the bytes needed.

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

#: A gap larger than this is never bridged: a second request is cheaper than 64 KiB.
MAX_GAP = 64 * 1024
#: The merged gaps of one request stay under this share of the bytes it must bring.
MAX_WASTE = 0.05
#: One response is held in memory whole, so gaps are not bridged past this size.
MAX_REQUEST = 64 * 1024 * 1024


@dataclass(frozen=True)
class Span:
    """Bytes ``[start, stop)`` of a file."""

    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def plan_requests(
    spans: list[Span], *, max_gap: int = MAX_GAP, max_waste: float = MAX_WASTE, max_request: int = MAX_REQUEST
) -> list[Span]:
    """The requests that bring every byte of ``spans``: sorted, adjacent or overlapping
    spans joined, and a gap bridged only when it is at most ``max_gap`` and the request's
    bridged gaps stay within ``max_waste`` of the bytes it needs.

    >>> plan_requests([Span(0, 10), Span(10, 20), Span(1000, 1010)], max_waste=0.5)
    [Span(start=0, stop=20), Span(start=1000, stop=1010)]
    """
    requests: list[Span] = []
    needed = wasted = 0  # of the request being built
    for span in sorted(spans, key=lambda s: s.start):
        if span.size <= 0:
            continue
        if requests:
            last = requests[-1]
            gap = span.start - last.stop
            new_stop = max(last.stop, span.stop)
            fits = new_stop - last.start <= max_request
            if gap <= 0 and fits:
                needed += max(0, span.stop - last.stop)
                requests[-1] = Span(last.start, new_stop)
                continue
            if 0 < gap <= max_gap and fits and wasted + gap <= max_waste * (needed + span.size):
                needed += span.size
                wasted += gap
                requests[-1] = Span(last.start, new_stop)
                continue
        requests.append(span)
        needed, wasted = span.size, 0
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
                    if sep and first.isdigit() and last.isdigit():
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
