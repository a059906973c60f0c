"""A Hub-compatible HTTP server on 127.0.0.1 for tests, serving real files from disk.

It speaks what ``huggingface_hub`` 2.4 asks of the Hub when ``HF_ENDPOINT`` points at it:

- ``HEAD``/``GET /{repo}/resolve/{rev}/{file}``: for an LFS file (weights: ``.safetensors``,
  ``.bin``, ``.pt``, ``.pth``) a 302 to a second host on 127.0.0.1, the CDN, with a signed
  URL that expires after ``cdn_ttl`` seconds (then 403, as S3 answers), and the file's
  ``X-Linked-Etag`` (quoted sha256) and ``X-Linked-Size``, as the Hub answers. The CDN, and
  the Hub itself for small files, answer with ``ETag``, ``Content-Length`` and
  ``Accept-Ranges``; a single ``Range: bytes=a-b`` gives 206 with ``Content-Range``. The
  CDN's ``ETag`` is not the sha256 (S3's is an MD5), so a client cannot confuse the two.
  No ``X-Xet-Hash`` header is ever sent, so the client always takes the plain HTTP
  download path and never contacts a Xet/CAS host.
- ``GET /api/models/{repo}[/revision/{rev}]``: ``sha``, ``siblings``, ``gated``...
- ``GET /api/models/{repo}/tree/{rev}[/{path}]`` and ``POST .../paths-info/{rev}``.
- Errors as the Hub sends them (``X-Error-Code`` + ``X-Error-Message`` + JSON body):
  ``RepoNotFound`` 404, ``RevisionNotFound`` 404, ``EntryNotFound`` 404 (with
  ``X-Repo-Commit``, which the client uses to cache the miss), ``GatedRepo`` 401 without
  a token and 403 with a wrong one. Only file contents are gated: like the Hub, the repo
  info and the file listing of a gated repo are public.

Every request is recorded in ``server.log`` (host, method, path, Range, status, body
bytes actually written), so tests can assert on transferred bytes exactly; a CDN request's
path is the resolve path it stands for. The token is never recorded, only whether one
was sent. ``latency`` delays every answer (a round trip), ``bandwidth`` caps the bytes per
second of all bodies together (one link). ``fail``, ``reset`` and ``misbehave`` inject
faults: 5xx and 429 answers, connections reset mid-body, and the misbehaviours a client
must refuse (bytes that change between requests, a wrong ``Content-Range``, a short
body, a 200 with the whole file, a gzip-encoded range, a redirect loop, a trickle).

The request handler is ``hub_handler``, the faults and the link ``hub_faults``, the
repos and their API bodies ``hub_repos``.

Use::

    with HubServer() as hub:
        commit = hub.add_repo("org/model", folder)
        env["HF_ENDPOINT"] = hub.endpoint

or by hand: ``python tests/hubserver.py ROOT --port 8000 --latency 0.05 --bandwidth 25e6``
serves every ``ROOT/ORG/NAME/`` folder as repo ``ORG/NAME`` on branch ``main``.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import sys
import threading
import time
from collections.abc import Iterable
from http.server import ThreadingHTTPServer
from pathlib import Path

from hub_faults import FaultInjection, Link
from hub_handler import LoggedRequest, make_handler
from hub_repos import HubFile, HubRepo, hub_file

__all__ = ["HubFile", "HubServer", "LoggedRequest", "hub_file"]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # many connections opened at once must not be refused


class HubServer(FaultInjection):
    """A threaded Hub-compatible server on an ephemeral port, with its CDN on another;
    a context manager. ``latency`` seconds pass before every answer; ``bandwidth`` (bytes
    per second) caps all bodies together; ``cdn=False`` serves LFS files from the Hub host
    itself (no redirect). Faults: ``fail``, ``reset``, ``misbehave`` (``hub_faults``)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        latency: float = 0.0,
        bandwidth: float | None = None,
        cdn: bool = True,
        cdn_ttl: float = 3600.0,
    ) -> None:
        super().__init__()
        self.repos: dict[str, HubRepo] = {}
        self.log: list[LoggedRequest] = []
        self.latency = latency
        self.link = Link(bandwidth)
        self.cdn_ttl = cdn_ttl
        self._secret = hashlib.sha256(str(id(self)).encode()).digest()
        self._lock = threading.Lock()
        self._httpd = _Server((host, port), make_handler(self, "hub"))
        self._cdn = _Server((host, 0), make_handler(self, "cdn")) if cdn else None
        self._threads: list[threading.Thread] = []

    # -- lifecycle -------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def cdn_endpoint(self) -> str | None:
        if self._cdn is None:
            return None
        host, port = self._cdn.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubServer:
        for httpd in (self._httpd, self._cdn):
            if httpd is not None:
                thread = threading.Thread(target=httpd.serve_forever, daemon=True)
                thread.start()
                self._threads.append(thread)
        return self

    def stop(self) -> None:
        for httpd in (self._httpd, self._cdn):
            if httpd is not None:
                httpd.shutdown()
                httpd.server_close()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- content ---------------------------------------------------------------------
    def add_repo(
        self,
        repo_id: str,
        folder: str | Path,
        *,
        branch: str = "main",
        tags: Iterable[str] = (),
        gated_token: str | None = None,
    ) -> str:
        """Publish every file under ``folder`` as a new commit of ``repo_id`` on ``branch``
        (and ``tags``); returns the commit sha. Calling it again for the same repo adds a
        commit (older commits stay reachable by sha)."""
        folder = Path(folder)
        files: dict[str, HubFile] = {}
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            name = path.relative_to(folder).as_posix()
            files[name] = hub_file(name, path)
        repo = self.repos.setdefault(repo_id, HubRepo(repo_id, default_branch=branch))
        commit = repo.commit(files, branch=branch, tags=tags)
        if gated_token is not None:
            repo.gated_token = gated_token
        return commit

    # -- log and the CDN's signed URLs (used by the handler) --------------------------
    def clear_log(self) -> None:
        with self._lock:
            self.log.clear()

    def record(self, entry: LoggedRequest) -> None:
        with self._lock:
            self.log.append(entry)

    def signature(self, path: str, expires: str) -> str:
        return hmac.new(self._secret, f"{path}\0{expires}".encode(), "sha256").hexdigest()[:32]

    def cdn_url(self, path: str) -> str:
        expires = str(int(time.time() + self.cdn_ttl))
        return f"{self.cdn_endpoint}{path}?Expires={expires}&Signature={self.signature(path, expires)}"


def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve ROOT/ORG/NAME/ folders as Hub repos (branch main).")
    parser.add_argument("root", type=Path)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--latency", type=float, default=0.0, help="seconds before every answer")
    parser.add_argument("--bandwidth", type=float, default=None, help="bytes per second, all answers together")
    args = parser.parse_args(argv)
    hub = HubServer(port=args.port, latency=args.latency, bandwidth=args.bandwidth)
    for folder in sorted(p for p in args.root.glob("*/*") if p.is_dir()):
        repo_id = folder.relative_to(args.root).as_posix()
        print(f"{repo_id}@main = {hub.add_repo(repo_id, folder)}", file=sys.stderr)
    print(f"HF_ENDPOINT={hub.endpoint} (CDN {hub.cdn_endpoint})", file=sys.stderr)
    hub.start()
    threading.Event().wait()


if __name__ == "__main__":
    _main()
