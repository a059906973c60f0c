"""What a test puts between the client and the test Hub (``hubserver.HubServer``): faults
(5xx and 429 answers, connections reset mid-body, and the misbehaviours a client must
refuse, ``MISBEHAVIOURS``) and one shared link of bounded bandwidth.

``FaultInjection`` is the part of ``HubServer`` a test calls (``fail``, ``reset``,
``misbehave``, ``clear_faults``); the request handler takes the fault of each request
with ``take_fault`` and acts it out.
"""

from __future__ import annotations

import fnmatch
import threading
import time
from dataclasses import dataclass, field

from hub_repos import HubFile

#: what ``misbehave`` can do; see its docstring
MISBEHAVIOURS = ("swap", "bad_range", "short", "whole", "gzip", "loop", "retry_after", "echo_auth", "trickle",
                 "stall")
#: the longest a "stall" holds its connection when no test clears it (seconds)
STALL_HOLD = 120.0


@dataclass
class Fault:
    pattern: str
    method: str | None
    kind: str  # "status", "reset" or one of MISBEHAVIOURS
    remaining: int
    host: str | None = None
    skip: int = 0  # matching requests let through before the fault starts
    status: int = 500
    after_bytes: int = 0
    retry_after: int = 0
    other: HubFile | None = None  # "swap": whose bytes are served instead
    delay: float = 1.0  # "trickle": seconds between bytes
    released: threading.Event = field(default_factory=threading.Event)  # "stall": set by clear_faults


class FaultInjection:
    """The faults of the next matching requests, in the order they were asked for."""

    def __init__(self) -> None:
        self._faults: list[Fault] = []
        self._faults_lock = threading.Lock()

    def fail(self, pattern: str, *, status: int = 500, times: int = 1, method: str | None = None) -> None:
        """The next ``times`` requests whose decoded path matches ``pattern`` (fnmatch)
        get ``status`` with a JSON error body."""
        with self._faults_lock:
            self._faults.append(Fault(pattern, method, "status", times, status=status))

    def reset(self, pattern: str, *, after_bytes: int = 0, times: int = 1, method: str | None = "GET") -> None:
        """The next ``times`` matching requests get their headers and ``after_bytes``
        bytes of body, then a TCP reset."""
        with self._faults_lock:
            self._faults.append(Fault(pattern, method, "reset", times, after_bytes=after_bytes))

    def misbehave(
        self,
        pattern: str,
        kind: str,
        *,
        times: int = 1,
        skip: int = 0,
        host: str | None = None,
        method: str | None = "GET",
        retry_after: int = 3600,
        other: HubFile | None = None,
        after_bytes: int = 0,
        delay: float = 1.0,
    ) -> None:
        """The next ``times`` matching requests after ``skip`` of them (on ``host``, None:
        either) get ``kind``: ``swap`` serves ``other``'s bytes and ETag (the file changed
        on the server); ``bad_range`` a Content-Range one byte off; ``short`` a body cut
        ``after_bytes`` in, as a complete answer; ``whole`` a 200 with the whole file;
        ``gzip`` the range gzip-encoded; ``loop`` a redirect to itself; ``retry_after`` a
        429 asking to wait ``retry_after`` s; ``echo_auth`` a 400 whose message quotes the
        request's Authorization header; ``trickle`` one body byte every ``delay`` s (for a
        HEAD, one byte of the answer's head); ``stall`` the answer's head and ``after_bytes``
        of its body (for a HEAD, half its head), then nothing, the connection held open until
        ``clear_faults`` (a dead link: no reset, no end)."""
        assert kind in MISBEHAVIOURS, kind
        with self._faults_lock:
            self._faults.append(Fault(pattern, method, kind, times, host=host, skip=skip, retry_after=retry_after,
                                       other=other, after_bytes=after_bytes, delay=delay))

    def clear_faults(self) -> None:
        with self._faults_lock:
            for fault in self._faults:
                fault.released.set()
            self._faults.clear()

    def take_fault(self, host: str, method: str, path: str) -> Fault | None:
        with self._faults_lock:
            for fault in self._faults:
                if (fault.remaining > 0 and fault.method in (None, method) and fault.host in (None, host)
                        and fnmatch.fnmatch(path, fault.pattern)):
                    if fault.skip > 0:
                        fault.skip -= 1
                        continue
                    fault.remaining -= 1
                    return fault
        return None


class Link:
    """One network link shared by every answer: ``bandwidth`` bytes per second in all."""

    def __init__(self, bandwidth: float | None) -> None:
        self.bandwidth = bandwidth
        self._free_at = 0.0
        self._lock = threading.Lock()

    def send(self, nbytes: int) -> None:
        """Wait until ``nbytes`` more fit through the link."""
        if not self.bandwidth:
            return
        with self._lock:
            now = time.monotonic()
            self._free_at = max(now, self._free_at) + nbytes / self.bandwidth
            wait = self._free_at - now
        time.sleep(wait)
