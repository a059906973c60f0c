"""Helpers for tests that point the real huggingface_hub client at ``hubserver.HubServer``.

huggingface_hub reads ``HF_ENDPOINT``, ``HF_HOME``, ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE``
when it is imported, so client code runs in a subprocess with its own environment
(``run_client``). Every proxy variable points at a ``ProxyTrap``: a request meant for any
host other than the test server (telemetry, a Xet/CAS host, huggingface.co) lands there
and is recorded, so a test can assert that nothing left 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import socketserver
import subprocess
import sys
import textwrap
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from hubserver import HubServer, LoggedRequest

#: Prepended to every client script: JSON-line reporting and fast retries.
CLIENT_PRELUDE = """
import json, os, sys
from loguru import logger
from ckptxform.errors import CkptxformError
from ckptxform.sources.hub.checkpoint import Retry, open_hub

logger.enable("ckptxform")  # a library is silent unless asked: these clients check its warnings

FAST = Retry(tries=5, first_wait=0.01, max_wait=0.02)

def emit(**fields):
    print(json.dumps(fields), flush=True)

def attempt(case, fn):
    try:
        fn()
    except CkptxformError as err:
        emit(case=case, error=type(err).__name__, message=str(err), exit_code=err.exit_code, source=err.source)
    else:
        emit(case=case, error=None)
"""


_PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")


class _TrapHandler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        line = self.rfile.readline(4096).decode("latin-1").strip()
        if line:
            self.server.lines.append(line)  # type: ignore[attr-defined]
        self.wfile.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")


class ProxyTrap(socketserver.ThreadingTCPServer):
    """Records the request line of every connection made through the proxy variables."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _TrapHandler)
        self.lines: list[str] = []
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()


@dataclass
class ClientRun:
    returncode: int
    stdout: str
    stderr: str
    records: list[dict[str, Any]] = field(default_factory=list)

    def record(self, case: str) -> dict[str, Any]:
        return next(r for r in self.records if r.get("case") == case)


#: The link the client assumes (instead of timing its requests), so that which spans are
#: joined and what ``fetch: auto`` picks do not depend on the machine's speed. A slow
#: one (100 KB/s): a request costs what 200 bytes cost, so only gaps up to 200 bytes are
#: bridged and byte counts stay those of the rows asked; ranges beat any download.
TEST_LINK = "rtt=0.05,bandwidth=1e5"


def client_env(hub: HubServer, home: Path, trap: ProxyTrap, **extra: str) -> dict[str, str]:
    """The environment of a client process: the user's HF_* and proxy settings removed,
    the test server as endpoint, ``home`` as HF_HOME, every other host trapped, and
    ``TEST_LINK`` as the link (pass ``CKPTXFORM_HUB_LINK=""`` to have it measured)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HF_", "HUGGING")) and k.lower() not in _PROXY_VARIABLES
    }
    env.update(
        HF_ENDPOINT=hub.endpoint,
        HF_HOME=str(home),
        HF_HUB_DISABLE_TELEMETRY="1",
        HTTP_PROXY=trap.url,
        HTTPS_PROXY=trap.url,
        ALL_PROXY=trap.url,
        NO_PROXY="127.0.0.1",
        CKPTXFORM_HUB_LINK=TEST_LINK,
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    env.update(extra)
    return env


def run_client(code: str, env: dict[str, str], *, timeout: float = 120) -> ClientRun:
    """Run ``CLIENT_PRELUDE + code`` in a fresh interpreter; JSON lines on stdout are records."""
    proc = subprocess.run(
        [sys.executable, "-c", CLIENT_PRELUDE + textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    records = []
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            records.append(json.loads(line))
    return ClientRun(proc.returncode, proc.stdout, proc.stderr, records)


# -- checkpoints on disk ------------------------------------------------------------------
def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path


def header_size(path: Path) -> int:
    """8 + the JSON header's length: the bytes a header read must transfer."""
    with path.open("rb") as fh:
        return 8 + int.from_bytes(fh.read(8), "little")


def tensor_span(path: Path, key: str) -> tuple[int, int]:
    """Absolute ``(offset, nbytes)`` of ``key`` in a safetensors file, read independently
    of ckptxform."""
    with path.open("rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        begin, end = json.loads(fh.read(n))[key]["data_offsets"]
    return 8 + n + begin, end - begin


def file_bytes(path: Path, start: int, length: int) -> bytes:
    with path.open("rb") as fh:
        fh.seek(start)
        return fh.read(length)


# -- reading the server log --------------------------------------------------------------
def file_requests(log: list[LoggedRequest]) -> list[LoggedRequest]:
    """Requests for file contents (``/resolve/`` on the Hub or its stand-in on the CDN)."""
    return [r for r in log if "/resolve/" in r.path]


def body_bytes(log: list[LoggedRequest], suffix: str = "") -> int:
    """Body bytes sent for file contents whose path ends with ``suffix``."""
    return sum(r.sent for r in file_requests(log) if r.path.endswith(suffix))
