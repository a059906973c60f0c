"""execute(Plan) -> OUT: stream every output tensor's bytes into place, shard by shard.

Copies move bytes through a bounded buffer; row gathers read only the rows they need, a
bounded block of rows at a time; only casts and numeric fills decode values (and import
torch). The output appears whole (renamed from a temporary sibling) or not at all.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from ..dtypes import DTYPE_SIZES
from ..errors import CkptxformError, OutputError, PlanError
from ..log import logger
from ..sources.pins import check_unchanged
from .audit import AUDIT_FILE, AuditLog, run_event, started_now
from .files import CopiedFile, copied_files_changed, copy_files
from .digest import RunDigest, changes, run_digest
from .layout import OutputTensorSpec, plan_layout
from .outdir import OutputDir, refuse_foreign, refuse_overlap
from .planner import Plan
from .recipes import CopyTensor, GatherRows, OutputPlan, VocabField
from .writer import ShardWriter

_T = TypeVar("_T")

#: bytes moved per read/write; bounds memory per tensor being copied or gathered
CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class WrittenTensor:
    key: str
    file: str
    shape: tuple[int, ...]
    dtype: str
    sha256: str
    origin: dict[str, Any]

    def to_event(self) -> dict[str, Any]:
        return {"event": "written", "key": self.key, "file": self.file, "shape": list(self.shape),
                "dtype": self.dtype, "sha256": self.sha256, "from": self.origin}


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


Producer = Callable[[OutputPlan, Plan], Iterator[bytes | bytearray | memoryview]]


def _copy(out: OutputPlan, plan: Plan) -> Iterator[bytes | bytearray | memoryview]:
    recipe = out.recipe
    assert isinstance(recipe, CopyTensor)
    ckpt = plan.checkpoints[recipe.source]
    info = ckpt.tensors[recipe.key]
    for start in range(0, info.nbytes, CHUNK_BYTES):
        yield ckpt.read(info, start, min(CHUNK_BYTES, info.nbytes - start))


def _local_file(out: OutputPlan, plan: Plan) -> tuple[Path, int, int] | None:
    """(path, offset, length) when ``out`` is a verbatim copy of bytes in a local file."""
    recipe = out.recipe
    if not isinstance(recipe, CopyTensor) or out.dtype != out.input_dtype:
        return None
    ckpt = plan.checkpoints[recipe.source]
    info = ckpt.tensors[recipe.key]
    path = ckpt.local_path(info.file)
    return None if path is None or info.offset < 0 else (path, info.offset, info.nbytes)


def _gather(out: OutputPlan, plan: Plan) -> Iterator[bytes | bytearray | memoryview]:
    recipe = out.recipe
    assert isinstance(recipe, GatherRows)
    ckpt = plan.checkpoints[recipe.source]
    info = ckpt.tensors[recipe.key]
    width = info.row_nbytes
    fill = _Filler(recipe, plan, info.dtype, info.shape[1:], width)
    block = max(1, CHUNK_BYTES // max(1, width))
    for first in range(0, len(recipe.rows), block):
        rows = recipe.rows[first:first + block]
        targets = recipe.targets[first:first + block]
        buf = bytearray(len(rows) * width)
        _place_runs(buf, width, ckpt, info, [(j, row) for j, row in enumerate(rows) if row >= 0])
        fill.place(buf, [(j, target) for j, (row, target) in enumerate(zip(rows, targets)) if row < 0])
        yield memoryview(buf).toreadonly()  # never refilled: the writer may hash it after write returns


def _place_runs(buf: bytearray, width: int, ckpt: Any, info: Any, pairs: list[tuple[int, int]],
                cast: tuple[str, str] | None = None) -> None:
    """Copy row ``row`` of ``info`` to row ``pos`` of ``buf`` for each ``(pos, row)``: one read
    and one copy per run of rows adjacent on both sides (in a vocabulary alignment most
    are), not one per row."""
    runs: list[list[int]] = []  # [pos, row, count]
    for pos, row in pairs:
        if runs and runs[-1][0] + runs[-1][2] == pos and runs[-1][1] + runs[-1][2] == row:
            runs[-1][2] += 1
        else:
            runs.append([pos, row, 1])
    spans = [(row, count) for _, row, count in runs]
    if cast is None:
        ckpt.read_runs_into(info, spans, memoryview(buf), [pos for pos, _, _ in runs])
        return
    for (pos, _, count), blob in zip(runs, ckpt.read_runs(info, spans), strict=True):
        buf[pos * width:(pos + count) * width] = _cast_bytes(blob, *cast)


class _Filler:
    """Rows for target tokens the source vocabulary lacks, per ``missing_rows``."""

    def __init__(self, recipe: GatherRows, plan: Plan, dtype: str, row_shape: tuple[int, ...], width: int):
        self.recipe, self.plan, self.dtype, self.row_shape, self.width = recipe, plan, dtype, row_shape, width
        self._generator: Any = None
        self._mean: bytes | None = None

    def place(self, buf: bytearray, missing: list[tuple[int, int]]) -> None:
        """Fill row ``pos`` of ``buf`` for each ``(pos, target token id)`` in ``missing``."""
        if not missing:
            return
        spec = self.recipe.fill
        if spec is None:
            raise PlanError(f"{self.recipe.key!r}: rows are missing and no missing_rows was given")
        width = self.width
        if spec.init == "rows_of":
            assert spec.rows_of is not None and spec.tensor is not None
            ckpt = self.plan.checkpoints[spec.rows_of]
            info = ckpt.tensors[spec.tensor]
            cast = (info.dtype, self.dtype) if info.dtype != self.dtype else None
            _place_runs(buf, width, ckpt, info, missing, cast)
        elif spec.init == "zeros":
            pass  # a new buffer is zeros already
        elif spec.init == "mean":
            if self._mean is None:
                self._mean = self._mean_row()
            for pos, _ in missing:
                buf[pos * width:(pos + 1) * width] = self._mean
        else:
            raw = self._normal(len(missing), spec.std, spec.seed)
            for i, (pos, _) in enumerate(missing):
                buf[pos * width:(pos + 1) * width] = raw[i * width:(i + 1) * width]

    def _mean_row(self) -> bytes:
        import torch

        from ..dtypes import torch_dtype

        ckpt = self.plan.checkpoints[self.recipe.source]
        info = ckpt.tensors[self.recipe.key]
        present = sorted({r for r in self.recipe.rows if r >= 0})
        total = torch.zeros(self.row_shape, dtype=torch.float64)
        block = max(1, CHUNK_BYTES // max(1, self.width))
        for i in range(0, len(present), block):
            chunk = ckpt.read_rows(info, present[i:i + block])
            for raw in chunk.values():
                # summed in float64: torch does not promote float8 rows
                total += torch.frombuffer(bytearray(raw), dtype=torch_dtype(self.dtype)).reshape(
                    self.row_shape).to(torch.float64)
        mean = (total / max(1, len(present))).to(torch_dtype(self.dtype))
        return _tensor_bytes(mean)

    def _normal(self, count: int, std: float, seed: int) -> bytes:
        import torch

        from ..dtypes import torch_dtype

        if self._generator is None:
            self._generator = torch.Generator().manual_seed(seed)
        values = torch.randn((count, *self.row_shape), generator=self._generator, dtype=torch.float32) * std
        return _tensor_bytes(values.to(torch_dtype(self.dtype)))


def _vocab_field(out: OutputPlan, plan: Plan) -> Iterator[bytes]:
    recipe = out.recipe
    assert isinstance(recipe, VocabField)
    vmap = plan.vocab_maps[recipe.vocab]
    yield vmap.d2t_bytes(recipe.encoding) if recipe.field == "d2t" else vmap.t2d_bytes()


#: how each recipe's bytes are made; a new verb adds its recipe type and one function here
PRODUCERS: dict[type, Producer] = {CopyTensor: _copy, GatherRows: _gather, VocabField: _vocab_field}


def _tensor_bytes(tensor: Any) -> bytes:
    """The raw bytes of a CPU tensor (without numpy, which torch does not require)."""
    import ctypes

    tensor = tensor.contiguous()
    return ctypes.string_at(tensor.data_ptr(), tensor.numel() * tensor.element_size())


def _cast_bytes(raw: bytes | bytearray | memoryview, src: str, dst: str) -> bytes:
    """Elementwise dtype conversion of raw little-endian tensor bytes (imports torch)."""
    import torch

    from ..dtypes import torch_dtype

    values = torch.frombuffer(bytearray(raw), dtype=torch_dtype(src))
    return _tensor_bytes(values.to(torch_dtype(dst)))


def _cast_stream(chunks: Iterator[bytes | bytearray | memoryview], src: str,
                 dst: str) -> Iterator[bytes | bytearray | memoryview]:
    size = DTYPE_SIZES[src]
    for chunk in chunks:
        assert len(chunk) % size == 0
        yield _cast_bytes(chunk, src, dst)


def _execution_order(plan: Plan) -> list[OutputPlan]:
    """Copies in source-file order (sequential reads), then everything else."""
    def key(o: OutputPlan) -> tuple[int, str, str, int, str]:
        r = o.recipe
        if isinstance(r, CopyTensor):
            info = plan.checkpoints[r.source].tensors[r.key]
            return (0, r.source, info.file, info.offset, o.key)
        return (1, "", "", 0, o.key)
    return sorted(plan.outputs, key=key)


def execute(plan: Plan, out: str | Path, *, force: bool = False, progress: bool | None = None,
            fsync: bool = True) -> ApplyResult:
    """Write the planned output to ``out`` with its audit log; see ``ckptxform.apply``."""
    started = started_now()
    layout = plan_layout([OutputTensorSpec(o.key, o.dtype, o.shape) for o in plan.outputs],
                         max_shard_size=plan.rules.output.max_shard_size,
                         file_name=plan.rules.output.file_name)
    if progress is None:
        progress = sys.stderr.isatty()
    refuse_overlap(out, _inputs_on_disk(plan))
    digest = run_digest(plan)
    if os.path.lexists(out):
        refuse_foreign(Path(os.path.abspath(out)))
    if not force and os.path.lexists(out):
        previous = _previous_run(plan, digest, Path(out))
        if isinstance(previous, str):
            raise OutputError(f"{os.path.abspath(out)!r} already exists and {previous}; pass --force to "
                              "replace it", path=os.path.abspath(out))
        # a run killed after its rename left its lock file (or a killed --force run its
        # temporary sibling): this run writes nothing, but it still tidies up after them
        return replace(previous, stale_removed=OutputDir(out).remove_stale())
    with OutputDir(out, force=force, fsync=fsync) as odir:
        audit = _Audit(odir)
        try:
            audit.event(run_event(plan, started, digest))
            for record in plan.records:
                audit.event(record.to_event())
            _prefetch(plan)
            bar = _progress_bar(layout.total_bytes, progress)
            with ShardWriter(odir, layout) as writer:
                ordered = [(o, _local_file(o, plan)) for o in _execution_order(plan)]
                copies = [(o, local) for o, local in ordered if local is not None]
                streamed = [o for o, local in ordered if local is None]
                # Kernel copies (I/O) on this thread, gathers and casts (Python) on another:
                # on two cores they overlap.
                stop = threading.Event()
                with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptxform-stream") as pool:
                    background = pool.submit(_write_streamed, streamed, plan, writer, bar, stop)
                    try:
                        _write_copies(copies, writer, bar, stop)
                        background.result()
                    except BaseException:
                        stop.set()  # the other thread stops at its next chunk; the pool waits for it
                        raise
                config_sha256 = None
                if plan.config is not None:
                    config_path = writer.write_json("config.json", plan.config)
                    config_sha256 = hashlib.sha256(config_path.read_bytes()).hexdigest()
                bytes_written = writer.bytes_written
            copied = copy_files(plan.files, plan.checkpoints, odir.tmp_path)
            # closing the writer waited for every hash
            written = sorted((WrittenTensor(o.key, layout.placement(o.key).file, o.shape, o.dtype,
                                            writer.digest(o.key), o.origin()) for o in plan.outputs),
                             key=lambda w: w.key)
            if bar is not None:
                bar.close()
            for item in written:
                audit.event(item.to_event())
            for event in [skip.to_event() for skip in plan.files.skips] + [c.to_event() for c in copied]:
                audit.event(event)
            audit.event({"event": "summary", "status": "ok", "tensors": plan.counts(), "copied_files": len(copied),
                         "written": len(written), "bytes_written": bytes_written,
                         "files": [s.file for s in layout.shards], "config_sha256": config_sha256,
                         "warnings": list(plan.warnings)})
            # every byte is read: a source written to since it was planned fails the run here
            check_unchanged(plan.files_read())
        except BaseException:
            audit.close(failing=True)
            raise
        audit.close()
        final = odir.commit()
    return ApplyResult(out=final, plan=plan, written=tuple(written),
                       audit_path=final / AUDIT_FILE, bytes_written=bytes_written,
                       stale_removed=odir.stale_removed, copied=copied)


def _write_copies(outputs: list[tuple[OutputPlan, tuple[Path, int, int]]], writer: ShardWriter, bar: Any,
                  stop: threading.Event) -> None:
    """Verbatim copies from local files: in the kernel, never through Python memory."""
    for o, (path, offset, length) in outputs:
        if stop.is_set():
            return
        writer.copy_from(o.key, path, offset, length)
        writer.finish_tensor(o.key)
        if bar is not None:
            bar.update(length)


def _write_streamed(outputs: list[OutputPlan], plan: Plan, writer: ShardWriter, bar: Any,
                    stop: threading.Event) -> None:
    """Everything else (row gathers, casts, remote copies, vocab maps), chunk by chunk."""
    try:
        for o in outputs:
            chunks = PRODUCERS[type(o.recipe)](o, plan)
            if o.dtype != o.input_dtype:
                chunks = _cast_stream(chunks, o.input_dtype, o.dtype)
            for chunk in chunks:
                if stop.is_set():
                    return
                writer.write(o.key, chunk)
                if bar is not None:
                    bar.update(len(chunk))
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
    from ..verify import read_audit, verify

    try:
        events = read_audit(out)
        if not events or events[0].get("event") != "run":
            return f"its {AUDIT_FILE} does not start with a run record"
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
    written = tuple(WrittenTensor(e["key"], e["file"], tuple(e["shape"]), e["dtype"], e["sha256"], e["from"])
                    for e in events if e.get("event") == "written")
    logger.info("{} is up to date: made from the same plan and inputs, and it verifies; "
                "nothing to do (pass --force to rewrite it)", out)
    return ApplyResult(out=out, plan=plan, written=written, audit_path=out / AUDIT_FILE,
                       bytes_written=0, up_to_date=True)


def _prefetch(plan: Plan) -> None:
    """Tell each source which files will be copied whole (Hub sources download them)."""
    files: dict[str, set[str]] = {}
    for o in plan.outputs:
        if isinstance(o.recipe, CopyTensor):
            info = plan.checkpoints[o.recipe.source].tensors[o.recipe.key]
            files.setdefault(o.recipe.source, set()).add(info.file)
    for name, needed in files.items():
        plan.checkpoints[name].prefetch(sorted(needed))


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="writing", file=sys.stderr)
