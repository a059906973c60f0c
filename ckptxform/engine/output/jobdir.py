"""A job's directory: the finished shards of one apply, kept across a killed or failed run.

``.OUT.ckptxform-job-DIGEST`` beside OUT, where DIGEST names the plan (ckptxform's
version, the rules, each source's location, commit and weight fingerprint, the output
layout, the digest algorithm). A shard is written under ``partial/``, flushed, renamed
into the job directory, and only then given its record (``FILE.record.json``: size,
header, per-tensor digests in key order, how its Hub bytes were fetched:
engine/output/shard_record.py), so a record always describes a whole shard. A rerun of the same command keeps every shard whose record and
file still match, its bytes re-hashed against the record (a job directory edited after a
kill is not trusted), and writes the rest, saying which it does not keep and why; a job of
another plan is discarded with the reason.
A record of an earlier format (one JSON document; without ``fetches``) is not kept: its shard is written
again, so that the audit of a resumed run never lacks a kept shard's fetch events. The
final commit hard-links the shards into OUT's temporary sibling (engine/output/outdir.py); the
job directory goes once OUT is in place. The temporary-sibling cleanup of outdir.py
matches ``-tmp-PID`` and ``-old-PID`` only, never a job directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

from ...errors import OutputError
from ...fileio import hash_range
from ...tensor_digest import NO_DIGEST, new_hasher
from ...log import logger
from .digest import RunDigest, changes
from .digest_table import TensorDigests
from .shard_record import ShardRecord, read_record
from ..plan.layout import OutputLayout, ShardLayout
from ...errors import io_error

JOB_FILE = "job.json"
_PARTIAL = "partial"
_RECORD_SUFFIX = ".record.json"


def job_identity(layout: OutputLayout, algorithm: str, run: RunDigest) -> dict[str, Any]:
    """Everything a shard's bytes and record depend on, as JSON: the run's digest (the
    decided plan, every file it read, the sources' commits, ckptxform's version:
    engine/output/digest.py), the output layout and the digest algorithm."""
    shape = hashlib.sha256()
    for shard in layout.shards:
        shape.update(f"{shard.file}\0{shard.header_nbytes}\0".encode() + shard.header)
    fields = run.record_fields()
    # the pins of small files are left out: a touch changes no byte and must not orphan the job
    large = set(run.large_files())
    fields["files_read"] = {path: stamp for path, stamp in run.files_read.items() if path in large}
    return {**fields, "version": run.version,
            "sources": {name: {"commit": commit} for name, commit in sorted(run.commits.items())},
            "layout_sha256": shape.hexdigest(), "algorithm": algorithm}


def _difference(then: dict[str, Any], now: dict[str, Any], rules_path: str) -> str:
    """Why a job of identity ``then`` cannot be resumed by a run of identity ``now``."""
    if then.get("algorithm") != now["algorithm"]:
        return f"its digests are {then.get('algorithm')!r}, this run asks for {now['algorithm']!r}"
    current = RunDigest(now["digest"], now["plan_sha256"], now["files_read"],
                        {name: source["commit"] for name, source in now["sources"].items()}, now["version"],
                        now.get("contents", {}))
    found = changes(current, then, rules_path)
    if found:
        return "it was made from " + "; ".join(found)
    return "the output layout changed (its tensors, shapes, dtypes or shard size)"


class JobDir:
    """The job directory of one plan's output; picklable, so worker processes write into it too.

    As a ShardWriter target (``tmp_path``, ``out``, ``fsync``) it takes shards under
    ``partial/``; messages name the files as they will be in OUT.
    """

    def __init__(self, out: Path, identity: dict[str, Any], *, fsync: bool, rules_path: str = "") -> None:
        self.out = Path(os.path.abspath(out))
        self.identity = identity
        #: the rule file, for saying why another job does not fit
        self.rules_path = rules_path
        self.digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
        self.path = self.out.with_name(f".{self.out.name}.ckptxform-job-{self.digest}")
        self.fsync = fsync

    @property
    def tmp_path(self) -> Path:
        """Where this process writes shards before they are committed: one directory per
        process (and host: ranks on a shared filesystem), so a straggler of a killed run
        can never rename another run's file."""
        return self.path / _PARTIAL / f"{os.uname().nodename}-{os.getpid()}"

    def open(self, layout: OutputLayout, *, resume: bool, discard_others: bool = True,
             mine: list[str] | None = None, must_exist: bool = False) -> set[str]:
        """The files of the finished shards kept (their records stay on disk: ``record``
        reads one back; held, every shard's were ~50 bytes a tensor until the commit). Discards other plans' jobs of
        OUT (saying why) when ``discard_others``, and this plan's without ``resume``.
        ``mine``: the only shards this process may rewrite (``--shard-of``: the other
        ranks write the rest at the same time); None: all, with OUT's lock held.
        ``must_exist`` (finalize): a missing job directory is an error naming the others."""
        others = [entry for entry in sorted(self.out.parent.iterdir())
                  if self._pattern.fullmatch(entry.name) and entry != self.path]
        if must_exist and not self.path.is_dir():
            why = "; ".join(f"{entry.name}: {_difference(_read_json(entry / JOB_FILE) or {}, self.identity, self.rules_path)}"
                            for entry in others)
            raise OutputError(f"no shards of this plan to finalize: {str(self.path)!r} does not exist"
                              + (f" (other jobs beside {self.out.name}: {why})" if why else "")
                              + "; run apply --shard-of for every rank first, with the same rules, sources "
                              "and --digest", path=str(self.path))
        for entry in others if discard_others else ():
            self._discard(entry, _difference(_read_json(entry / JOB_FILE) or {}, self.identity, self.rules_path))
        if not resume and mine is None and self.path.exists():
            self._discard(self.path, "--no-resume starts over")
        try:
            self.path.mkdir(exist_ok=True)
            if mine is None:
                shutil.rmtree(self.path / _PARTIAL, ignore_errors=True)  # shards a killed run had begun
            self._write_atomic(self.path / JOB_FILE, self.identity)
        except OSError as err:
            raise io_error("creating the job directory", self.path, err) from None
        algorithm = self.identity["algorithm"]

        def finished(shard: ShardLayout) -> bool:
            own = mine is None or shard.file in mine
            # who writes a shard not kept: this run, or (finalize, another rank's shard) its rank
            then = ("its rank writes it again (apply --shard-of)" if must_exist or not own else "writing it again")
            return self._finished(shard, algorithm, clean=own, then=then) is not None

        kept: set[str] = set()
        # Re-hashing a kept shard reads it once; the shards are read at once (hashing
        # releases the GIL), so a resume costs about the disk's read of the kept shards.
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1, max(1, len(layout.shards))),
                                thread_name_prefix="ckptxform-rehash") as pool:
            for shard, is_finished in zip(layout.shards, pool.map(finished, layout.shards)):
                own = mine is None or shard.file in mine
                if is_finished and (resume or not own):
                    kept.add(shard.file)
        return kept

    def record_path(self, shard: ShardLayout) -> Path:
        """Where finished ``shard``'s record is (engine/output/shard_record.py)."""
        return self.path / (shard.file + _RECORD_SUFFIX)

    @property
    def _pattern(self) -> re.Pattern[str]:
        return re.compile(re.escape(f".{self.out.name}.ckptxform-job-") + "[0-9a-f]{16}")

    def commit_shard(self, shard: ShardLayout, partial: Path, digests: TensorDigests,
                     fetches: tuple[dict[str, Any], ...], cloned: int = 0,
                     moved: tuple[tuple[int, int], ...] = ()) -> ShardRecord:
        """Flush the written ``partial`` file, rename it into the job directory, then record it."""
        final = self.path / shard.file
        try:
            if self.fsync:
                _fsync(partial)
            os.replace(partial, final)
            stat = final.stat()
            record = ShardRecord(shard.file, stat.st_size, hashlib.sha256(shard.header).hexdigest(),
                                 self.identity["algorithm"], digests, stat.st_ino, stat.st_mtime_ns, fetches,
                                 cloned, moved)
            self._write_atomic_with(self.path / (shard.file + _RECORD_SUFFIX), record.write)
        except OSError as err:
            raise io_error("writing", self.out / shard.file, err) from None
        return record

    def begin_shard(self, shard: ShardLayout) -> Path:
        """Make room for this process to write ``shard``; the path it will be written at."""
        try:
            self.tmp_path.mkdir(parents=True, exist_ok=True)
            partial = self.tmp_path / shard.file
            if partial.exists():  # a task of this process that failed
                partial.unlink()
        except OSError as err:
            raise io_error("creating the job directory", self.path, err) from None
        return partial

    def finished_shards(self) -> int:
        """How many shards are committed with their record."""
        return _count_records(self.path)

    def link_into(self, directory: Path, files: list[str]) -> None:
        """Hard-link the finished shards into ``directory`` (copy where links are refused)."""
        for file in files:
            try:
                try:
                    os.link(self.path / file, directory / file)
                except OSError:
                    shutil.copyfile(self.path / file, directory / file)
            except OSError as err:
                raise io_error("writing", self.out / file, err) from None

    def remove(self) -> None:
        """Remove the job directory (OUT is in place); a failure only warns."""
        try:
            shutil.rmtree(self.path)
        except FileNotFoundError:
            pass
        except OSError as err:
            logger.warning("could not remove the job directory {}: {}", self.path, err)

    def _finished(self, shard: ShardLayout, algorithm: str, *, clean: bool, then: str) -> ShardRecord | None:
        record_path = self.record_path(shard)
        record = read_record(record_path)
        try:
            stat = (self.path / shard.file).stat()
        except OSError:
            stat = None
        why = None
        if record is not None and stat is not None:
            why = ("its record is not this plan's" if not record.matches(shard, algorithm) else
                   "it changed after it was recorded (size, inode or mtime)"
                   if (stat.st_size, stat.st_ino, stat.st_mtime_ns) != (record.size, record.inode, record.mtime_ns)
                   else _rehash_mismatch(self.path / shard.file, shard, record))
            if why is None:
                return record
            logger.warning("job directory {}: not keeping {}: {}; {}", self.path, shard.file, why, then)
        for path in (record_path, self.path / shard.file) if clean else ():  # half-done or changed: written again
            if path.exists():
                path.unlink()
        return None

    def _discard(self, path: Path, reason: str) -> None:
        logger.warning("discarding the interrupted job {} ({} finished shard(s)): {}", path, _count_records(path),
                       reason)
        try:
            shutil.rmtree(path)
        except OSError as err:
            raise io_error("removing the interrupted job", path, err) from None

    def write_json(self, name: str, obj: Any) -> Path:
        """Write ``obj`` as ``name`` into the job directory, atomically and compactly (the
        run's plan for its tasks)."""
        try:
            self._write_atomic(self.path / name, obj, indent=None)
        except OSError as err:
            raise io_error("writing", self.path / name, err) from None
        return self.path / name

    def write_pieces(self, name: str, pieces: Iterable[str]) -> Path:
        """Write the text ``pieces`` (a JSON document made piece by piece), and a newline,
        as ``name`` into the job directory, atomically, as ``write_json`` does."""
        path = self.path / name
        part = path.with_name(f"{path.name}.{os.uname().nodename}-{os.getpid()}.tmp")
        try:
            with part.open("w", encoding="utf-8") as file:
                file.writelines(pieces)
                file.write("\n")
            if self.fsync:
                _fsync(part)
            os.replace(part, path)
            if self.fsync:
                _fsync(path.parent)
        except OSError as err:
            raise io_error("writing", path, err) from None
        return path

    def _write_atomic(self, path: Path, obj: Any, indent: int | None = 1) -> None:
        def write(file: IO[str]) -> None:
            # a piece at a time: json.dumps with an indent joins a list of every piece
            json.dump(obj, file, indent=indent)
            file.write("\n")

        self._write_atomic_with(path, write)

    def _write_atomic_with(self, path: Path, write: Callable[[IO[str]], None]) -> None:
        """Have ``write`` write ``path``'s text, then put it in place atomically."""
        part = path.with_name(f"{path.name}.{os.uname().nodename}-{os.getpid()}.tmp")
        with part.open("w", encoding="utf-8") as file:
            write(file)
        if self.fsync:
            _fsync(part)
        os.replace(part, path)
        if self.fsync:
            _fsync(path.parent)


def _rehash_mismatch(path: Path, shard: ShardLayout, record: ShardRecord) -> str | None:
    """Why the bytes of ``path`` are not what ``record`` says (None: they are): its header
    is the plan's and every tensor hashes to the digest recorded for it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as err:
        return f"it cannot be read ({err.strerror})"
    try:
        if os.pread(fd, shard.header_nbytes, 0) != shard.header:
            return "its header is not the plan's"
        if record.algorithm == NO_DIGEST:  # nothing to rehash: its size was checked (matches)
            return None
        for placement, (key, digest) in zip(shard.tensors, record.digests):
            hasher = new_hasher(record.algorithm)
            if hash_range(hasher, fd, placement.offset, placement.nbytes) < placement.nbytes:
                return f"it ends inside tensor {key!r}"
            if hasher.hexdigest() != digest:
                return f"tensor {key!r} does not hash to its recorded {record.algorithm} digest"
    except OSError as err:
        return f"it cannot be read ({err.strerror})"
    finally:
        os.close(fd)
    return None


def _count_records(path: Path) -> int:
    return sum(1 for _ in path.glob("*" + _RECORD_SUFFIX))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

