"""Hub repos as checkpoints, pulling only the bytes a conversion needs from one commit.

Everything goes through the real ``huggingface_hub`` client, so the conventions users
already have hold: ``HF_TOKEN`` or the saved token, ``HF_HOME``, ``HF_HUB_CACHE``,
``HF_ENDPOINT``, ``HF_HUB_OFFLINE=1``. Its downloads draw no bar: their bytes count in the
run's one bar (``meter``).

- The revision is resolved to a commit once (``HfApi.resolve_revision``); every later
  request names that commit, so a run reads one immutable snapshot.
- ``config.json`` and ``model.safetensors.index.json`` go through the Hugging Face cache.
  Safetensors headers are read by HTTP range requests (8 bytes, then the JSON), and only
  for the shards whose tensors are asked for: ``tensors`` is a lazy mapping over the
  index, so a 60-shard verifier costs one header when one tensor is needed.
- Bytes of a file already in the cache are read from disk. Otherwise ``policy`` decides,
  per file: ``download`` fetches the file into the cache; ``ranges`` reads byte ranges;
  ``auto`` (default) picks whichever ``hub_fetch.choose`` estimates faster from the
  reads the executor announces through ``prefetch`` and the link's round-trip time and
  bandwidth measured so far (the plan's requests), and says so in the audit. A location
  ``ORG/NAME@REV?fetch=download`` sets the policy. Ranges go to the CDN URL the Hub
  redirects to (resolved once per file, ``hub_http``), many in flight, neighbouring rows
  joined when the gap costs less than a request (``hub_ranges``), each answer checked to
  be the bytes asked of the object first seen (by the run: ``expect_etags`` gives a
  worker process the ETags its run read first); what they fetch is kept in a range cache
  next to the repo's Hugging Face cache folder, so a rerun, or an offline run, transfers
  nothing. A safetensors header is read with one request where it fits in
  ``SPECULATIVE_HEADER`` bytes, and a repo's config, index and header are asked at once.
- Every failure is one ckptxform ``HubError`` line naming the source, repo and revision
  and saying what to do. No message, log line or attribute ever holds the token.

Example::

    with open_hub("org/verifier", "main", name="verifier") as ckpt:
        info = ckpt.tensors["language_model.lm_head.weight"]   # reads one shard header
        rows = ckpt.read_rows(info, [5, 6, 7, 900])             # one or two range requests
"""

from __future__ import annotations

import bisect
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ckptxform.errors import (
    CheckpointFormatError,
    CkptxformError,
    EntryNotFoundError,
    UsageError,
    register_secret,
)
from ckptxform.log import logger
from ckptxform.sources.base import TensorInfo, row_runs
from ckptxform.sources.file_listing import hub_files
from ckptxform.sources.hub.bounded import bound_hub_client, stall_seconds
from ckptxform.sources.hub.errors import HubWhere, Retry, call_hub
from ckptxform.sources.hub.fetch import (
    POLICIES,
    PROBE_BYTES,
    FetchChoice,
    Policy,
    choose,
    link_cost,
    measure_bandwidth,
    needs_probe,
    split_fetch_option,
)
from ckptxform.sources.hub.http import PARALLEL_REQUESTS, RangeIgnored, RemoteFile
from ckptxform.sources.hub.index import load_json
from ckptxform.sources.hub.meter import ByteCounter, expect
from ckptxform.sources.header_columns import ShardColumns
from ckptxform.sources.lazy_index import LazyShards, LazyTensors, weak_loader
from ckptxform.sources.hub.ranges import RangeCache, Span, plan_requests
from ckptxform.sources.safetensors_header import header_length, parse_header_columns
from ckptxform.sources.shard_index import open_shard_index

__all__ = ["HubCheckpoint", "Policy", "Retry", "open_hub", "parse_hub_location", "split_fetch_option"]

CONFIG = "config.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
#: The first read of a safetensors file: most headers fit (a 1,000-tensor shard's is
#: ~150 KB), and at 25 MB/s it costs 10 ms, less than the second round trip it saves.
SPECULATIVE_HEADER = 256 * 1024
_COMMIT = re.compile(r"[0-9a-f]{40}")
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
_T = TypeVar("_T")

