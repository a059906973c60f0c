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

Use::

    with HubServer() as hub:
        commit = hub.add_repo("org/model", folder)
        env["HF_ENDPOINT"] = hub.endpoint

or by hand: ``python tests/hubserver.py ROOT --port 8000 --latency 0.05 --bandwidth 25e6``
serves every ``ROOT/ORG/NAME/`` folder as repo ``ORG/NAME`` on branch ``main``.
"""

from __future__ import annotations

import argparse
import fnmatch
import gzip
import hashlib
import hmac
import json
import re
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

_CHUNK = 1 << 16
_COMMIT_RE = re.compile(r"[0-9a-f]{40}")
_RANGE_RE = re.compile(r"bytes=(\d*)-(\d*)")
_LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
#: what ``misbehave`` can do; see its docstring
MISBEHAVIOURS = ("swap", "bad_range", "short", "whole", "gzip", "loop", "retry_after", "echo_auth", "trickle")


@dataclass(frozen=True)
class HubFile:
    """One file of a commit: where its bytes live and the hashes the Hub reports."""

    name: str
    path: Path
    size: int
    sha256: str
    git_oid: str

    @property
    def lfs(self) -> bool:
        """Stored in LFS (so served through the CDN), as the Hub stores weights."""
        return self.name.endswith(_LFS_SUFFIXES)


@dataclass
class HubRepo:
    repo_id: str
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit
    commits: dict[str, dict[str, HubFile]] = field(default_factory=dict)
    default_branch: str = "main"
    gated_token: str | None = None


@dataclass(frozen=True)
class LoggedRequest:
    """One request as the server saw it. ``sent`` counts body bytes actually written;
    ``host`` is ``hub`` or ``cdn``."""

    method: str
    path: str  # as requested, still URL-encoded, without the query string
    query: str
    range: str | None
    status: int
    sent: int
    authorized: bool
    fault: str | None = None
    host: str = "hub"


@dataclass
class _Fault:
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


class _Link:
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


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # many connections opened at once must not be refused


def _hash_file(path: Path) -> tuple[int, str, str]:
    size = path.stat().st_size
    sha256 = hashlib.sha256()
    git = hashlib.sha1(f"blob {size}\0".encode())
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            sha256.update(chunk)
            git.update(chunk)
    return size, sha256.hexdigest(), git.hexdigest()


def hub_file(name: str, path: Path) -> HubFile:
    """A file as the server would publish it (for ``misbehave("swap", other=...)``)."""
    size, sha256, git_oid = _hash_file(path)
    return HubFile(name, path, size, sha256, git_oid)


class HubServer:
    """A threaded Hub-compatible server on an ephemeral port, with its CDN on another;
    a context manager. ``latency`` seconds pass before every answer; ``bandwidth`` (bytes
    per second) caps all bodies together; ``cdn=False`` serves LFS files from the Hub host
    itself (no redirect)."""

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
        self.repos: dict[str, HubRepo] = {}
        self.log: list[LoggedRequest] = []
        self.latency = latency
        self.link = _Link(bandwidth)
        self.cdn_ttl = cdn_ttl
        self._secret = hashlib.sha256(str(id(self)).encode()).digest()
        self._faults: list[_Fault] = []
        self._lock = threading.Lock()
        self._httpd = _Server((host, port), _make_handler(self, "hub"))
        self._cdn = _Server((host, 0), _make_handler(self, "cdn")) if cdn else None
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
        digest = hashlib.sha1(repo_id.encode())
        for f in files.values():
            digest.update(f"{f.name}\0{f.sha256}\0".encode())
        repo = self.repos.setdefault(repo_id, HubRepo(repo_id, default_branch=branch))
        digest.update(str(len(repo.commits)).encode())  # a re-publish is a new commit
        commit = digest.hexdigest()
        repo.commits[commit] = files
        repo.refs[branch] = commit
        for tag in tags:
            repo.refs[tag] = commit
        if gated_token is not None:
            repo.gated_token = gated_token
        return commit

    # -- faults and log --------------------------------------------------------------
    def fail(self, pattern: str, *, status: int = 500, times: int = 1, method: str | None = None) -> None:
        """The next ``times`` requests whose decoded path matches ``pattern`` (fnmatch)
        get ``status`` with a JSON error body."""
        with self._lock:
            self._faults.append(_Fault(pattern, method, "status", times, status=status))

    def reset(self, pattern: str, *, after_bytes: int = 0, times: int = 1, method: str | None = "GET") -> None:
        """The next ``times`` matching requests get their headers and ``after_bytes``
        bytes of body, then a TCP reset."""
        with self._lock:
            self._faults.append(_Fault(pattern, method, "reset", times, after_bytes=after_bytes))

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
        request's Authorization header; ``trickle`` one body byte every ``delay`` s."""
        assert kind in MISBEHAVIOURS, kind
        with self._lock:
            self._faults.append(_Fault(pattern, method, kind, times, host=host, skip=skip, retry_after=retry_after,
                                       other=other, after_bytes=after_bytes, delay=delay))

    def clear_log(self) -> None:
        with self._lock:
            self.log.clear()

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def _take_fault(self, host: str, method: str, path: str) -> _Fault | None:
        with self._lock:
            for fault in self._faults:
                if (fault.remaining > 0 and fault.method in (None, method) and fault.host in (None, host)
                        and fnmatch.fnmatch(path, fault.pattern)):
                    if fault.skip > 0:
                        fault.skip -= 1
                        continue
                    fault.remaining -= 1
                    return fault
        return None

    def _record(self, entry: LoggedRequest) -> None:
        with self._lock:
            self.log.append(entry)

    # -- lookups used by the handler -------------------------------------------------
    def _resolve(self, repo: HubRepo, rev: str) -> str | None:
        if rev in repo.refs:
            return repo.refs[rev]
        if _COMMIT_RE.fullmatch(rev) and rev in repo.commits:
            return rev
        return None

    def _signature(self, path: str, expires: str) -> str:
        return hmac.new(self._secret, f"{path}\0{expires}".encode(), "sha256").hexdigest()[:32]

    def _cdn_url(self, path: str) -> str:
        expires = str(int(time.time() + self.cdn_ttl))
        return f"{self.cdn_endpoint}{path}?Expires={expires}&Signature={self._signature(path, expires)}"


