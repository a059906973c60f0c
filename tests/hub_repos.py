"""What the test Hub (``hubserver.HubServer``) stores, and how its API describes it.

A repo is named commits of files on disk plus branch and tag refs; each file carries the
hashes the Hub reports (the LFS sha256 and the git blob oid). The functions below build
the JSON bodies of ``/api/models/{repo}[/revision/{rev}]``, ``.../tree/{rev}[/{path}]``
and ``.../paths-info/{rev}`` as the Hub shapes them for ``huggingface_hub``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_COMMIT_RE = re.compile(r"[0-9a-f]{40}")
_LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


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

    def commit(self, files: dict[str, HubFile], *, branch: str, tags: Iterable[str]) -> str:
        """Add ``files`` as a new commit on ``branch`` (and ``tags``); its sha."""
        digest = hashlib.sha1(self.repo_id.encode())
        for f in files.values():
            digest.update(f"{f.name}\0{f.sha256}\0".encode())
        digest.update(str(len(self.commits)).encode())  # a re-publish is a new commit
        commit = digest.hexdigest()
        self.commits[commit] = files
        self.refs[branch] = commit
        for tag in tags:
            self.refs[tag] = commit
        return commit

    def resolve(self, rev: str) -> str | None:
        """The commit a branch, tag or commit sha names; None when there is none."""
        if rev in self.refs:
            return self.refs[rev]
        if _COMMIT_RE.fullmatch(rev) and rev in self.commits:
            return rev
        return None


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


def folders(files: dict[str, HubFile]) -> set[str]:
    """Every folder that holds a file of ``files``, at any depth."""
    return {"/".join(name.split("/")[:i]) for name in files for i in range(1, name.count("/") + 1)}


def file_entry(f: HubFile) -> dict[str, Any]:
    """``f`` as the tree and paths-info endpoints list it."""
    entry: dict[str, Any] = {"type": "file", "oid": f.git_oid, "size": f.size, "path": f.name}
    if f.lfs:
        entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
    return entry


def folder_entry(path: str) -> dict[str, Any]:
    return {"type": "directory", "oid": hashlib.sha1(path.encode()).hexdigest(), "path": path}


def model_info(repo: HubRepo, commit: str, *, with_blobs: bool) -> dict[str, Any]:
    """The body of ``/api/models/{repo}[/revision/{rev}]`` for ``commit``."""
    siblings = []
    for f in repo.commits[commit].values():
        sibling: dict[str, Any] = {"rfilename": f.name}
        if with_blobs:
            sibling.update(size=f.size, blobId=f.git_oid)
            if f.lfs:
                sibling["lfs"] = {"size": f.size, "sha256": f.sha256, "pointerSize": 134}
        siblings.append(sibling)
    return {
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


def tree(files: dict[str, HubFile], path: str, *, recursive: bool) -> list[dict[str, Any]] | None:
    """The entries of folder ``path`` ("" the top), folders first; None when ``path`` is
    not a folder."""
    known = folders(files)
    if path and path not in known:
        return None
    prefix = f"{path}/" if path else ""

    def wanted(name: str) -> bool:
        return name.startswith(prefix) and (recursive or "/" not in name[len(prefix) :])

    entries = [folder_entry(d) for d in sorted(known) if wanted(d)]
    return entries + [file_entry(f) for name, f in files.items() if wanted(name)]


def paths_info(files: dict[str, HubFile], paths: Iterable[str]) -> list[dict[str, Any]]:
    """The entries of those of ``paths`` that exist (files or folders), in their order."""
    known = folders(files)
    out: list[dict[str, Any]] = []
    for p in paths:
        if p in files:
            out.append(file_entry(files[p]))
        elif p in known:
            out.append(folder_entry(p))
    return out
