"""Every HTTP request of a run bounded, those huggingface_hub makes for it included.

huggingface_hub retries a 429 after the server's ``Retry-After`` (or ``RateLimit``
reset), however long (an hour: "Waiting 3601.0s before retry"), and its read timeout
restarts at every byte, so a server sending one byte a second never times out. Both
bounds of ckptxform hold on every request instead:

- an answer asking to wait longer than ``MAX_RETRY_AFTER`` (60 s) is not waited for:
  ``WaitTooLong`` is raised from the transport, before huggingface_hub's backoff sees it;
- a request whose answer (headers and body) arrives slower than ``MIN_BYTES_PER_SECOND``
  after a grace of the read timeout (``HF_HUB_DOWNLOAD_TIMEOUT``) is cut: ``TooSlow``,
  raised from the connection's reads.

``bounded_client`` wraps any ``httpx.Client`` (huggingface_hub's, through its client
factory, and the range client of http.py), keeping its own settings (proxies, TLS).
"""

from __future__ import annotations

import threading
import time
from typing import Any

#: The longest ``Retry-After`` waited for; a server asking more fails the run at once.
MAX_RETRY_AFTER = 60.0
#: A request answered slower than this (after the read timeout's grace) is refused, not waited for.
MIN_BYTES_PER_SECOND = 64 * 1024
_WAIT_STATUS = (429, 503)

_installed = threading.Lock()
_hub_client_bounded = False


class WaitTooLong(Exception):
    """A server asked to wait ``seconds`` (HTTP ``status``) before a retry: more than ckptxform waits."""

    def __init__(self, status: int, seconds: float) -> None:
        super().__init__(f"HTTP {status} asking to wait {seconds:g} s")
        self.status = status
        self.seconds = seconds


class TooSlow(Exception):
    """An answer arriving under MIN_BYTES_PER_SECOND: ``received`` bytes in ``seconds``."""

    def __init__(self, received: int, seconds: float) -> None:
        super().__init__(f"{received} bytes in {seconds:.0f} s")
        self.received = received
        self.seconds = seconds


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
    """``client`` with every transport capping waits and with a rate floor on its connections."""
    client._transport = _CappedTransport(client._transport)
    client._mounts = {pattern: None if transport is None else _CappedTransport(transport)
                      for pattern, transport in client._mounts.items()}
    return client


def grace() -> float:
    """Seconds an answer may take before the rate floor applies (the read timeout)."""
    from huggingface_hub import constants

    return float(constants.HF_HUB_DOWNLOAD_TIMEOUT)


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
    """An ``httpx.BaseTransport`` around another: refuses long waits, floors the rate."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        pool = getattr(inner, "_pool", None)
        if pool is not None and not isinstance(getattr(pool, "_network_backend", None), _FloorBackend):
            pool._network_backend = _FloorBackend(pool._network_backend)

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


class _FloorBackend:
    """A network backend whose streams cut a request answered too slowly."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def connect_tcp(self, *args: Any, **kwargs: Any) -> _FloorStream:
        return _FloorStream(self._inner.connect_tcp(*args, **kwargs))

    def connect_unix_socket(self, *args: Any, **kwargs: Any) -> _FloorStream:
        return _FloorStream(self._inner.connect_unix_socket(*args, **kwargs))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def _read_timeout() -> type[Exception]:
    try:
        import httpcore2 as httpcore
    except ImportError:  # huggingface_hub 1.x: httpx on httpcore
        import httpcore  # type: ignore[no-redef]
    return httpcore.ReadTimeout  # type: ignore[no-any-return]


class _FloorStream:
    """One connection: each request (a write, then reads) must be answered at the floor."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._started = time.monotonic()
        self._received = 0

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._started, self._received = time.monotonic(), 0  # a request: its answer is timed anew
        self._inner.write(buffer, timeout)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        left = self._started + grace() + self._received / MIN_BYTES_PER_SECOND - time.monotonic()
        if left <= 0:
            raise TooSlow(self._received, time.monotonic() - self._started)
        try:
            data = self._inner.read(max_bytes, left if timeout is None else min(timeout, left))
        except _read_timeout() as err:
            if timeout is None or left < timeout:  # the floor's bound, not the caller's
                raise TooSlow(self._received, time.monotonic() - self._started) from err
            raise
        self._received += len(data)
        return data

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, *args: Any, **kwargs: Any) -> _FloorStream:
        return _FloorStream(self._inner.start_tls(*args, **kwargs))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)
