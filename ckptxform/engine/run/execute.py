"""execute(Plan) -> OUT: stream every output tensor's bytes into place, shard by shard.

Each output's recipe streams its bytes (engine/plan/recipes.py): byte runs of local files are
copied by the kernel, other bytes move through bounded buffers; only casts, numeric fills
and block ops decode values (and import torch). The output appears whole (renamed from a temporary sibling) or not at all.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from itertools import groupby
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ...tensor_digest import DEFAULT_DIGEST, check_digest, recorded_digest
from ...dtypes import DTYPE_SIZES
from ...errors import CkptxformError, OutputError, RequirementError
from ...log import logger
from ...ops.decode import cast_bytes
from ..output.audit import AUDIT_FILE, AuditLog, started_now
from ..output.digest import RunDigest, changes, other_origin, run_digest
from ..output.copied_files import CopiedFile, copied_files_changed
from ..output.jobdir import JobDir, job_identity
from ..plan.layout import OutputLayout, OutputTensorSpec, plan_layout
from ..output.outdir import OutputDir, refuse_foreign, refuse_overlap
from ..plan.planner import Plan
from ..plan.recipes import Chunk, OutputPlan, Piece
from .writer import ShardWriter

if TYPE_CHECKING:
    from .job import RunOptions

_T = TypeVar("_T")


@dataclass(frozen=True)
class WrittenTensor:
    key: str
    file: str
    shape: tuple[int, ...]
    dtype: str
    #: hex digest of the tensor's bytes, by ``algorithm`` (one of ckptxform.tensor_digest.DIGESTS)
    digest: str
    origin: dict[str, Any]
    algorithm: str = DEFAULT_DIGEST

    def to_event(self) -> dict[str, Any]:
        # the record names its algorithm and holds the digest under that name (see ckptxform.digest)
        return {"event": "written", "key": self.key, "file": self.file, "shape": list(self.shape),
                "dtype": self.dtype, "digest": self.algorithm, self.algorithm: self.digest, "from": self.origin}

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> WrittenTensor:
        """The tensor a ``written`` record (checked by ckptxform.engine.output.verify.read_audit) describes."""
        recorded = recorded_digest(event)
        assert recorded is not None, event
        return cls(event["key"], event["file"], tuple(event["shape"]), event["dtype"], recorded[1], event["from"],
                   recorded[0])


@dataclass(frozen=True)
class ApplyResult:
    """What ``apply`` wrote."""

    out: Path
    plan: Plan
    written: tuple[WrittenTensor, ...]
    audit_path: Path
    bytes_written: int
    stale_removed: tuple[Path, ...] = ()
    #: True when ``out`` already held this exact conversion and nothing was written
    up_to_date: bool = False
    #: the rule's ``files`` copied into ``out``
    copied: tuple[CopiedFile, ...] = ()
    #: shards an interrupted run of the same plan had finished, kept instead of written
    shards_kept: int = 0
    #: ``apply --shard-of RANK/WORLD``: this rank, its shards, the job directory they are in
    #: (``out`` is then not written: ``ckptxform finalize`` does that)
    shard_of: tuple[int, int] | None = None
    shards_of_rank: int = 0
    job_path: Path | None = None


def _cast_stream(chunks: Iterator[Chunk], src: str, dst: str) -> Iterator[Chunk]:
    size = DTYPE_SIZES[src]
    for chunk in chunks:
        assert len(chunk) % size == 0
        yield cast_bytes(chunk, src, dst)


def _execution_order(outputs: list[OutputPlan], plan: Plan) -> list[OutputPlan]:
    """What reads whole local tensors in source-file order (sequential reads), then the rest."""
    return sorted(outputs, key=lambda o: (*o.recipe.read_order(plan), o.key))


def _local_pieces(out: OutputPlan, plan: Plan) -> Iterator[Piece] | None:
    """``out``'s bytes as kernel copies from local files, when it is made of such (no cast)."""
    return out.recipe.local_pieces(plan) if out.dtype == out.input_dtype else None


def layout_of(plan: Plan) -> OutputLayout:
    """The output files of ``plan`` and where each tensor goes in them."""
    return plan_layout([OutputTensorSpec(o.key, o.dtype, o.shape) for o in plan.outputs],
                       max_shard_size=plan.rules.output.max_shard_size, file_name=plan.rules.output.file_name,
                       copied_from=_copied_from(plan))