class _Done(Exception):
    """The answer has been sent (by a fault)."""


class _Reply(Exception):
    """An error answer, raised from deep inside a handler."""

    def __init__(self, status: int, code: str | None, message: str, commit: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.commit = commit
        self.headers = headers or {}


def _make_handler(hub: HubServer, host: str) -> type[BaseHTTPRequestHandler]:
    class Handler(_HubHandler):
        server_state = hub
        host_name = host

    return Handler


class _HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the client's connection pool expects
    server_version = "HubServer/1.0"
    timeout = 30
    disable_nagle_algorithm = True  # else every small ranged reply waits ~40 ms for an ACK
    server_state: HubServer
    host_name: str

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence stderr
        pass

    # -- dispatch --------------------------------------------------------------------
    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        split = urlsplit(self.path)
        self._raw_path, self._query = split.path, split.query
        self._sent = 0
        self._status = 0
        self._fault_name: str | None = None
        body = b""
        if "Content-Length" in self.headers:
            body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.server_state.latency:
            time.sleep(self.server_state.latency)
        try:
            fault = self.server_state._take_fault(self.host_name, method, unquote(self._raw_path))
            if fault is not None:
                self._fault_name = fault.kind if fault.kind != "status" else f"status {fault.status}"
                self._early_fault(fault)
            if self.host_name == "cdn":
                self._cdn_file(method, fault)
            else:
                self._route(method, body, fault)
        except _Reply as reply:
            self._send_error(method, reply)
        except (_Done, ConnectionError):
            pass
        finally:
            self.server_state._record(
                LoggedRequest(
                    method=method,
                    path=self._raw_path,
                    query=self._query,
                    range=self.headers.get("Range"),
                    status=self._status,
                    sent=self._sent,
                    authorized=self.headers.get("Authorization") is not None,
                    fault=self._fault_name,
                    host=self.host_name,
                )
            )

    def _early_fault(self, fault: _Fault) -> None:
        """Faults that replace the answer whatever was asked."""
        if fault.kind == "status":
            raise _Reply(fault.status, None, "Injected server error")
        if fault.kind == "retry_after":
            raise _Reply(429, None, "Too many requests", headers={"Retry-After": str(fault.retry_after)})
        if fault.kind == "echo_auth":
            raise _Reply(400, None, f"Invalid credentials in header 'Authorization: {self.headers.get('Authorization')}'")
        if fault.kind == "loop":
            self._status = 302
            self.send_response(302)
            self.send_header("Location", self.path)  # itself, query included
            self.send_header("Content-Length", "0")
            self.end_headers()
            raise _Done

    def _route(self, method: str, body: bytes, fault: _Fault | None) -> None:
        segs = self._raw_path.strip("/").split("/")
        if segs[:2] == ["api", "models"] and len(segs) >= 4:
            rest = segs[2:]
            for i, seg in enumerate(rest[1:], start=1):
                if seg in ("revision", "tree", "paths-info"):
                    repo_id, verb, args = "/".join(rest[:i]), seg, rest[i + 1 :]
                    break
            else:
                repo_id, verb, args = "/".join(rest), "info", []
            repo = self._repo(repo_id)
            if verb == "info" and method == "GET":
                return self._model_info(repo, repo.default_branch)
            if verb == "revision" and method == "GET" and len(args) == 1:
                return self._model_info(repo, unquote(args[0]))
            if verb == "tree" and method == "GET" and args:
                return self._tree(repo, unquote(args[0]), unquote("/".join(args[1:])))
            if verb == "paths-info" and method == "POST" and len(args) == 1:
                return self._paths_info(repo, unquote(args[0]), body)
        elif "resolve" in segs[1:] and method in ("GET", "HEAD"):
            i = segs.index("resolve", 1)
            if len(segs) > i + 2:
                repo = self._repo("/".join(segs[:i]))
                return self._resolve_file(method, repo, unquote(segs[i + 1]), unquote("/".join(segs[i + 2 :])), fault)
        raise _Reply(404, None, "Not Found")

    # -- helpers ---------------------------------------------------------------------
    def _repo(self, repo_id: str) -> HubRepo:
        repo = self.server_state.repos.get(unquote(repo_id))
        if repo is None:
            raise _Reply(404, "RepoNotFound", "Repository not found")
        return repo

    def _commit(self, repo: HubRepo, rev: str) -> str:
        commit = self.server_state._resolve(repo, rev)
        if commit is None:
            raise _Reply(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return commit

    def _check_gate(self, repo: HubRepo) -> None:
        if repo.gated_token is None:
            return
        auth = self.headers.get("Authorization")
        if auth == f"Bearer {repo.gated_token}":
            return
        if auth is None:
            raise _Reply(
                401,
                "GatedRepo",
                f"Access to model {repo.repo_id} is restricted. You must have access to it and be"
                " authenticated to access it. Please log in.",
            )
        raise _Reply(
            403,
            "GatedRepo",
            f"Access to model {repo.repo_id} is restricted and you are not in the authorized list."
            f" Visit {self._endpoint()}/{repo.repo_id} to ask for access.",
        )

    def _endpoint(self) -> str:
        return self.server_state.endpoint

    def _write(self, data: bytes) -> None:
        """Body bytes, through the shared link."""
        for i in range(0, len(data), _CHUNK):
            chunk = data[i : i + _CHUNK]
            self.server_state.link.send(len(chunk))
            self.wfile.write(chunk)
            self._sent += len(chunk)

    def _send_json(self, payload: Any, status: int = 200, extra: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        self._status = status
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self._write(data)

    def _send_error(self, method: str, reply: _Reply) -> None:
        headers = {"X-Error-Message": reply.message, **reply.headers}
        if reply.code:
            headers["X-Error-Code"] = reply.code
        if reply.commit:
            headers["X-Repo-Commit"] = reply.commit
        data = json.dumps({"error": reply.message}).encode()
        self._status = reply.status
        self.send_response(reply.status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if method != "HEAD":
            self._write(data)

    @staticmethod
    def _entry(f: HubFile) -> dict[str, Any]:
        entry: dict[str, Any] = {"type": "file", "oid": f.git_oid, "size": f.size, "path": f.name}
        if f.lfs:
            entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
        return entry

    @staticmethod
    def _folders(files: dict[str, HubFile]) -> set[str]:
        return {"/".join(name.split("/")[:i]) for name in files for i in range(1, name.count("/") + 1)}

    # -- endpoints -------------------------------------------------------------------
    def _model_info(self, repo: HubRepo, rev: str) -> None:
        commit = self._commit(repo, rev)
        files = repo.commits[commit]
        with_blobs = "blobs" in parse_qs(self._query)
        siblings = []
        for f in files.values():
            sibling: dict[str, Any] = {"rfilename": f.name}
            if with_blobs:
                sibling.update(size=f.size, blobId=f.git_oid)
                if "lfs" in self._entry(f):
                    sibling["lfs"] = {"size": f.size, "sha256": f.sha256, "pointerSize": 134}
            siblings.append(sibling)
        self._send_json(
            {
                "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24],
                "id": repo.repo_id,
                "modelId": repo.repo_id,
                "author": repo.repo_id.split("/")[0],
                "sha": commit,
                "private": False,
                "gated": "manual" if repo.gated_token else False,
                "disabled": False,
                "tags": [],
                "siblings": siblings,
            }
        )

    def _tree(self, repo: HubRepo, rev: str, path: str) -> None:
        commit = self._commit(repo, rev)
        files = repo.commits[commit]
        folders = self._folders(files)
        prefix = f"{path}/" if path else ""
        if path and path not in folders:
            raise _Reply(404, "EntryNotFound", f"{path} does not exist on \"{rev}\"", commit)
        recursive = parse_qs(self._query).get("recursive", ["False"])[0].lower() == "true"

        def wanted(name: str) -> bool:
            return name.startswith(prefix) and (recursive or "/" not in name[len(prefix) :])

        entries: list[dict[str, Any]] = [
            {"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "path": d}
            for d in sorted(folders)
            if wanted(d)
        ]
        entries += [self._entry(f) for name, f in files.items() if wanted(name)]
        self._send_json(entries)

    def _paths_info(self, repo: HubRepo, rev: str, body: bytes) -> None:
        commit = self._commit(repo, rev)
        files = repo.commits[commit]
        if self.headers.get("Content-Type", "").startswith("application/json"):
            paths = json.loads(body or b"{}").get("paths", [])
        else:  # the client posts a form: paths=a&paths=b&expand=False
            paths = parse_qs(body.decode()).get("paths", [])
        folders = self._folders(files)
        out: list[dict[str, Any]] = []
        for p in paths:
            if p in files:
                out.append(self._entry(files[p]))
            elif p in folders:
                out.append({"type": "directory", "oid": hashlib.sha1(p.encode()).hexdigest(), "path": p})
        self._send_json(out)

    def _resolve_file(self, method: str, repo: HubRepo, rev: str, name: str, fault: _Fault | None) -> None:
        commit = self._commit(repo, rev)
        self._check_gate(repo)
        f = repo.commits[commit].get(name)
        if f is None:
            raise _Reply(404, "EntryNotFound", "Entry not found", commit)
        if not f.lfs or self.server_state.cdn_endpoint is None:
            return self._serve(method, f, commit, fault)
        # As the Hub: the file's metadata here, its bytes on the CDN behind a signed URL.
        self._status = 302
        self.send_response(302)
        self.send_header("Location", self.server_state._cdn_url(f"/{repo.repo_id}/resolve/{commit}/{quote(name)}"))
        self.send_header("X-Repo-Commit", commit)
        self.send_header("X-Linked-Etag", f'"{f.sha256}"')
        self.send_header("X-Linked-Size", str(f.size))
        self.send_header("ETag", f'"{f.git_oid}"')
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _cdn_file(self, method: str, fault: _Fault | None) -> None:
        """A signed URL of the CDN: the file's bytes, or 403 once it expired."""
        query = parse_qs(self._query)
        expires, signature = query.get("Expires", [""])[0], query.get("Signature", [""])[0]
        if not hmac.compare_digest(signature, self.server_state._signature(self._raw_path, expires)):
            raise _Reply(403, None, "SignatureDoesNotMatch")
        if int(expires) < time.time():
            raise _Reply(403, None, "Request has expired")
        segs = unquote(self._raw_path).strip("/").split("/")
        i = segs.index("resolve", 1)
        repo = self.server_state.repos["/".join(segs[:i])]
        commit, name = segs[i + 1], "/".join(segs[i + 2 :])
        self._serve(method, repo.commits[commit][name], commit, fault)

    def _serve(self, method: str, f: HubFile, commit: str, fault: _Fault | None) -> None:
        """The bytes of ``f``, whole or the one range asked, with ``fault`` applied."""
        kind = fault.kind if fault is not None else None
        if kind == "swap":
            assert fault is not None and fault.other is not None
            f = fault.other
        start, end = 0, f.size - 1
        status = 200
        range_header = self.headers.get("Range")
        # A single range is honoured. Several ranges get the whole file (as S3 does), so a
        # client that sends them sees the cost in the log instead of a silent success.
        if range_header and "," not in range_header and kind != "whole":
            m = _RANGE_RE.fullmatch(range_header.strip())
            if m is None or (not m.group(1) and not m.group(2)):
                raise _Reply(416, None, f"Invalid range {range_header!r}")
            if m.group(1):
                start = int(m.group(1))
                end = min(int(m.group(2)), f.size - 1) if m.group(2) else f.size - 1
            else:
                start = max(f.size - int(m.group(2)), 0)
            if start >= f.size or start > end:
                self._status = 416
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{f.size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
        length = end - start + 1
        body = None  # streamed from the file unless a fault rewrites it
        if kind in ("gzip", "short", "trickle") and method == "GET":
            with f.path.open("rb") as fh:
                fh.seek(start)
                body = fh.read(length)
            body = gzip.compress(body) if kind == "gzip" else body
            body = body[: fault.after_bytes] if kind == "short" and fault is not None else body
        self._status = status
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(length if body is None else len(body)))
        self.send_header("Accept-Ranges", "bytes")
        if self.host_name == "cdn":  # S3's ETag is an MD5, not the LFS sha256
            self.send_header("ETag", f'"{hashlib.md5(f.sha256.encode()).hexdigest()}"')
        else:
            self.send_header("ETag", f'"{f.sha256}"')
            self.send_header("X-Repo-Commit", commit)
        if kind == "gzip":
            self.send_header("Content-Encoding", "gzip")
        if status == 206:
            shift = 1 if kind == "bad_range" else 0
            self.send_header("Content-Range", f"bytes {start + shift}-{end + shift}/{f.size}")
        self.end_headers()
        if method == "HEAD":
            return
        if kind == "trickle" and body is not None and fault is not None:
            for i in range(len(body)):
                self.wfile.write(body[i : i + 1])
                self.wfile.flush()
                self._sent += 1
                time.sleep(fault.delay)
            return
        if body is not None:
            self._write(body)
            return
        limit = fault.after_bytes if kind == "reset" and fault is not None else None
        with f.path.open("rb") as fh:
            fh.seek(start)
            left = length if limit is None else min(length, limit)
            while left > 0:
                chunk = fh.read(min(_CHUNK, left))
                if not chunk:
                    break
                self._write(chunk)
                left -= len(chunk)
        if limit is not None:
            self._fault_name = f"reset after {limit} bytes"
            self._reset_connection()

    def _reset_connection(self) -> None:
        # SO_LINGER with a zero timeout makes close() send a RST: the client sees a
        # connection reset mid-body, not a clean end of stream.
        self.wfile.flush()
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()


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