if TYPE_CHECKING:
    from ..peft_adapter import PeftAdapter


def parse_hub_location(loc: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` for ``hf://ORG/NAME[@REV]`` and ``ORG/NAME[@REV]``, else
    None. It does not look at the disk: the caller checks for a local path of that name
    first (an existing local path wins over a Hub repo).

    >>> parse_hub_location("hf://org/model@v1.0")
    ('org/model', 'v1.0')
    >>> parse_hub_location("./checkpoints/drafter") is None
    True
    """
    explicit = loc.startswith("hf://")
    repo, sep, rev = loc.removeprefix("hf://").partition("@")
    if _REPO_ID.fullmatch(repo) and not (sep and (not rev or any(c.isspace() for c in rev) or "@" in rev)):
        return repo, rev or None
    if explicit:
        raise UsageError(f"{loc!r} is not a Hub location; write hf://ORG/NAME or hf://ORG/NAME@REVISION")
    return None


def open_hub(
    repo_id: str,
    revision: str | None = None,
    *,
    name: str | None = None,
    policy: str = "auto",
    location: str | None = None,
    require_pinned: bool = False,
    retry: Retry = Retry(),
    gguf_file: str | None = None,
) -> HubCheckpoint | PeftAdapter:
    """Resolve ``revision`` to a commit and index the repo's safetensors from the index
    and headers, transferring no weight byte (a PEFT adapter repo: its
    ``adapter_model.safetensors``, read as ``peft_adapter.PeftAdapter``). ``name`` is the source's name in the rule
    file (used in messages); ``require_pinned`` refuses a branch or tag. ``gguf_file``: the
    repo's GGUF model of that name (``hub/gguf.py``; a repo without safetensors and with one
    GGUF model needs none).

    >>> ckpt = open_hub("AQ-MedAI/Kimi-K25-eagle3", name="target_vocab")  # doctest: +SKIP
    >>> ckpt.commit                                                        # doctest: +SKIP
    '0b5c3e...'
    """
    if policy not in POLICIES:
        raise UsageError(
            f"source {name!r}: fetch policy {policy!r} is not one of {', '.join(POLICIES)}", source=name
        )
    bound_hub_client()  # huggingface_hub's own requests keep ckptxform's bounds too
    stall_seconds()  # a bad CKPTXFORM_HUB_STALL is a usage error now, not in a request
    ckpt = HubCheckpoint(
        repo_id, revision, name=name, policy=policy, location=location, retry=retry  # type: ignore[arg-type]
    )
    try:
        ckpt._open(require_pinned=require_pinned, gguf_file=gguf_file)
        if ckpt.files == (ADAPTER_WEIGHTS,):
            from ..peft_adapter import hub_adapter

            return hub_adapter(ckpt, name)
    except CkptxformError as err:
        err.source = err.source or name
        ckpt.close()
        raise
    return ckpt


#: the weights of a PEFT adapter repo (beside adapter_config.json)
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class HubCheckpoint(LazyShards):
    """A safetensors checkpoint in a Hub repo at one commit; build it with ``open_hub``."""

    #: a plan that needs 64 shards' headers waits for a few round trips, not 64 in a row
    header_readers = 16

    def __init__(
        self,
        repo_id: str,
        revision: str | None,
        *,
        name: str | None,
        policy: Policy,
        location: str | None,
        retry: Retry,
    ) -> None:
        self.repo_id = repo_id
        self.revision = revision
        self.commit = None
        self.name = name
        self.policy = policy
        self.location = location or (f"{repo_id}@{revision}" if revision else repo_id)
        self.files = ()
        self.tensors = {}
        #: each loaded file's ``__metadata__``
        self.metadata: dict[str, dict[str, str]] = {}
        #: how ``prefetch`` fetched each file it was told of, and why
        self.fetch_choices: list[FetchChoice] = []
        #: the audit's records of what no output carries (a GGUF's tokenizer: hub/gguf.py)
        self.notes: list[dict[str, Any]] = []
        self._retry = retry
        self._config: dict[str, Any] | None = None
        self._local: dict[str, Path] = {}
        self._ranges: dict[str, RangeCache] = {}
        self._remote: dict[str, RemoteFile] = {}
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._fallback_lock = threading.Lock()  # one download of a file whose server ignores Range

    # -- the Checkpoint contract -----------------------------------------------------
    def config(self, name: str = CONFIG) -> dict[str, Any] | None:
        if name == CONFIG:
            return self._config
        found = self._small_file(name)
        return load_json(found, self._label(name)) if found is not None else None

    def read(self, info: TensorInfo, start: int = 0, length: int | None = None) -> bytes:
        length = self._checked_range(info, start, length)
        span = Span(info.offset + start, info.offset + start + length)
        return self._read_spans(info.file, [span])[0]

    def read_runs(self, info: TensorInfo, runs: Sequence[tuple[int, int]]) -> list[bytes]:
        count = info.shape[0] if info.shape else 1
        outside = sorted({r for first, n in runs for r in (first, first + n - 1) if not 0 <= r < count})
        if outside:
            raise UsageError(
                f"{self._who()}: rows {outside[:5]} are outside tensor {info.key!r}, which has {count} rows",
                key=info.key,
            )
        return self._read_spans(info.file, _row_spans(info, runs))

    def local_path(self, file: str) -> Path | None:
        if file not in self._local and self.commit is not None:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(self.repo_id, file, revision=self.commit)
            if isinstance(cached, str):
                self._local[file] = Path(cached)
        return self._local.get(file)

    def list_files(self) -> tuple[str, ...]:
        return hub_files(self.repo_id, str(self.commit), lambda fn: self._call(fn, file=None))

    def file_path(self, name: str) -> Path:
        return self.local_path(name) or self._download(name)

    def prefetch(self, files: Iterable[str], *, tensors: Iterable[str] = (),
                 rows: Mapping[str, Sequence[int]] | None = None) -> None:
        """Fetch now what a run will read: ``files`` whole, ``tensors`` whole and ``rows``
        (tensor key -> row indices) of others, each file by ranges or a download as the
        policy decides (``fetch_choices`` says which and why). Ranges land in the range
        cache; ``auto`` and ``ranges`` first measure the link's bandwidth if no read did."""
        wanted: dict[str, list[Span]] = {}
        for file in files:
            size = self._size(file)
            wanted.setdefault(file, []).append(Span(0, size if size is not None else 0))
        for key in tensors:
            info = self.tensors[key]
            wanted.setdefault(info.file, []).append(Span(info.offset, info.offset + info.nbytes))
        for key, indices in (rows or {}).items():
            info = self.tensors[key]
            wanted.setdefault(info.file, []).extend(_row_spans(info, row_runs(indices)))
        for file, spans in wanted.items():
            if self.local_path(file) is not None:
                self.fetch_choices.append(FetchChoice(file, self.policy, "cached"))
                continue
            cache = self._range_cache(file)
            todo = [part for s in spans for part in cache.missing(s)]
            if not todo:
                self.fetch_choices.append(FetchChoice(file, self.policy, "cached"))
                continue
            size = self._size(file) or 0
            if self.policy != "download" and needs_probe() and size > PROBE_BYTES:
                start = min(todo[0].start, size - PROBE_BYTES)  # what follows the first span needed
                measure_bandwidth(lambda span: self._fetch(file, span), start)
                todo = [part for s in todo for part in cache.missing(s)]
            requests = plan_requests(todo, link_cost())
            choice = choose(file, self.policy, len(requests), sum(r.size for r in requests), size)
            logger.debug(f"{self._who()}: {file}: {choice.choice} ({choice.to_event(self.name).get('estimate')})")
            started = time.monotonic()
            if choice.choice == "download":
                self._download(file)
            else:
                self._fetch_all(file, requests, keep=False)
            if choice.choice == "download" or file not in self._local:  # else: a fallback said it
                self.fetch_choices.append(replace(choice, seconds=time.monotonic() - started))

    def fetch_events(self) -> list[dict[str, Any]]:
        return [c.to_event(self.name) for c in self.fetch_choices]

    def audit_notes(self) -> list[dict[str, Any]]:
        return list(self.notes)

    def first_etags(self) -> dict[str, str]:
        with self._lock:
            remotes = dict(self._remote)
        return {file: remote.etag for file, remote in sorted(remotes.items()) if remote.etag is not None}

    def expect_etags(self, etags: Mapping[str, str]) -> None:
        for file, etag in etags.items():
            self._remote_file(file).expect_etag(etag)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    # -- opening ---------------------------------------------------------------------
    def _open(self, *, require_pinned: bool, gguf_file: str | None = None) -> None:
        from huggingface_hub import HfApi, get_token

        register_secret(get_token())  # whatever text quotes it, messages will not

        resolved = self._call(lambda: HfApi().resolve_revision(self.repo_id, revision=self.revision), file=None)
        self.commit = resolved.resolved
        if not _COMMIT.fullmatch(self.revision or ""):
            message = (
                f"{self._who()}: {self._rev()} is not a commit; it resolved to {self.commit} for this "
                f"run; pin revision: {self.commit} so that a rerun reads the same bytes"
            )
            if require_pinned:
                raise UsageError(message + " (a pinned commit is required)", source=self.name)
            logger.warning(message)
        if gguf_file is not None:
            from .gguf import open_gguf_model

            return open_gguf_model(self, gguf_file)
        # One round of requests instead of three: unless the cache knows whether there is
        # an index, the single-file header (a miss for a sharded repo) is asked alongside.
        from huggingface_hub import try_to_load_from_cache

        known = try_to_load_from_cache(self.repo_id, SAFETENSORS_INDEX, revision=self.commit) is not None
        with ThreadPoolExecutor(max_workers=3) as pool:
            config_job = pool.submit(self._small_file, CONFIG)
            index_job = pool.submit(self._small_file, SAFETENSORS_INDEX)
            single_job = None if known else pool.submit(self._header, SAFETENSORS_SINGLE, missing_ok=True)
            config, index = config_job.result(), index_job.result()
            if index is None:
                single = single_job.result() if single_job else self._header(SAFETENSORS_SINGLE, missing_ok=True)
        if config is not None:
            self._config = load_json(config, self._label(CONFIG))
        if index is not None:
            # a file of the Hugging Face cache (read again for a shard's keys when asked for)
            weight_map = open_shard_index(index, label=self._label(SAFETENSORS_INDEX), shard_suffix=".safetensors",
                                          limit=sys.maxsize, read_bytes=index.read_bytes)
            self.files = weight_map.files
            self.tensors = LazyTensors(weight_map, self.files, weak_loader(self._shard_tensors))
            return
        if single is None:  # a PEFT adapter repo keeps its weights under another name
            single = self._header(ADAPTER_WEIGHTS, missing_ok=True)
            if single is not None:
                self.files = (ADAPTER_WEIGHTS,)
                self.tensors = {t.key: t for t in single.infos()}
                return
        if single is None:
            listed = self.list_files()
            if any(f.endswith(".gguf") for f in listed):
                from .gguf import open_gguf_model

                return open_gguf_model(self, None, listed)
        if single is None:
            raise EntryNotFoundError(
                f"{self._who()}: commit {self.commit} has neither {SAFETENSORS_INDEX} nor "
                f"{SAFETENSORS_SINGLE}{self._listing()}; ckptxform reads safetensors from the Hub "
                "(download other formats and give a local path)",
                source=self.name,
                path=SAFETENSORS_SINGLE,
            )
        self.files = (SAFETENSORS_SINGLE,)
        self.tensors = {t.key: t for t in single.infos()}

    def _shard_tensors(self, file: str) -> ShardColumns:
        """The tensors of shard ``file`` (read again, if dropped, from the range cache on
        disk: no request), checked against what the index maps to it."""
        try:
            tensors = self._header(file)
            assert tensors is not None
            assert isinstance(self.tensors, LazyTensors)
            self.tensors.check_shard(file, tensors, label=self._label(SAFETENSORS_INDEX))
        except CkptxformError as err:  # raised while planning, far from open_hub
            err.source = err.source or self.name
            raise
        return tensors

    def raw_header(self, file: str) -> bytes:
        if file not in self.files or file.endswith(".gguf"):
            return super().raw_header(file)
        self.tensors_of_file(file)  # its header read (and checked against the index), if not yet
        return self._header_blob(file)[1]

    def _header(self, file: str, *, missing_ok: bool = False) -> ShardColumns | None:
        """The tensors of ``file``'s header."""
        label = self._label(file)
        try:
            size, raw = self._header_blob(file)
        except EntryNotFoundError:
            if missing_ok:
                return None
            raise
        tensors, metadata = parse_header_columns(raw[8:], file=file, file_size=size, label=label)
        self.metadata[file] = metadata
        return tensors

    def _header_blob(self, file: str) -> tuple[int | None, bytes]:
        """``file``'s size and its first bytes, the 8-byte length and the header: one request
        when the header fits in ``SPECULATIVE_HEADER`` bytes, two otherwise (asked again,
        the same spans, which the range cache answers)."""
        label = self._label(file)
        size = self._size(file)
        first = self._read_spans(file, [Span(0, min(SPECULATIVE_HEADER, size or 8))], headers=True)[0]
        n = header_length(first[:8], file_size=size, label=label)
        blob = first[8 : 8 + n]
        if len(blob) < n:
            blob += self._read_spans(file, [Span(8 + len(blob), 8 + n)], headers=True)[0]
        if len(blob) != n:
            raise CheckpointFormatError(f"{label}: file ends inside its {n}-byte header (re-upload it)", path=label)
        return size, first[:8] + blob

    def _small_file(self, file: str) -> Path | None:
        """A small file (config, index) through the Hugging Face cache; None if the
        repo has no such file at the commit (a miss the cache remembers offline too)."""
        from huggingface_hub import _CACHED_NO_EXIST, hf_hub_download, try_to_load_from_cache

        cached = try_to_load_from_cache(self.repo_id, file, revision=self.commit)
        if isinstance(cached, str):
            return Path(cached)
        if cached is _CACHED_NO_EXIST:
            return None
        try:
            return Path(self._call(lambda: hf_hub_download(self.repo_id, file, revision=self.commit, tqdm_class=ByteCounter), file=file))
        except EntryNotFoundError:
            return None

    def _listing(self) -> str:
        """`` (it holds: ...)`` for a message, or nothing when the Hub cannot say."""
        from huggingface_hub import HfApi

        try:
            names = [e.path for e in HfApi().list_repo_tree(self.repo_id, revision=self.commit, recursive=True)]
        except Exception:  # only decorates a message that is raised anyway
            return ""
        shown = ", ".join(repr(n) for n in sorted(names)[:8])
        return f" (it holds {shown}{' and more' if len(names) > 8 else ''})"

    # -- bytes -----------------------------------------------------------------------
    def _read_spans(self, file: str, spans: list[Span], *, headers: bool = False) -> list[bytes]:
        """The bytes of each span of ``file``: from the cached file, the range cache, a
        download (policy ``download``) or range requests. ``headers`` reads never download."""
        path = self.local_path(file)
        if path is None and (headers or self.policy != "download"):
            cache = self._range_cache(file)
            blobs = [cache.get(s) for s in spans]
            requests = plan_requests([s for s, blob in zip(spans, blobs) if blob is None], link_cost())
            fetched = self._fetch_all(file, requests)
            starts = [r.start for r in requests]
            return [b if b is not None else _slice(requests, fetched, starts, s) for s, b in zip(spans, blobs)]
        if path is None:
            path = self._download(file)
        return [self._pread(file, path, s) for s in spans]

    def _fetch_all(self, file: str, requests: list[Span], *, keep: bool = True) -> list[bytes]:
        """The bytes of each request (``keep=False``: into the range cache only)."""
        expect(sum(r.size for r in requests))  # for the run's progress bar, when one counts
        def fetch(span: Span) -> bytes:
            data = self._fetch(file, span)
            return data if keep else b""

        if len(requests) <= 1:
            return [fetch(r) for r in requests]
        with ThreadPoolExecutor(max_workers=min(PARALLEL_REQUESTS, len(requests))) as pool:
            return list(pool.map(fetch, requests))

    def _fetch(self, file: str, span: Span) -> bytes:
        try:
            data = self._call(lambda: self._remote_file(file).read(span), file=file)
        except RangeIgnored as ignored:
            return self._read_downloaded(file, span, ignored)
        self._range_cache(file).put(span.start, data)
        return data

    def _read_downloaded(self, file: str, span: Span, ignored: RangeIgnored) -> bytes:
        """``span`` of ``file`` downloaded whole (as ``fetch: download``): the server
        ignores Range and ``file`` is larger than the window asked. Said once per file."""
        with self._fallback_lock:
            if file not in self._local:
                logger.warning(f"{self._who()}: {file}: the server ignores Range (it answered {ignored}); "
                               "downloading the file instead, as fetch: download")
                self.fetch_choices.append(FetchChoice(file, self.policy, "download", file_bytes=ignored.size))
                self._download(file)
            return self._pread(file, self._local[file], span)

    def _remote_file(self, file: str) -> RemoteFile:
        from huggingface_hub import hf_hub_url

        with self._lock:
            if file not in self._remote:
                self._remote[file] = RemoteFile(hf_hub_url(self.repo_id, file, revision=self.commit))
            return self._remote[file]

    def _download(self, file: str) -> Path:
        from huggingface_hub import hf_hub_download

        logger.info(f"{self._who()}: downloading {file} into the Hugging Face cache")
        path = Path(self._call(lambda: hf_hub_download(self.repo_id, file, revision=self.commit, tqdm_class=ByteCounter), file=file))
        self._local[file] = path
        return path

    def _pread(self, file: str, path: Path, span: Span) -> bytes:
        if file not in self._fds:
            self._fds[file] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        chunks, at = [], span.start
        while at < span.stop:  # pread moves at most ~2 GiB per call
            chunk = os.pread(self._fds[file], min(span.stop - at, 1 << 30), at)
            if not chunk:
                break
            chunks.append(chunk)
            at += len(chunk)
        return b"".join(chunks)

    def _size(self, file: str) -> int | None:
        """``file``'s size: from the cached file or the range cache, else from the Hub
        (resolving the file, which a range read needs anyway)."""
        path = self.local_path(file)
        if path is not None:
            return path.stat().st_size
        cache = self._range_cache(file)
        size = cache.size()
        if size is None:
            size = self._call(lambda: self._remote_file(file).size, file=file)
            if size is not None:
                cache.set_size(size)
        return size

    def _range_cache(self, file: str) -> RangeCache:
        with self._lock:
            if file not in self._ranges:
                from huggingface_hub import constants
                from huggingface_hub.file_download import repo_folder_name

                repo_cache = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=self.repo_id, repo_type="model")
                self._ranges[file] = RangeCache.for_file(repo_cache, str(self.commit), file)
            return self._ranges[file]

    # -- naming ----------------------------------------------------------------------
    def _call(self, fn: Callable[[], _T], *, file: str | None) -> _T:
        return call_hub(fn, where=self._where(), file=file, retry=self._retry)

    def _where(self) -> HubWhere:
        return HubWhere(self.repo_id, self.revision, self.name, self.commit)

    def _who(self) -> str:
        return self._where().who()

    def _rev(self) -> str:
        return self._where().rev()

    def _label(self, file: str) -> str:
        prefix = f"source {self.name!r}: " if self.name else ""
        return f"{prefix}hf://{self.repo_id}@{self.commit or self.revision}/{file}"


def _row_spans(info: TensorInfo, runs: Sequence[tuple[int, int]]) -> list[Span]:
    width = info.row_nbytes
    return [Span(info.offset + first * width, info.offset + (first + n) * width) for first, n in runs]


def _slice(requests: list[Span], blobs: list[bytes], starts: list[int], span: Span) -> bytes:
    """The bytes of ``span`` out of the request (sorted by start) that covers it."""
    i = bisect.bisect_right(starts, span.start) - 1
    request = requests[i]
    assert i >= 0 and span.stop <= request.stop, f"no request covers {span}"
    return blobs[i][span.start - request.start : span.stop - request.start]