def _copied_from(plan: Plan) -> dict[str, tuple[str, int]]:
    """The source file and offset of every output that is one unchanged run of a local
    file: the layout lines these up so that the writer can clone them."""
    copied = {}
    for o in plan.outputs:
        pieces = _local_pieces(o, plan)
        first = next(pieces, None) if pieces is not None else None
        if isinstance(first, tuple) and first[2] == o.nbytes:
            copied[o.key] = (str(first[0]), first[1])
    return copied


def execute(plan: Plan, out: str | Path, *, force: bool = False, progress: bool | None = None,
            fsync: bool = True, algorithm: str = DEFAULT_DIGEST, options: RunOptions | None = None) -> ApplyResult:
    """Write the planned output to ``out`` with its audit log (tensor digests by
    ``algorithm``: ckptxform.tensor_digest), running its shards as ``options`` say
    (engine/run/job.py); see ``ckptxform.apply``."""
    from .job import RunOptions, run_job

    started = started_now()
    check_digest(algorithm)
    options = options or RunOptions()
    layout = layout_of(plan)
    if progress is None:
        progress = sys.stderr.isatty()
    refuse_overlap(out, _inputs_on_disk(plan))
    digest = run_digest(plan)
    if os.path.lexists(out):
        refuse_foreign(Path(os.path.abspath(out)))
    identity = job_identity(layout, algorithm, digest)
    if not force and os.path.lexists(out):
        previous = _previous_run(plan, digest, Path(out))
        if isinstance(previous, str):
            raise OutputError(f"{os.path.abspath(out)!r} already exists and {previous}; pass --force to "
                              "replace it", path=os.path.abspath(out))
        # a run killed after its rename left its lock file (or a killed --force run its
        # temporary sibling and job directory): this run writes nothing, but it tidies up after them
        own_job = JobDir(Path(out), identity, fsync=fsync).path
        return replace(previous, stale_removed=OutputDir(out).remove_stale(also=(own_job,)))
    _check_ties(plan)
    return run_job(plan, layout, Path(out), options, force=force, fsync=fsync, digest=digest, identity=identity,
                   progress=progress, started=started)


def write_outputs(outputs: list[OutputPlan], plan: Plan, writer: ShardWriter,
                  progress: Callable[[int], None] | None) -> None:
    """Produce the bytes of ``outputs`` into ``writer``: kernel copies (I/O) on this
    thread, gathers, casts and block ops (Python) on another, so that on two cores they overlap."""
    _prefetch(plan, outputs)
    ordered = [(o, _local_pieces(o, plan)) for o in _execution_order(outputs, plan)]
    copies = [(o, local) for o, local in ordered if local is not None]
    streamed = [o for o, local in ordered if local is None]
    stop = threading.Event()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptxform-stream") as pool:
        background = pool.submit(_write_streamed, streamed, plan, writer, progress, stop)
        try:
            _write_copies(copies, writer, progress, stop)
            background.result()
        except BaseException:
            stop.set()  # the other thread stops at its next chunk; the pool waits for it
            raise


def _write_copies(outputs: list[tuple[OutputPlan, Iterator[Piece]]], writer: ShardWriter,
                  progress: Callable[[int], None] | None, stop: threading.Event) -> None:
    """Byte runs of local files: in the kernel, never through Python memory (short runs
    between them through a small buffer). Consecutive runs of one file go to the writer
    together, which copies them with one system call each and no more."""
    for o, pieces in outputs:
        for path, group in groupby(pieces, key=lambda piece: piece[0] if isinstance(piece, tuple) else None):
            if stop.is_set():
                return
            if path is None:
                for chunk in group:
                    writer.write(o.key, chunk)
                    if progress is not None:
                        progress(len(chunk))
                continue
            runs = [(offset, length) for _, offset, length in group]
            writer.copy_runs(o.key, path, runs)
            if progress is not None:
                progress(sum(length for _, length in runs))
        writer.finish_tensor(o.key)


def _write_streamed(outputs: list[OutputPlan], plan: Plan, writer: ShardWriter,
                    progress: Callable[[int], None] | None, stop: threading.Event) -> None:
    """Everything else (row gathers, casts, remote copies, vocab maps), chunk by chunk."""
    try:
        for o in outputs:
            chunks = o.recipe.stream(plan)
            if o.dtype != o.input_dtype:
                chunks = _cast_stream(chunks, o.input_dtype, o.dtype)
            for chunk in chunks:
                if stop.is_set():
                    return
                writer.write(o.key, chunk)
                if progress is not None:
                    progress(len(chunk))
            writer.finish_tensor(o.key)
    except BaseException:
        stop.set()  # the copying thread stops at its next tensor
        raise


