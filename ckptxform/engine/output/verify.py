"""``ckptxform verify OUT``: re-read every output tensor and check it against the audit log.

Checks that the audit log is complete (``summary`` with status ok), that the weight files
hold exactly the tensors the audit lists with their shapes and dtypes, that every
tensor's bytes hash to the recorded digest (by the algorithm its record names: BLAKE3,
or sha256 in older audits and with ``apply --digest sha256``), that the shard index maps
each key to the file the audit names, that config.json is the one written, and that every
file copied by the rule's ``files`` still has the sha256 the audit records.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...tensor_digest import DIGEST_CHOICES, new_hasher, recorded_digest, unhashed, update_size
from .audit import AUDIT_FILE
from .copied_files import check_copied_files
from ...errors import CkptxformError, VerifyError, quote_keys
from ...fileio import hash_range, open_regular, read_small_file
from ...sources.local import MAX_CONFIG_BYTES
from ...sources.safetensors_header import MAX_HEADER_BYTES, read_header

_HASH_THREADS = 2
#: one line per tensor; a million-tensor audit is a few hundred MB
MAX_AUDIT_BYTES = 1 << 30


@dataclass(frozen=True)
class VerifyResult:
    out: Path
    tensors: int
    bytes_checked: int
    #: bytes whose records hold no digest (``apply --digest none``): sizes checked, bytes not
    bytes_unchecked: int = 0


def read_audit(out: Path) -> list[dict[str, Any]]:
    """The events of ``out``'s audit log; a missing or unreadable log is a VerifyError."""
    path = out / AUDIT_FILE
    try:
        lines = read_small_file(path, MAX_AUDIT_BYTES, what="an audit log").decode("utf-8").splitlines()
    except FileNotFoundError:
        raise VerifyError(f"{path}: no audit log; {str(out)!r} was not written by ckptxform apply",
                          path=str(path)) from None
    except (OSError, UnicodeDecodeError) as err:
        raise VerifyError(f"{path}: cannot read the audit log: {err}", path=str(path)) from None
    events = []
    for number, line in enumerate(lines, 1):
        try:
            event = json.loads(line)
        except json.JSONDecodeError as err:
            raise VerifyError(f"{path}:{number}: not JSON ({err.msg}); the audit log is damaged",
                              path=str(path), line=number) from None
        if not isinstance(event, dict) or "event" not in event:
            raise VerifyError(f"{path}:{number}: not an audit event", path=str(path), line=number)
        if event["event"] == "written" and event.get("digest", DIGEST_CHOICES[0]) not in DIGEST_CHOICES:
            raise VerifyError(f"{path}:{number}: the 'written' event's digest is {event['digest']!r}, which this "
                              f"ckptxform cannot check (it knows {', '.join(map(repr, DIGEST_CHOICES))}); upgrade "
                              "ckptxform", path=str(path), line=number)
        if event["event"] == "written" and not _is_written_event(event):
            raise VerifyError(f"{path}:{number}: a 'written' event needs key, file (a plain file name), shape, "
                              "dtype, its digest (blake3 or sha256) and from; the audit log is damaged",
                              path=str(path), line=number)
        events.append(event)
    return events


def _is_written_event(event: dict[str, Any]) -> bool:
    # verify opens OUT/file: a damaged or hostile audit must not send it outside OUT
    file, shape = event.get("file"), event.get("shape")
    return (isinstance(event.get("key"), str) and isinstance(file, str) and file not in ("", ".", "..")
            and "/" not in file and "\\" not in file and "\0" not in file
            and isinstance(shape, list) and all(isinstance(d, int) for d in shape)
            and isinstance(event.get("dtype"), str) and (recorded_digest(event) is not None or _is_span(event))
            and isinstance(event.get("from"), dict))


def _is_span(event: dict[str, Any]) -> bool:
    """A ``--digest none`` record's byte range: ``"bytes": [start, end]``."""
    span = event.get("bytes")
    return (unhashed(event) and isinstance(span, list) and len(span) == 2
            and all(type(n) is int for n in span) and 0 <= span[0] <= span[1])


def verify(out: str | os.PathLike[str]) -> VerifyResult:
    """Check ``out`` against its audit log; raise VerifyError listing every problem.

    >>> verify("kimi-k25-drafter").tensors   # doctest: +SKIP
    15
    """
    root = Path(out)
    if not root.is_dir():
        raise VerifyError(f"{str(root)!r} is not a directory; give the --out of an apply", path=str(root))
    events = read_audit(root)
    summary = events[-1] if events else {}
    if summary.get("event") != "summary" or summary.get("status") != "ok":
        raise VerifyError(f"{root / AUDIT_FILE}: the audit log has no successful summary; the run that "
                          "wrote it did not finish: rerun apply with --force")
    written = {e["key"]: e for e in events if e.get("event") == "written"}
    problems: list[str] = []
    on_disk: dict[str, tuple[str, dict[str, Any]]] = {}
    files = sorted({e["file"] for e in written.values()})
    unreadable: set[str] = set()
    # a tensor's hash is one core's work: hash two tensors at a time (results in file order)
    pool = ThreadPoolExecutor(max_workers=_HASH_THREADS, thread_name_prefix="ckptxform-verify")
    try:
        found, checked, unchecked = _check_files(root, written, files, on_disk, unreadable, pool)
    finally:
        # interrupted: queued tensors are dropped (the at most two being hashed finish)
        pool.shutdown(wait=False, cancel_futures=True)
    problems += found
    missing = sorted(set(written) - set(on_disk) - unreadable)
    problems += [f"{root}: tensor {key!r} (audit: {written[key]['file']}) is missing" for key in missing]
    problems += _check_index(root, written)
    problems += _check_config(root, summary)
    problems += check_copied_files(root, events)
    if problems:
        raise VerifyError("\n".join(problems), path=str(root))
    return VerifyResult(root, len(written), checked, unchecked)


