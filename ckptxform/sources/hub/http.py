"""Range reads of one Hub file: its redirect followed once, every answer checked against
the object first seen, and the link's round-trip time and bandwidth measured on the way.

The Hub answers ``resolve`` of a weight file with a 302 to a CDN URL, signed and valid for
a while. ``RemoteFile`` resolves once (``huggingface_hub.get_hf_file_metadata``, one HEAD)
and sends every range of the file to that URL, resolving again only when the CDN refuses
it (expired); the token goes to the Hub only, never to the CDN. Every answer must be a
206 for exactly the bytes asked, of the file's size, unencoded, with the ETag of the
file's first answer (the CDN's ETag is not the Hub's ``X-Linked-Etag``, so each is
compared with its own first value): anything else is a ``BadAnswer`` (the server, or a
proxy, misbehaves: not retried) or a ``CutResponse`` (cut short: retried). An answer that
stops past ``bounded.stall_seconds()`` fails, and ``MAX_REDIRECTS`` bounds redirects.

Requests share one HTTP/1.1 keep-alive pool sized for ``PARALLEL_REQUESTS`` in flight.
"""

from __future__ import annotations

import re
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

from ckptxform.digits import ascii_int
from ckptxform.sources.hub import meter
from ckptxform.sources.hub.bounded import bounded_client
from ckptxform.sources.hub.ranges import Span

#: Requests in flight at once: a round trip of 50 ms then costs ~1.6 ms of wall time.
PARALLEL_REQUESTS = 32
MAX_REDIRECTS = 10
#: What a CDN answers for a signed URL that expired or was revoked: resolve again.
_EXPIRED = (401, 403, 404, 410)
_CONTENT_RANGE = re.compile(r"bytes ([0-9]+)-([0-9]+)/([0-9]+)")  # \d would admit any script\'s digits

_client_lock = threading.Lock()
_client: Any = None


class CutResponse(OSError):
    """A range answer cut short (worth a retry)."""


