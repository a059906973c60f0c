"""How the test Hub (``hubserver.HubServer``) answers a request, on the Hub host and on its
CDN: routing, the Hub's error replies (``X-Error-Code`` + ``X-Error-Message``), gated
files, the 302 of an LFS file to a signed CDN URL, single byte ranges, and the fault of
the request (``hub_faults``) acted out; every request is logged as a ``LoggedRequest``.
"""

from __future__ import annotations

import gzip
import hashlib
import hmac
import json
import re
import socket
import struct
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

from hub_faults import STALL_HOLD, Fault
from hub_repos import HubFile, HubRepo, model_info, paths_info, tree

if TYPE_CHECKING:
    from hubserver import HubServer

_CHUNK = 1 << 16
_RANGE_RE = re.compile(r"bytes=(\d*)-(\d*)")


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


def make_handler(hub: HubServer, host: str) -> type[BaseHTTPRequestHandler]:
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
            fault = self.server_state.take_fault(self.host_name, method, unquote(self._raw_path))
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
            self.server_state.record(
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

    def _early_fault(self, fault: Fault) -> None:
        """Faults that replace the answer whatever was asked."""
        if fault.kind == "status":
            raise _Reply(fault.status, None, "Injected server error")
        if fault.kind == "retry_after":
            raise _Reply(429, None, "Too many requests", headers={"Retry-After": str(fault.retry_after)})
        if fault.kind == "trickle" and self.command == "HEAD":  # the answer's head itself, byte by byte
            self.close_connection = True  # the connection's writes stay slowed
            self.wfile = _Trickling(self.wfile, fault.delay)  # type: ignore[assignment]
        if fault.kind == "stall" and self.command == "HEAD":  # half the answer's head, then silence
            self._status = 200
            self.close_connection = True
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-")
            self.wfile.flush()
            fault.released.wait(STALL_HOLD)
            raise _Done
        if fault.kind == "echo_auth":
            raise _Reply(400, None, f"Invalid credentials in header 'Authorization: {self.headers.get('Authorization')}'")
        if fault.kind == "loop":
            self._status = 302
            self.send_response(302)
            self.send_header("Location", self.path)  # itself, query included
            self.send_header("Content-Length", "0")
            self.end_headers()
            raise _Done

    def _route(self, method: str, body: bytes, fault: Fault | None) -> None:
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
        commit = repo.resolve(rev)
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

    # -- endpoints -------------------------------------------------------------------
    def _model_info(self, repo: HubRepo, rev: str) -> None:
        commit = self._commit(repo, rev)
        self._send_json(model_info(repo, commit, with_blobs="blobs" in parse_qs(self._query)))

    def _tree(self, repo: HubRepo, rev: str, path: str) -> None:
        commit = self._commit(repo, rev)
        recursive = parse_qs(self._query).get("recursive", ["False"])[0].lower() == "true"
        entries = tree(repo.commits[commit], path, recursive=recursive)
        if entries is None:
            raise _Reply(404, "EntryNotFound", f"{path} does not exist on \"{rev}\"", commit)
        self._send_json(entries)

    def _paths_info(self, repo: HubRepo, rev: str, body: bytes) -> None:
        commit = self._commit(repo, rev)
        if self.headers.get("Content-Type", "").startswith("application/json"):
            paths = json.loads(body or b"{}").get("paths", [])
        else:  # the client posts a form: paths=a&paths=b&expand=False
            paths = parse_qs(body.decode()).get("paths", [])
        self._send_json(paths_info(repo.commits[commit], paths))

    def _resolve_file(self, method: str, repo: HubRepo, rev: str, name: str, fault: Fault | None) -> None:
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
        self.send_header("Location", self.server_state.cdn_url(f"/{repo.repo_id}/resolve/{commit}/{quote(name)}"))
        self.send_header("X-Repo-Commit", commit)
        self.send_header("X-Linked-Etag", f'"{f.sha256}"')
        self.send_header("X-Linked-Size", str(f.size))
        self.send_header("ETag", f'"{f.git_oid}"')
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _cdn_file(self, method: str, fault: Fault | None) -> None:
        """A signed URL of the CDN: the file's bytes, or 403 once it expired."""
        query = parse_qs(self._query)
        expires, signature = query.get("Expires", [""])[0], query.get("Signature", [""])[0]
        if not hmac.compare_digest(signature, self.server_state.signature(self._raw_path, expires)):
            raise _Reply(403, None, "SignatureDoesNotMatch")
        if int(expires) < time.time():
            raise _Reply(403, None, "Request has expired")
        segs = unquote(self._raw_path).strip("/").split("/")
        i = segs.index("resolve", 1)
        repo = self.server_state.repos["/".join(segs[:i])]
        commit, name = segs[i + 1], "/".join(segs[i + 2 :])
        self._serve(method, repo.commits[commit][name], commit, fault)

    def _serve(self, method: str, f: HubFile, commit: str, fault: Fault | None) -> None:
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
        if kind in ("gzip", "short", "trickle", "stall") and method == "GET":
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
        if kind == "stall" and body is not None and fault is not None:
            self._write(body[: fault.after_bytes])
            self.wfile.flush()
            self.close_connection = True
            fault.released.wait(STALL_HOLD)
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


class _Trickling:
    """A connection's writes, one byte every ``delay`` seconds."""

    def __init__(self, inner: Any, delay: float) -> None:
        self._inner = inner
        self._delay = delay

    def write(self, data: bytes) -> int:
        for i in range(len(data)):
            self._inner.write(data[i : i + 1])
            self._inner.flush()
            time.sleep(self._delay)
        return len(data)

    def flush(self) -> None:
        self._inner.flush()