def _check_files(root: Path, written: dict[str, dict[str, Any]], files: list[str],
                 on_disk: dict[str, tuple[str, dict[str, Any]]], unreadable: set[str],
                 pool: ThreadPoolExecutor) -> tuple[list[str], int, int]:
    """Every weight file's header and every tensor's digest against the audit: the
    problems in file order, the bytes hashed and those with no digest to check."""
    # a problem, or a hash still running: resolved in this order at the end
    found: list[str | _PendingCheck] = []
    checked = unchecked = 0
    for file in files:
        path = root / file
        try:
            shard = open_regular(path)  # a FIFO must not block the open, a device never end
        except OSError as err:
            # one line for the file, not one per tensor: a lost shard may hold thousands
            lost = [key for key, e in written.items() if e["file"] == file]
            unreadable.update(lost)
            found.append(f"{path}: {err.strerror or err}; the output is incomplete: the audit puts {len(lost)} "
                         f"tensor(s) there ({quote_keys(lost, limit=3)})")
            continue
        try:
            fd = shard.fileno()
            stat = os.fstat(fd)
            identity = (stat.st_dev, stat.st_ino)
            if file.endswith(".gguf"):
                from .gguf.read_back import gguf_tensors

                infos = gguf_tensors(path, str(path))
            else:
                infos, _ = read_header(lambda off, n: os.pread(fd, n, off), file=file, file_size=stat.st_size,
                                       label=str(path))
            for info in infos:
                entry = written.get(info.key)
                if entry is None:
                    found.append(f"{path}: tensor {info.key!r} is not in the audit log")
                    continue
                on_disk[info.key] = (file, entry)
                if entry["file"] != file:
                    found.append(f"{path}: tensor {info.key!r} is in {file}, the audit says {entry['file']}")
                if list(info.shape) != entry["shape"] or info.dtype != entry["dtype"]:
                    found.append(f"{path}: tensor {info.key!r} is {info.dtype} {list(info.shape)}, the audit "
                                 f"says {entry['dtype']} {entry['shape']}")
                if unhashed(entry):  # --digest none: where the bytes are, not what they are
                    if entry["bytes"] != [info.offset, info.offset + info.nbytes]:
                        found.append(f"{path}: tensor {info.key!r} is at bytes {info.offset}-"
                                     f"{info.offset + info.nbytes}, the audit says {entry['bytes'][0]}-"
                                     f"{entry['bytes'][1]}")
                    unchecked += info.nbytes
                    continue
                recorded = recorded_digest(entry)
                assert recorded is not None  # read_audit checked it
                job = pool.submit(_digest, path, identity, info.offset, info.nbytes, recorded[0])
                found.append((path, info.key, *recorded, job))
                checked += info.nbytes
        except CkptxformError as err:
            found.append(str(err))
        finally:
            shard.close()
    return [message for item in found if (message := _resolve(item))], checked, unchecked


#: a tensor being hashed: its file, key, the algorithm and digest its record holds, the hash
_PendingCheck = tuple[Path, str, str, str, Future[str]]


def _resolve(item: str | _PendingCheck) -> str | None:
    if isinstance(item, str):
        return item
    path, key, algorithm, recorded, job = item
    try:
        digest = job.result()
    except OSError as err:
        return f"{path}: tensor {key!r}: cannot read: {err.strerror or err}"
    if digest != recorded:
        return (f"{path}: tensor {key!r}: {algorithm} {digest[:12]}... differs from "
                f"the audit's {recorded[:12]}...; its bytes were changed after apply")
    return None


def _digest(path: Path, identity: tuple[int, int], offset: int, length: int, algorithm: str) -> str:
    """The ``algorithm`` digest (hex) of ``length`` bytes of ``path`` from ``offset``. A file
    cut short or replaced since its header was read (``identity``: its device and inode
    then) raises OSError."""
    digest = new_hasher(algorithm, length)
    with open_regular(path) as file:
        stat = os.fstat(file.fileno())
        if (stat.st_dev, stat.st_ino) != identity:
            raise OSError("the file was replaced while verify read it")
        done = hash_range(digest, file.fileno(), offset, length, update_size(algorithm, length))
        if done < length:
            raise OSError(f"the file ends at byte {offset + done}, inside the tensor")
    return digest.hexdigest()


def _check_index(root: Path, written: dict[str, dict[str, Any]]) -> list[str]:
    index = root / "model.safetensors.index.json"
    files = {e["file"] for e in written.values()}
    if not index.exists():
        return [f"{index}: missing; the output has {len(files)} shards"] if len(files) > 1 else []
    try:
        weight_map = json.loads(read_small_file(index, MAX_HEADER_BYTES, what="a shard index"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return [f"{index}: unreadable ({err})"]
    expected = {k: e["file"] for k, e in written.items()}
    if weight_map != expected:
        wrong = sorted(k for k in set(weight_map) | set(expected) if weight_map.get(k) != expected.get(k))
        return [f"{index}: weight_map disagrees with the audit for {len(wrong)} key(s), e.g. {wrong[0]!r}"]
    return []


def _check_config(root: Path, summary: dict[str, Any]) -> list[str]:
    recorded = summary.get("config_sha256")
    path = root / summary.get("config_file", "config.json")  # older audits: config.json
    if recorded is None:
        return [f"{path}: present but the audit records no config"] if path.exists() else []
    try:
        digest = hashlib.sha256(read_small_file(path, MAX_CONFIG_BYTES, what="a config.json")).hexdigest()
    except OSError as err:
        return [f"{path}: {err.strerror or err}"]
    return [] if digest == recorded else [f"{path}: changed after apply (sha256 differs from the audit)"]
