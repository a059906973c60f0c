"""How a Hub file's bytes are fetched: the policy a user sets, and ``auto``'s choice by time.

``ranges`` reads only the spans a run needs, ``download`` fetches the whole file into the
Hugging Face cache. ``auto`` compares their estimated times on the link as measured so
far (``hub_http.LINK``: the plan's requests), ``requests x RTT / parallelism + bytes /
bandwidth`` against ``2 RTT + file size / bandwidth``, and the audit records the choice
with its figures. A bandwidth needs a large answer to be measured (under a 50 ms round
trip a 256 KiB one cannot tell 25 MB/s from 100 MB/s), so ``measure_bandwidth`` times one. ``CKPTXFORM_HUB_LINK=rtt=SECONDS,bandwidth=BYTES_PER_SECOND`` replaces
the measurement (a known link, or reproducible tests).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from ckptxform.errors import UsageError
from ckptxform.sources.hub.http import LINK, PARALLEL_REQUESTS
from ckptxform.sources.hub.ranges import LinkCost, Span

Policy = Literal["auto", "ranges", "download"]
POLICIES: tuple[str, ...] = ("auto", "ranges", "download")
#: Before any request was timed: a round trip and a bandwidth of an ordinary link.
DEFAULT_RTT = 0.05
DEFAULT_BANDWIDTH = 50e6
LINK_VARIABLE = "CKPTXFORM_HUB_LINK"
_FETCH_OPTION = re.compile(r"\?fetch=([^?&]*)$")
_LINK_FIELD = re.compile(r"(rtt|bandwidth)=([0-9.]+(?:e[+-]?[0-9]+)?)")


def split_fetch_option(location: str) -> tuple[str, str | None]:
    """``(location, policy)`` for ``ORG/NAME@REV?fetch=POLICY``, ``(location, None)``
    without the option.

    >>> split_fetch_option("org/model@main?fetch=download")
    ('org/model@main', 'download')
    """
    match = _FETCH_OPTION.search(location)
    if match is None:
        return location, None
    if match.group(1) not in POLICIES:
        raise UsageError(f"{location!r}: fetch={match.group(1)!r} is not one of {', '.join(POLICIES)}; write "
                         "ORG/NAME@REVISION?fetch=auto|ranges|download")
    return location[: match.start()], match.group(1)


#: the reads that measure the bandwidth: a small one (a round trip now), then a large one
PROBE_SMALL = 4 * 1024
PROBE_BYTES = 4 * 1024 * 1024


def needs_probe() -> bool:
    """Whether ``auto`` should measure the bandwidth before choosing: the link is measured
    (no ``CKPTXFORM_HUB_LINK``) and no probe ran yet."""
    return not os.environ.get(LINK_VARIABLE) and not LINK.probed()


def measure_bandwidth(fetch: Callable[[Span], object], start: int) -> None:
    """Time a ``PROBE_SMALL`` read and then the rest of ``PROBE_BYTES`` from ``start`` (the
    first byte a run needs: the rows in it are not read again), back to back so that both
    see the same load: the difference is the large one's transfer time. 0.17 s at 25 MB/s."""
    small = Span(start, start + PROBE_SMALL)
    t0 = time.monotonic()
    fetch(small)
    t1 = time.monotonic()
    fetch(Span(small.stop, start + PROBE_BYTES))
    t2 = time.monotonic()
    # A small read slowed by chance must not make the link look faster than it is: take
    # the least round trip seen, and credit at most 4x the naive rate.
    rtt = min(t1 - t0, LINK.rtt() or t1 - t0)
    LINK.probe((PROBE_BYTES - PROBE_SMALL) / max(t2 - t1 - rtt, (t2 - t1) / 4, 1e-4))


def link_cost() -> LinkCost:
    """The link's cost model: ``CKPTXFORM_HUB_LINK`` when set, else the requests timed so far."""
    text = os.environ.get(LINK_VARIABLE)
    if text:
        fields = [_LINK_FIELD.fullmatch(part.strip()) for part in text.split(",")]
        found = {m.group(1): float(m.group(2)) for m in fields if m is not None}
        if None in fields or set(found) != {"rtt", "bandwidth"} or found["bandwidth"] <= 0:
            raise UsageError(f"{LINK_VARIABLE}={text!r}: write rtt=SECONDS,bandwidth=BYTES_PER_SECOND, "
                             "e.g. rtt=0.05,bandwidth=25e6")
        return LinkCost(rtt=found["rtt"], bandwidth=found["bandwidth"], parallel=PARALLEL_REQUESTS)
    rtt, bandwidth = LINK.rtt(), LINK.bandwidth()
    return LinkCost(rtt=DEFAULT_RTT if rtt is None else rtt, bandwidth=bandwidth or DEFAULT_BANDWIDTH,
                    parallel=PARALLEL_REQUESTS)


@dataclass(frozen=True)
class FetchChoice:
    """How one file's bytes were fetched, and why (an audit ``fetch`` event)."""

    file: str
    policy: str
    choice: Literal["cached", "ranges", "download"]
    requests: int = 0
    nbytes: int = 0
    file_bytes: int | None = None
    ranges_s: float | None = None
    download_s: float | None = None
    cost: LinkCost | None = None
    measured_requests: int = 0
    #: how long the fetch took
    seconds: float | None = None

    def to_event(self, source: str | None) -> dict[str, Any]:
        event: dict[str, Any] = {"event": "fetch", "source": source, "file": self.file, "policy": self.policy,
                                 "choice": self.choice}
        if self.seconds is not None:
            event["seconds"] = _round(self.seconds)
        if self.cost is not None:
            event["estimate"] = {
                "ranges": {"requests": self.requests, "bytes": self.nbytes, "seconds": _round(self.ranges_s)},
                "download": {"bytes": self.file_bytes, "seconds": _round(self.download_s)},
                "link": {"rtt_s": _round(self.cost.rtt), "bandwidth_Bps": round(self.cost.bandwidth),
                         "parallel": self.cost.parallel, "from": ("CKPTXFORM_HUB_LINK" if os.environ.get(LINK_VARIABLE)
                                                                  else f"{self.measured_requests} requests")},
            }
        return event


def choose(file: str, policy: str, requests: int, nbytes: int, file_bytes: int) -> FetchChoice:
    """Ranges or a download for ``file``: ``policy`` unless it is ``auto``, else the faster
    by estimate (a tie downloads: the file then serves other tools from the cache too)."""
    cost = link_cost()
    ranges_s, download_s = cost.ranges_time(requests, nbytes), cost.download_time(file_bytes)
    if policy == "auto":
        choice: Literal["ranges", "download"] = "download" if download_s <= ranges_s else "ranges"
    else:
        choice = "download" if policy == "download" else "ranges"
    return FetchChoice(file, policy, choice, requests, nbytes, file_bytes, ranges_s, download_s, cost, LINK.requests())


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
