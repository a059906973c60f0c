"""The write thread's queue (engine/run/write_behind.py): jobs in order, an error handed
back to the caller, and nothing queued once it has stopped (that would wait forever)."""

from __future__ import annotations

import pytest

from ckptxform.engine.run.write_behind import WriteBehind


def test_jobs_run_in_order_and_wait_returns_when_all_ran() -> None:
    behind, done = WriteBehind(held=2), []
    for n in range(10):
        behind.submit(lambda n=n: done.append(n), holds=n % 2 == 0)
    behind.wait()
    behind.stop()
    assert done == list(range(10))


def test_a_job_s_error_is_raised_in_the_caller_and_later_jobs_are_dropped() -> None:
    behind, done = WriteBehind(held=2), []
    err = OSError(28, "No space left on device")

    def fail() -> None:
        raise err

    behind.submit(fail, holds=True)
    behind.submit(lambda: done.append(1), holds=True)
    with pytest.raises(OSError) as raised:
        behind.wait()
    assert raised.value is err and done == []
    behind.stop()


def test_submitting_after_stop_is_refused_instead_of_hanging() -> None:
    behind = WriteBehind(held=2)
    behind.stop()
    for _ in range(3):  # the third would have waited for room no thread makes
        with pytest.raises(RuntimeError, match=r"^the write thread has stopped: nothing more can be written$"):
            behind.submit(lambda: None, holds=True)
