"""Every HTTP request of a run bounded, those huggingface_hub makes for it included.

huggingface_hub retries a 429 after the server's ``Retry-After`` (or ``RateLimit``
reset), however long (an hour: "Waiting 3601.0s before retry"), and its read timeout
restarts at every byte, so a server sending one byte a second never times out. Both
bounds of ckptxform hold on every request instead:

- an answer asking to wait longer than ``MAX_RETRY_AFTER`` (60 s) is not waited for:
  ``WaitTooLong`` is raised from the transport, before huggingface_hub's backoff sees it;
- a request whose answer (headers or body) stops: no byte for ``stall_seconds()``
  (``CKPTXFORM_HUB_STALL``, default 30 s) is cut: ``Stalled``, raised from the
  connection's reads, not retried. A slow server that keeps sending is waited for however
  long the answer takes: what tells a dead link from a slow one is whether bytes still
  arrive, not how fast (a rate floor failed live but slow servers, and loaded machines).
  The bound replaces the read timeout of every request (huggingface_hub's
  ``HF_HUB_DOWNLOAD_TIMEOUT`` included, whose expiry it would retry, five times).

``bounded_client`` wraps any ``httpx.Client`` (huggingface_hub's, through its client
factory, and the range client of http.py), keeping its own settings (proxies, TLS).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from ckptxform.errors import UsageError
from ckptxform.sources.hub import meter

#: The longest ``Retry-After`` waited for; a server asking more fails the run at once.
MAX_RETRY_AFTER = 60.0
#: Seconds without a byte after which an answer is taken as dead (``CKPTXFORM_HUB_STALL``).
DEFAULT_STALL = 30.0
STALL_VARIABLE = "CKPTXFORM_HUB_STALL"
_WAIT_STATUS = (429, 503)

_installed = threading.Lock()
_hub_client_bounded = False


class WaitTooLong(Exception):
    """A server asked to wait ``seconds`` (HTTP ``status``) before a retry: more than ckptxform waits."""

    def __init__(self, status: int, seconds: float) -> None:
        super().__init__(f"HTTP {status} asking to wait {seconds:g} s")
        self.status = status
        self.seconds = seconds


class Stalled(Exception):
    """An answer that stopped: no byte for ``seconds``, after ``received`` bytes of it."""

    def __init__(self, received: int, seconds: float) -> None:
        super().__init__(f"no byte for {seconds:g} s after {received} bytes")
        self.received = received
        self.seconds = seconds


def stall_seconds() -> float:
    """The stall bound: ``CKPTXFORM_HUB_STALL`` seconds (a positive number), else 30."""
    text = os.environ.get(STALL_VARIABLE, "").strip()
    if not text:
        return DEFAULT_STALL
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        raise UsageError(f"{STALL_VARIABLE}={text!r}: write the seconds a Hub answer may go without a byte "
                         f"before the run fails, a positive number (default {DEFAULT_STALL:g})")
    return seconds


def bound_hub_client() -> None:
    """Make huggingface_hub's client (whichever factory made it) a bounded one; once per process."""
    global _hub_client_bounded
    with _installed:
        if _hub_client_bounded:
            return
        from huggingface_hub.utils import _http

        previous = _http._GLOBAL_CLIENT_FACTORY
        _http.set_client_factory(lambda: bounded_client(previous()))
        _hub_client_bounded = True


def bounded_client(client: Any) -> Any:
    """``client`` with every transport capping waits and with the stall bound on its connections."""
    client._transport = _CappedTransport(client._transport)
    client._mounts = {pattern: None if transport is None else _CappedTransport(transport)
                      for pattern, transport in client._mounts.items()}
    return client


def asked_wait(status: int, headers: Any) -> float | None:
    """The seconds a 429/503 answer asks to wait, as huggingface_hub's backoff reads them."""
    if status not in _WAIT_STATUS:
        return None
    from huggingface_hub.utils._http import _parse_retry_after, parse_ratelimit_headers

    limit = parse_ratelimit_headers(headers) if status == 429 else None
    if limit is not None and limit.remaining == 0:
        return float(limit.reset_in_seconds)
    value = headers.get("Retry-After")
    if value is None:
        return None
    seconds = _parse_retry_after(headers)
    return float("inf") if seconds is None else float(seconds)  # a date: a long wait


class _CappedTransport:
    """An ``httpx.BaseTransport`` around another: refuses long waits, cuts stalled answers."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        pool = getattr(inner, "_pool", None)
        if pool is not None and not isinstance(getattr(pool, "_network_backend", None), _StallBackend):
            pool._network_backend = _StallBackend(pool._network_backend)

    def handle_request(self, request: Any) -> Any:
        response = self._inner.handle_request(request)
        wait = asked_wait(response.status_code, response.headers)
        if wait is not None and wait > MAX_RETRY_AFTER:
            response.close()
            raise WaitTooLong(response.status_code, wait)
        return response

    def close(self) -> None:
        self._inner.close()

    def __enter__(self) -> _CappedTransport:  # noqa: PYI034 - a wrapper, never subclassed
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.__exit__(*exc)


class _StallBackend:
    """A network backend whose streams cut an answer that stopped."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def connect_tcp(self, *args: Any, **kwargs: Any) -> _StallStream:
        return _StallStream(self._inner.connect_tcp(*args, **kwargs))

    def connect_unix_socket(self, *args: Any, **kwargs: Any) -> _StallStream:
        return _StallStream(self._inner.connect_unix_socket(*args, **kwargs))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def _read_timeout() -> type[Exception]:
    try:
        import httpcore2 as httpcore
    except ImportError:  # huggingface_hub 1.x: httpx on httpcore
        import httpcore  # type: ignore[no-redef]
    return httpcore.ReadTimeout  # type: ignore[no-any-return]


class _StallStream:
    """One connection: every read waits up to the stall bound for its first byte, whatever
    read timeout the caller set; a request's answer is counted from its write."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._received = 0

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._received = 0  # a request: its answer is counted anew
        self._inner.write(buffer, timeout)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        bound = stall_seconds()
        try:
            data = self._inner.read(max_bytes, bound)
        except _read_timeout() as err:
            raise Stalled(self._received, bound) from err
        self._received += len(data)
        meter.streamed(len(data))
        return data

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, *args: Any, **kwargs: Any) -> _StallStream:
        return _StallStream(self._inner.start_tls(*args, **kwargs))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)
