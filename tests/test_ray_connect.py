"""``--executor ray`` with an address that answers nothing (issue 22 item 9): the connect is
bounded, SIGTERM is acted on while it waits, and nothing is left beside OUT. No cluster,
and Ray need not be installed: the address is refused before Ray is imported.

The address that answers nothing is a local socket whose accept queue is full: the
kernel drops further connection attempts, as a firewall or a dead host would.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import assert_clean_failure, error_lines, source_args

from ckptxform.standins import HeadlineStandins


@pytest.fixture
def silent_address() -> Iterator[str]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    queued = []
    for _ in range(3):  # fill the accept queue
        client = socket.socket()
        client.setblocking(False)
        try:
            client.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        queued.append(client)
    time.sleep(0.2)
    with pytest.raises(TimeoutError):  # the premise: a connection attempt waits
        socket.create_connection(("127.0.0.1", port), timeout=0.5)
    yield f"127.0.0.1:{port}"
    for s in (*queued, server):
        s.close()


@pytest.fixture
def closed_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens once it is closed


def _tree(dirs: list[Path]) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for d in dirs for p in sorted(d.rglob("*")) if p.is_file()}


def _apply(headline_rule: Path, headline: HeadlineStandins, out: Path, address: str,
           timeout: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CKPTXFORM_DEBUG", "RAY_ADDRESS")}
    env.update(NO_COLOR="1", RAY_ADDRESS=address, CKPTXFORM_RAY_CONNECT_TIMEOUT=timeout)
    return subprocess.Popen([sys.executable, "-m", "ckptxform", "apply", str(headline_rule),
                             *source_args(headline.sources), "--out", str(out), "--executor", "ray"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _finished(proc: subprocess.Popen[str], seconds: float) -> subprocess.CompletedProcess[str]:
    stdout, stderr = proc.communicate(timeout=seconds)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def test_an_address_that_answers_nothing_is_refused_within_the_bound(
        headline_rule: Path, headline: HeadlineStandins, silent_address: str, tmp_path: Path) -> None:
    before = _tree([Path(p) for p in headline.sources.values()])
    started = time.monotonic()
    done = _finished(_apply(headline_rule, headline, tmp_path / "out", silent_address, "2"), 60)
    assert time.monotonic() - started < 30
    assert_clean_failure(done, 1)
    assert error_lines(done.stderr) == [(
        f"error: cannot connect to the Ray cluster at {silent_address!r}: no answer within 2 s; check --ray-address "
        "(or RAY_ADDRESS), or leave both unset to start a local Ray instance")]
    assert list(tmp_path.iterdir()) == []  # no output, no temporary sibling, no lock, no job directory
    assert _tree([Path(p) for p in headline.sources.values()]) == before


def test_a_refused_address_is_one_line_at_once(headline_rule: Path, headline: HeadlineStandins,
                                               closed_address: str, tmp_path: Path) -> None:
    done = _finished(_apply(headline_rule, headline, tmp_path / "out", closed_address, "30"), 60)
    assert_clean_failure(done, 1)
    assert error_lines(done.stderr) == [(
        f"error: cannot connect to the Ray cluster at {closed_address!r}: Connection refused within 30 s; check "
        "--ray-address (or RAY_ADDRESS), or leave both unset to start a local Ray instance")]
    assert list(tmp_path.iterdir()) == []


def test_sigterm_while_connecting_stops_the_run_and_cleans_up(
        headline_rule: Path, headline: HeadlineStandins, silent_address: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _apply(headline_rule, headline, out, silent_address, "600")
    deadline = time.monotonic() + 60
    while proc.poll() is None and not list(tmp_path.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.01)  # until the run has taken OUT (lock, job directory)
    time.sleep(1.0)  # now waiting on the connect
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGTERM)
    stopped = time.monotonic()
    done = _finished(proc, 30)
    assert time.monotonic() - stopped < 10
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1] == "terminated (SIGTERM)"
    assert list(tmp_path.iterdir()) == []


def test_a_port_of_non_ascii_digits_is_no_endpoint() -> None:
    """'²' is a digit to str.isdigit but int() refuses it: such an address is left to Ray's
    own message, not an internal error."""
    from ckptxform.engine.run.ray import _endpoint

    assert _endpoint("localhost:²") is None
    assert _endpoint("localhost:6379") == ("localhost", 6379)