class BadAnswer(Exception):
    """A range answer that is not the bytes asked of the object first seen. ``reason``
    completes ``file 'x': ...``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class LinkStats:
    """The link as the requests made so far saw it: the round trip is the median time of
    small answers; the bandwidth is what ``probe`` measured, else the bytes of large
    answers over their time beyond a round trip (a rough figure: under a 50 ms round trip
    a 256 KiB answer cannot tell 25 MB/s from 100 MB/s)."""

    SMALL = 64 * 1024
    LARGE = 128 * 1024

    def __init__(self) -> None:
        self._samples: list[tuple[float, int]] = []
        self._probed: float | None = None
        self._lock = threading.Lock()

    def record(self, seconds: float, nbytes: int) -> None:
        with self._lock:
            self._samples.append((seconds, nbytes))

    def probe(self, bandwidth: float) -> None:
        """A bandwidth measured on purpose (``hub_fetch.measure_bandwidth``)."""
        with self._lock:
            self._probed = bandwidth

    def probed(self) -> bool:
        with self._lock:
            return self._probed is not None

    def rtt(self) -> float | None:
        with self._lock:
            small = [t for t, n in self._samples if n <= self.SMALL]
        return statistics.median(small) if small else None

    def bandwidth(self) -> float | None:
        if self._probed is not None:
            return self._probed
        rtt = self.rtt() or 0.0
        with self._lock:
            large = [(t, n) for t, n in self._samples if n >= self.LARGE]
        if not large:
            return None
        return sum(n for _, n in large) / max(1e-6, sum(max(t - rtt, 1e-6) for t, _ in large))

    def requests(self) -> int:
        with self._lock:
            return len(self._samples)


#: one link per process: every Hub source of a run goes over it
LINK = LinkStats()


@dataclass(frozen=True)
class Resolved:
    """What the Hub said of a file: where its bytes are, its size and ETag."""

    url: str
    size: int | None
    etag: str | None


class RemoteFile:
    """One file at one commit, as first resolved; ``read`` brings a span of it. Safe to
    share between threads."""

    def __init__(self, resolve_url: str, *, resolve: Callable[[], Resolved] | None = None) -> None:
        self.resolve_url = resolve_url
        self._resolve_fn = resolve or (lambda: _metadata(resolve_url))
        self._lock = threading.Lock()
        self._target: Resolved | None = None
        self._first: Resolved | None = None
        self._etag: str | None = None  # of the first range answer

    @property
    def size(self) -> int | None:
        return self.target().size

    @property
    def etag(self) -> str | None:
        """The ETag of the first range answer (None before it)."""
        return self._etag

    def expect_etag(self, etag: str) -> None:
        """Take ``etag`` as the first answer's: a worker process holds to what its run
        read first, so that a file changing between two processes' reads is refused too."""
        with self._lock:
            self._etag = etag

    def target(self) -> Resolved:
        with self._lock:
            if self._target is None:
                self._target = self._pinned(self._resolve())
            return self._target

    def read(self, span: Span) -> bytes:
        """The bytes of ``span`` (cut at the end of the file)."""
        target = self.target()
        try:
            return self._get(target, span)
        except _Expired:
            with self._lock:
                if self._target is target:  # another thread may have resolved already
                    self._target = self._pinned(self._resolve())
                target = self._target
            return self._get(target, span, expired_ok=False)

    # -- internals -------------------------------------------------------------------
    def _resolve(self) -> Resolved:
        started = time.monotonic()
        resolved = self._resolve_fn()
        LINK.record(time.monotonic() - started, 0)
        return resolved

    def _pinned(self, resolved: Resolved) -> Resolved:
        """``resolved``, after checking it names the object first resolved."""
        if self._first is None:
            self._first = resolved
        elif (resolved.etag, resolved.size) != (self._first.etag, self._first.size):
            raise BadAnswer(
                f"changed on the server during the run (ETag {self._first.etag!r}, {self._first.size} bytes "
                f"when first resolved; now {resolved.etag!r}, {resolved.size} bytes); rerun to read one version"
            )
        return resolved

    def _get(self, target: Resolved, span: Span, *, expired_ok: bool = True) -> bytes:
        from huggingface_hub import constants
        from huggingface_hub.errors import OfflineModeIsEnabled
        from huggingface_hub.utils import hf_raise_for_status

        if constants.is_offline_mode():
            raise OfflineModeIsEnabled(f"Cannot reach {self.resolve_url}: offline mode is enabled.")
        stop = span.stop if target.size is None else min(span.stop, target.size)
        if stop <= span.start:
            return b""
        url, started = target.url, time.monotonic()
        for _ in range(MAX_REDIRECTS + 1):
            with _session().stream("GET", url, headers=_headers(url, span.start, stop)) as response:
                if response.has_redirect_location:
                    url = urljoin(url, response.headers["Location"])
                    continue
                if response.status_code in _EXPIRED and expired_ok and _origin(url) != _origin(self.resolve_url):
                    raise _Expired
                if response.status_code >= 400:
                    if (ascii_int(response.headers.get("Content-Length")) or 0) < 1 << 20:
                        response.read()
                    hf_raise_for_status(response)
                body = self._checked_body(response, span.start, stop, target.size)
            LINK.record(time.monotonic() - started, len(body))
            return body
        raise BadAnswer(f"more than {MAX_REDIRECTS} redirects (a redirect loop at {urlsplit(url).netloc}); check "
                        "HF_ENDPOINT and any proxy")

    def _checked_body(self, response: Any, start: int, stop: int, size: int | None) -> bytes:
        encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise BadAnswer(f"the server answered a range with Content-Encoding {encoding!r} although 'identity' "
                            "was asked; ckptxform reads raw bytes only (check HF_ENDPOINT and any proxy)")
        if response.status_code == 200:
            return self._whole_body(response, start, stop, size)
        if response.status_code != 206:
            raise BadAnswer(f"the server answered HTTP {response.status_code} with "
                            f"{response.headers.get('Content-Length', 'an unknown number of')} bytes where part "
                            f"{start}-{stop - 1} (HTTP 206) was asked (check HF_ENDPOINT and any proxy)")
        got = response.headers.get("Content-Range", "")
        match = _CONTENT_RANGE.fullmatch(got.strip())
        if (match is None or (int(match.group(1)), int(match.group(2))) != (start, stop - 1)
                or (size is not None and int(match.group(3)) != size)):
            raise BadAnswer(f"asked for bytes {start}-{stop - 1} of {size if size is not None else '?'}, the server "
                            f"answered Content-Range {got!r} (check HF_ENDPOINT and any proxy)")
        self._check_etag(response)
        length = response.headers.get("Content-Length")
        if length is not None and length.strip() != str(stop - start):
            raise BadAnswer(f"the server answered {length.strip()} bytes for bytes {start}-{stop - 1} "
                            f"({stop - start} asked) (check HF_ENDPOINT and any proxy)")
        return _read_body(response, stop - start)

    def _whole_body(self, response: Any, start: int, stop: int, size: int | None) -> bytes:
        """A server (or proxy) that ignores Range sends the whole file: within the window
        asked, its body holds the bytes asked; beyond it, ``RangeIgnored`` (download instead)."""
        whole = ascii_int(response.headers.get("Content-Length"))
        if size is not None and whole is not None and whole != size:
            raise BadAnswer(f"the server answered HTTP 200 with {whole} bytes for a file of {size} bytes where part "
                            f"{start}-{stop - 1} (HTTP 206) was asked (check HF_ENDPOINT and any proxy)")
        if whole is None or whole > stop:  # the file goes on past the window asked: download it
            raise RangeIgnored(whole)
        self._check_etag(response)
        return _read_body(response, whole)[start:stop]

    def _check_etag(self, response: Any) -> None:
        etag = response.headers.get("ETag")
        with self._lock:
            if self._etag is None:
                self._etag = etag
            elif etag != self._etag:
                raise BadAnswer(f"changed on the server during the run (ETag {self._etag!r} at the first read, "
                                f"{etag!r} now); rerun to read one version")