class _Audit:
    """The run's audit log. A failed write (a full disk) is one OutputError like any other
    write to OUT; closing after another failure must not replace that failure with its own."""

    def __init__(self, odir: OutputDir) -> None:
        self._odir = odir
        self._log = self._guard(lambda: AuditLog(odir.tmp_path / AUDIT_FILE))

    def event(self, obj: dict[str, Any]) -> None:
        self._guard(lambda: self._log.event(obj))

    def close(self, *, failing: bool = False) -> None:
        try:
            self._log.close()
        except OSError as err:
            if not failing:
                raise self._odir.write_error(AUDIT_FILE, err) from None

    def _guard(self, action: Callable[[], _T]) -> _T:
        try:
            return action()
        except OSError as err:
            raise self._odir.write_error(AUDIT_FILE, err) from None


def _inputs_on_disk(plan: Plan) -> list[tuple[str, Path]]:
    """Everything local the run reads, as (what, resolved path): OUT must stay clear of it."""
    inputs = [(f"source {name!r}", path) for name, ckpt in plan.checkpoints.items() for path in ckpt.local_paths()]
    inputs += [(f"the file of vocabulary {name!r}", Path(pin.path)) for name, pin in plan.vocab_files.items()]
    return inputs + [("the rule file", Path(file).resolve()) for file in plan.rules.files]


def _previous_run(plan: Plan, digest: RunDigest, out: Path) -> ApplyResult | str:
    """The result already in ``out`` when it was made by this ckptxform from the same plan
    and the same inputs (``engine.digest``) and still verifies; otherwise why not, for the
    refusal without --force."""
    from ..output.verify import read_audit, verify

    try:
        events = read_audit(out)
        if not events or events[0].get("event") != "run":
            return f"its {AUDIT_FILE} does not start with a run record"
        origin = other_origin(events[0], plan)
        if origin:
            return "was made " + " and ".join(origin)
        # the copied files' own account first: it names the file
        changed = (copied_files_changed(plan.files, plan.checkpoints, events)
                   or changes(digest, events[0], plan.rules.path))
        if changed:
            return "was made from " + "; ".join(changed)
        verify(out)
    except CkptxformError as err:
        problems = str(err).splitlines()
        more = f" and {len(problems) - 1} more problem(s)" if len(problems) > 1 else ""
        return f"does not verify: {problems[0]}{more}"
    written = tuple(WrittenTensor.from_event(e) for e in events if e.get("event") == "written")
    # DEBUG, not INFO: the CLI prints the result on stdout, once; a library user who enabled
    # ckptxform's logs still sees it
    logger.debug("{} is up to date: made from the same plan and inputs, and it verifies; "
                 "nothing to do (pass --force to rewrite it)", out)
    return ApplyResult(out=out, plan=plan, written=written, audit_path=out / AUDIT_FILE,
                       bytes_written=0, up_to_date=True)


def _check_ties(plan: Plan) -> None:
    """A tied tensor is dropped only when its bytes are the output's it is tied to (read
    a chunk at a time, before anything is written)."""
    for source, key, target, label in plan.ties:
        ckpt = plan.checkpoints[source]
        info = ckpt.tensors[key]
        out = next(o for o in plan.outputs if o.key == target)
        pos = 0
        for chunk in out.recipe.stream(plan):
            mine = ckpt.read(info, pos, len(chunk))
            if mine != bytes(chunk):
                first = next(i for i, (a, b) in enumerate(zip(mine, bytes(chunk))) if a != b)
                raise RequirementError(
                    f"{label}: tie: {source}:{key} differs from output {target!r} at byte {pos + first}; "
                    "tie only identical tensors (or write both, without tie)", key=key)
            pos += len(chunk)


def _prefetch(plan: Plan, outputs: list[OutputPlan]) -> None:
    """Tell each source which tensors of ``outputs`` will be copied whole and which rows
    gathered (Hub sources fetch them, by ranges or a download, and remember how: the
    audit's ``fetch`` events, written at the commit)."""
    tensors: dict[str, set[str]] = {}
    rows: dict[str, dict[str, list[int]]] = {}
    for o in outputs:
        for source, key, wanted in o.recipe.prefetch_reads(plan):
            if wanted is None:
                tensors.setdefault(source, set()).add(key)
            else:
                rows.setdefault(source, {}).setdefault(key, []).extend(wanted)
    for name in sorted(set(tensors) | set(rows)):
        plan.checkpoints[name].prefetch((), tensors=sorted(tensors.get(name, ())), rows=rows.get(name, {}))


