"""quant/pipeline.py ``then_in_order``: blocks computed on several threads, each handed to
``then`` in the tasks' order on the thread that computed it (how the FP8 dequant hashes and
writes a block where it was decoded); the first error stops the rest and is raised, with
nothing written after it and no thread left waiting. Each worker, the caller among them,
reads its own tasks (advances the iterable) and holds one block at a time; ``in_order``
lets go of its first blocks too."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from ckptxform.quant.pipeline import then_in_order


def _tasks(count: int, made: list[int], fail_at: int | None = None,
           delay: Callable[[int], float] = lambda i: 0.0) -> Iterator[Callable[[], tuple[int, int]]]:
    """Task ``i`` returns (i, the thread that ran it); advancing the iterator is a read (``made``)."""
    for i in range(count):
        made.append(i)

        def task(i: int = i) -> tuple[int, int]:
            time.sleep(delay(i))
            if i == fail_at:
                raise RuntimeError(f"block {i} failed")
            return i, threading.get_ident()
        yield task


def test_results_reach_then_in_order_on_the_thread_that_made_them() -> None:
    made: list[int] = []
    seen: list[int] = []
    inside = threading.Lock()
    threads: set[int] = set()

    def then(result: tuple[int, int]) -> None:
        assert inside.acquire(blocking=False), "two thens at once"
        try:
            number, maker = result
            assert maker == threading.get_ident()  # where the block was computed
            threads.add(maker)
            seen.append(number)
        finally:
            inside.release()

    # later blocks finish first: each still waits for the one before it
    then_in_order(_tasks(40, made, delay=lambda i: 0.004 if i % 3 == 0 else 0.0), then, workers=2)
    assert seen == list(range(40)) and made == list(range(40))
    assert len(threads) == 2


def test_one_task_runs_on_the_callers_thread_and_none_is_nothing() -> None:
    seen: list[tuple[int, int]] = []
    then_in_order(_tasks(1, []), seen.append)
    assert seen == [(0, threading.get_ident())]
    then_in_order(_tasks(0, []), seen.append)
    assert len(seen) == 1


def test_reads_stay_within_the_workers() -> None:
    """Memory stays bounded: at most ``workers`` tasks are read (the iterator advanced)
    and not yet handed to ``then``."""
    made: list[int] = []
    ahead: list[int] = []

    def then(result: tuple[int, int]) -> None:
        ahead.append(len(made) - result[0] - 1)

    then_in_order(_tasks(30, made, delay=lambda i: 0.002), then, workers=2)
    assert max(ahead) <= 2 - 1  # the other worker's task, besides the one in ``then``


@pytest.mark.parametrize("where", ["task", "then"])
def test_the_first_error_stops_the_rest_and_is_raised(where: str) -> None:
    made: list[int] = []
    seen: list[int] = []

    def then(result: tuple[int, int]) -> None:
        if where == "then" and result[0] == 7:
            raise OSError(28, "No space left on device")
        seen.append(result[0])

    started = time.monotonic()
    expected = (RuntimeError, "block 7 failed") if where == "task" else (OSError, "No space left")
    with pytest.raises(expected[0], match=expected[1]):
        # block 8 is quick: it is done, and waiting for its turn, when 7 fails
        then_in_order(_tasks(1000, made, fail_at=7 if where == "task" else None,
                             delay=lambda i: 0.05 if i == 7 else 0.0), then, workers=2)
    assert seen == list(range(7))  # nothing after the failure is written
    assert len(made) <= 7 + 4  # the rest is not read
    assert time.monotonic() - started < 30  # no worker left waiting for a turn that never comes
    assert not [t for t in threading.enumerate() if t.name.startswith("ckptxform-block")]  # the pool has ended


def test_a_failed_read_stops_the_rest_and_is_raised() -> None:
    """A read (advancing the iterable, on whichever worker is free) that fails is the error
    raised: no ``then`` of a later task, nothing read after it, no thread left."""
    made: list[int] = []
    seen: list[int] = []

    def reads() -> Iterator[Callable[[], tuple[int, int]]]:
        for i, task in enumerate(_tasks(1000, made, delay=lambda i: 0.001)):
            if i == 7:
                raise OSError(5, "Input/output error")
            yield task

    with pytest.raises(OSError, match="Input/output error"):
        then_in_order(reads(), lambda result: seen.append(result[0]), workers=2)
    assert seen == list(range(len(seen))) and len(seen) <= 7  # in order, none after the failed read
    assert len(made) == 8  # the failed read was the last
    assert not [t for t in threading.enumerate() if t.name.startswith("ckptxform-block")]


def test_a_worker_lets_go_of_a_block_before_reading_the_next() -> None:
    """Memory: when a worker reads a block, it no longer holds the one before (neither its
    bytes read nor its result); only the other worker's block and the new read are alive."""
    import gc
    import weakref

    class Block:  # bytes read or decoded
        pass

    alive: weakref.WeakSet[Block] = weakref.WeakSet()
    at_read: list[int] = []

    def reads() -> Iterator[Callable[[], Block]]:
        for _ in range(60):
            gc.collect()  # no cycle keeps a block alive; only references do
            at_read.append(len(alive))
            read = Block()
            alive.add(read)

            def task(read: Block = read) -> Block:
                time.sleep(0.001)
                out = Block()
                alive.add(out)
                return out
            yield task

    then_in_order(reads(), lambda block: None, workers=2)
    assert max(at_read) <= 2  # the other worker's read and result; none of this worker's


def test_in_order_lets_go_of_the_first_two_blocks() -> None:
    """``in_order`` (the other pipeline) reads the first two tasks before starting its pool;
    held there, their bytes read would live until the tensor's end."""
    import gc
    import weakref

    from ckptxform.quant.pipeline import in_order

    class Block:
        pass

    first_reads: list[weakref.ref[Block]] = []
    gone_by_the_tenth: list[bool] = []

    def reads() -> Iterator[Callable[[], int]]:
        for i in range(12):
            if i == 10:  # a pool thread may not yet have dropped its last task: it may take a moment
                deadline = time.monotonic() + 10
                while any(ref() is not None for ref in first_reads) and time.monotonic() < deadline:
                    gc.collect()
                    time.sleep(0.005)
                gone_by_the_tenth.append(all(ref() is None for ref in first_reads))
            read = Block()
            if i < 2:
                first_reads.append(weakref.ref(read))
            yield lambda i=i, read=read: i
    assert list(in_order(reads(), workers=2)) == list(range(12))
    assert gone_by_the_tenth == [True]