class RangeIgnored(Exception):
    """The server answered a range with the whole file (HTTP 200), larger than the range
    asked: the caller downloads the file instead."""

    def __init__(self, size: int | None) -> None:
        super().__init__(f"HTTP 200 with the whole file, {size if size is not None else 'an unknown number of'} bytes")
        self.size = size


class _Expired(Exception):
    """The signed CDN URL no longer works."""


def _read_body(response: Any, expected: int) -> bytes:
    """The body, as the bytes arrive (the client's connections cut one that stops)."""
    body = bytearray()
    try:
        for chunk in response.iter_raw():  # as the bytes arrive (a chunk size would wait for it)
            body += chunk
            meter.arrived(len(chunk))
            if len(body) > expected:
                raise BadAnswer(f"the server sent more than the {expected} bytes asked")
        if len(body) != expected:
            raise CutResponse(f"{len(body)} of {expected} bytes")
    except BaseException:
        meter.arrived(-len(body))  # a retry fetches them again
        raise
    return bytes(body)


def _metadata(url: str) -> Resolved:
    from huggingface_hub import constants, get_hf_file_metadata

    meta = get_hf_file_metadata(url, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    return Resolved(url=str(meta.location), size=meta.size, etag=meta.etag)


def _headers(url: str, start: int, stop: int) -> dict[str, str]:
    from huggingface_hub import constants
    from huggingface_hub.utils import build_hf_headers

    headers = dict(build_hf_headers())
    if _origin(url) != _origin(constants.ENDPOINT):
        headers.pop("authorization", None)  # a signed CDN URL: the token stays with the Hub
    headers["Range"] = f"bytes={start}-{stop - 1}"
    headers["Accept-Encoding"] = "identity"  # sizes and offsets are of the raw bytes
    return headers


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port


def _session() -> Any:
    """One keep-alive pool for every range request of the process."""
    global _client
    with _client_lock:
        if _client is None:
            from huggingface_hub import constants

            try:
                import httpx2 as httpx
            except ImportError:  # huggingface_hub 1.x uses httpx
                import httpx  # type: ignore[no-redef]
            _client = bounded_client(httpx.Client(
                limits=httpx.Limits(max_connections=PARALLEL_REQUESTS, max_keepalive_connections=PARALLEL_REQUESTS),
                timeout=httpx.Timeout(float(constants.HF_HUB_DOWNLOAD_TIMEOUT),
                                      connect=float(constants.HF_HUB_ETAG_TIMEOUT), pool=None),
                follow_redirects=False,
            ))
        return _client
