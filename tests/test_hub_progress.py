"""A Hub apply on a terminal shows one bar that moves with the bytes fetched and written
(issue 35 item 5): the real command on a pseudo-terminal, against the test Hub at a 50 ms
round trip and a capped bandwidth, its frames read back from what the terminal received.
Before, the bar counted written bytes only (0% while the verifier's shard arrived, then
100% at once) and huggingface_hub drew its own bar for the download into it."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO
from test_hub_e2e import REPOS, RULE, Served, assert_same_conversion, lm_head_shard, size, sources
from test_hub_e2e import fresh, served  # noqa: F401 - fixtures
from test_hub_shards import SHARDS, sharded_rule  # noqa: F401 - a fixture

_COUNT = r"([0-9.]+)([kMGT]?)"
_SIZE = _COUNT + "B"
#: one frame of the run's bar: ``apply:  42%|####  | 1.23M/2.92M [00:01<00:01, 1.02MB/s, fetched
#: 1.00MB/4.02MB, written 0.00B/410kB]``
_FRAME = re.compile(rf"apply:\s+(\d+)%\|.*?\| {_COUNT}/{_COUNT} \[([0-9:]+)<([0-9:?]+), .*?"
                    rf"(?:fetched {_SIZE}/{_SIZE}, )?written {_SIZE}/{_SIZE}\]")
_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # colours and cursor moves
_SCALE = {"": 1, "k": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


@dataclass(frozen=True)
class Frame:
    percent: int
    shown: float
    total: float
    remaining: str
    fetched: float | None
    fetch_total: float | None
    written: float
    write_total: float


def _bytes(number: str | None, scale: str | None) -> float | None:
    return None if number is None else float(number) * _SCALE[scale or ""]


def frames(text: str) -> list[Frame]:
    """Every frame of the bar the terminal shows (tqdm redraws the line after a ``\\r``)."""
    found = []
    for part in re.split(r"[\r\n]", text):
        match = _FRAME.search(part)
        if match:
            g = match.groups()
            found.append(Frame(int(g[0]), _bytes(g[1], g[2]), _bytes(g[3], g[4]), g[6], _bytes(g[7], g[8]),
                               _bytes(g[9], g[10]), _bytes(g[11], g[12]), _bytes(g[13], g[14])))  # type: ignore[arg-type]
    return found


def run_on_terminal(args: list[str | Path], env: dict[str, str]) -> tuple[int, str]:
    """Run ``ckptxform ARGS`` with stderr on a 200-column pseudo-terminal: its exit status
    and everything the terminal received."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    received = bytearray()

    def read() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # the terminal closed (EIO on Linux)
                return
            if not data:
                return
            received.extend(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc = subprocess.run([sys.executable, "-m", "ckptxform", *map(str, args)], env=env, cwd=REPO,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=slave, timeout=300,
                              check=False)
    finally:
        os.close(slave)
        reader.join(timeout=30)
        os.close(master)
    return proc.returncode, _ESCAPE.sub("", received.decode(errors="replace"))


@pytest.fixture
def slow_link(fresh: Served) -> Iterator[Served]:  # noqa: F811
    """The test Hub at a 50 ms round trip and 2 MB/s for every body together."""
    latency, bandwidth = fresh.server.latency, fresh.server.link.bandwidth
    fresh.server.latency, fresh.server.link.bandwidth = 0.05, 2e6
    try:
        yield fresh
    finally:
        fresh.server.latency, fresh.server.link.bandwidth = latency, bandwidth


@pytest.mark.parametrize("workers", [1, 2])
def test_a_hub_apply_shows_one_bar_moving_with_the_bytes_fetched_and_written(
        slow_link: Served, sharded_rule: Path, tmp_path: Path, workers: int) -> None:  # noqa: F811
    """The verifier's lm_head shard (~4 MiB) is downloaded at 2 MB/s: the bar shows its
    bytes arriving (intermediate counts of both the fetched bytes and the bar), ends with
    every byte fetched and written, never shows an ETA in hours, and no other bar (the
    download's own, named after the shard) or huggingface_hub log line is drawn. With two
    workers (the rule cut into shards) the worker that downloads reports its bytes to the
    parent's bar."""
    hub = slow_link
    shard = lm_head_shard(hub)
    out = tmp_path / "out"
    rule, jobs = (RULE, []) if workers == 1 else (sharded_rule, ["--jobs", "2"])
    status, screen = run_on_terminal(
        ["apply", rule, *sources(hub, "main"), "--source", f"verifier={REPOS['verifier']}@main?fetch=download",
         "--out", out, *jobs], hub.env(tmp_path / "home"))
    assert status == 0, screen
    if workers == 1:
        assert_same_conversion(hub, out)
    else:
        assert len(list(out.glob("*.safetensors"))) == SHARDS

    shown = frames(screen)
    assert shown, screen
    moving = [f for f in shown if f.fetched is not None and 0 < f.fetched < (f.fetch_total or 0)]
    assert moving, screen  # bytes seen arriving, not 0% then 100%
    assert any(0 < f.percent < 100 for f in moving), screen
    assert [f.shown for f in shown] == sorted(f.shown for f in shown)  # the bar never runs back
    last = shown[-1]
    assert last.percent == 100 and last.fetched == last.fetch_total and last.written == last.write_total, last
    assert last.fetch_total == pytest.approx(size(hub.folders[REPOS["verifier"]] / shard), rel=0.01)
    assert all(f.remaining == "?" or f.remaining.count(":") == 1 for f in shown), screen  # no ETA in hours

    lines = [line.strip() for line in re.split(r"[\r\n]", screen) if line.strip()]
    bars = [line for line in lines if "%|" in line]
    assert all(line.startswith("apply:") and line.endswith("]") for line in bars), screen  # the run's, whole
    assert not any(shard in line for line in bars), screen  # huggingface_hub's download bar is named so
    others = [line for line in lines if "%|" not in line and not line.startswith(("WARNING ", "INFO "))]
    assert others == [], screen  # nothing but the bar and ckptxform's own lines, each on a line of its own
