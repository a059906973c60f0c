"""The fetch meter behind the run's bar (sources/hub/meter.py): what it counts, and that it
leaves huggingface_hub as it found it (issue 35 item 5)."""

from __future__ import annotations

import logging
import threading

import huggingface_hub  # noqa: F401 - loaded, as in a Hub run: its logger is then held back
from huggingface_hub.utils import are_progress_bars_disabled

from ckptxform.sources.hub import meter


def test_reporting_holds_huggingface_hubs_log_lines_back_and_gives_its_level_back() -> None:
    hub_logger = logging.getLogger("huggingface_hub")
    before, bars_before = hub_logger.level, are_progress_bars_disabled()
    seen: list[tuple[int, int]] = []
    with meter.reporting(lambda e, a: seen.append((e, a))):
        assert hub_logger.getEffectiveLevel() >= logging.ERROR
        meter.expect(10)
        meter.arrived(4)
    meter.arrived(99)  # after the run: nobody listens
    assert seen == [(10, 0), (0, 4)]
    assert hub_logger.level == before
    assert are_progress_bars_disabled() == bars_before  # no global switch was touched


def test_a_download_counts_what_its_connection_reads_then_the_body_it_saw() -> None:
    """huggingface_hub updates its bar once per 10 MB chunk: the bytes its thread's
    connection reads are counted as they come, and the count is made the body's at the end."""
    seen: list[tuple[int, int]] = []
    with meter.reporting(lambda e, a: seen.append((e, a))):
        with meter.ByteCounter(total=1000, initial=100, desc="x", unit="B") as counter:
            meter.streamed(300)  # this thread's connection, mid-download
            other = threading.Thread(target=meter.streamed, args=(5000,))  # another thread's: not this download
            other.start()
            other.join()
            meter.streamed(650)  # 950: a head's bytes read with the body's are counted too
            counter.update(900)
    assert seen[0] == (900, 0)
    assert sum(a for _, a in seen) == 900
    assert [a for _, a in seen[1:]] == [300, 650, -50]
    meter.streamed(10)  # the download is over: nothing counts it
    assert sum(a for _, a in seen) == 900
