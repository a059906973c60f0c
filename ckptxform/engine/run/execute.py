"""execute(Plan, OpenSources) -> OUT: what is decided before a shard is written (the layout, an OUT that
is already up to date, overlaps, ties), then the job (engine/run/job.py).

Each output's recipe streams its bytes (engine/run/stream.py); the output appears whole
(renamed from a temporary sibling) or not at all.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from ...bulk_gc import collector_paused
from ...errors import CkptxformError, OutputError, RequirementError
from ...log import logger
from ..output.audit import AUDIT_FILE, started_now
from ..output.copied_files import copied_files_changed
from ..output.digest import RunDigest, changes, other_origin, run_digest
from ..output.jobdir import JobDir, job_identity
from ..output.outdir import OutputDir, refuse_foreign, refuse_overlap
from ..plan.layout import CopiedFrom, OutputLayout, layout_in_groups, plan_layout
from ..plan.layout_follow import SAVE_PRETRAINED_SHARD_SIZE, source_file_groups
from ..plan.layout_like import plan_layout_like
from ..plan.opened import OpenSources
from ..plan.planner import Plan
from .executors import check_executor
from .job import run_job
from .options import RunOptions
from .result import ApplyResult, WrittenTensor

__all__ = ["ApplyResult", "WrittenTensor", "execute", "layout_of"]


def layout_of(plan: Plan, sources: OpenSources) -> OutputLayout:
    """The output files of ``plan`` and where each tensor goes in them: packed into shards
    of ``output.max_shard_size``, in the files of the source ``output.shards.like`` names, or
    by default as the converted source is sharded (engine/plan/layout_follow.py)."""
    if plan.rules.output.format == "gguf":
        from ..output.gguf.layout import plan_gguf_layout

        return plan_gguf_layout(plan, sources)
    specs = plan.outputs  # laid out as they are, each shard their ranks: checked as the layout walks them
    output = plan.rules.output
    if output.shards_like is not None:
        return plan_layout_like(specs, source=output.shards_like, ckpt=sources.checkpoints[output.shards_like],
                                copied_from=_copied_from(plan, sources))
    max_shard_size = output.max_shard_size  # None: one file (a rule that names it)
    if output.follows_source:
        found = source_file_groups(plan, sources)
        if found is not None:
            groups, in_order = found
            return layout_in_groups(specs, groups, in_order=in_order, file_name=output.file_name,
                                    copied_from=_copied_from(plan, sources))
        max_shard_size = SAVE_PRETRAINED_SHARD_SIZE
    return plan_layout(specs, max_shard_size=max_shard_size, file_name=output.file_name,
                       copied_from=_copied_from(plan, sources))


def _copied_from(plan: Plan, sources: OpenSources) -> CopiedFrom:
    """``source:file`` and offset of an output (one of ``plan.outputs``) that is one source
    tensor's bytes unchanged, else None: the layout lines these up so that the writer can
    clone them. From headers only (not from where the files are), so a local and a Hub run
    of one plan write the same bytes. Asked a shard at a time: a table of every output's
    was ~150 bytes a tensor at the layout's peak."""
    names: dict[tuple[str, str], str] = {}  # one "source:file" string a file, not one a tensor

    def copied_from(o: Any) -> tuple[str, int] | None:
        found = o.recipe.unchanged_copy(sources) if o.dtype == o.input_dtype else None
        if found is None:
            return None
        name = names.get(found[:2])
        if name is None:
            name = names[found[:2]] = f"{found[0]}:{found[1]}"
        return name, found[2]
    return copied_from


@collector_paused()  # no cycle per tensor: see bulk_gc.py
def execute(plan: Plan, sources: OpenSources, out: str | Path, options: RunOptions | None = None,
            **settings: Any) -> ApplyResult:
    """Write the planned output to ``out`` with its audit log, reading through ``sources``
    (the checkpoints it was planned from, still open), as ``options`` (with ``settings``
    replacing some of them: ``execute(plan, sources, out, jobs=2)``) say; see
    ``ckptxform.apply``."""
    started = started_now()
    options = replace(options or RunOptions(), **settings)
    check_executor(options.executor)
    layout = layout_of(plan, sources)
    if options.progress is None:
        options = replace(options, progress=sys.stderr.isatty())
    refuse_overlap(out, _inputs_on_disk(plan, sources))
    digest = run_digest(plan)
    if os.path.lexists(out):
        refuse_foreign(Path(os.path.abspath(out)))
    identity = job_identity(layout, options.digest, digest)
    if not options.force and os.path.lexists(out):
        previous = _previous_run(plan, sources, digest, Path(out))
        if isinstance(previous, str):
            raise OutputError(f"{os.path.abspath(out)!r} already exists and {previous}; pass --force to "
                              "replace it", path=os.path.abspath(out))
        # a run killed after its rename left its lock file (or a killed --force run its
        # temporary sibling and job directory): this run writes nothing, but it tidies up after them
        own_job = JobDir(Path(out), identity, fsync=options.fsync).path
        return replace(previous, stale_removed=OutputDir(out).remove_stale(also=(own_job,)))
    _check_ties(plan, sources)
    return run_job(plan, sources, layout, Path(out), options, digest=digest, identity=identity, started=started)


def _inputs_on_disk(plan: Plan, sources: OpenSources) -> list[tuple[str, Path]]:
    """Everything local the run reads, as (what, resolved path): OUT must stay clear of it."""
    inputs = [(f"source {name!r}", path) for name, ckpt in sources.checkpoints.items() for path in ckpt.local_paths()]
    inputs += [(f"the file of vocabulary {name!r}", Path(pin.path)) for name, pin in plan.vocab_files.items()]
    return inputs + [("the rule file", Path(file).resolve()) for file in plan.rules.files]


def _previous_run(plan: Plan, sources: OpenSources, digest: RunDigest, out: Path) -> ApplyResult | str:
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
        changed = (copied_files_changed(plan.files, sources.checkpoints, events)
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


def _check_ties(plan: Plan, sources: OpenSources) -> None:
    """A tied tensor is dropped only when its bytes are the output's it is tied to (read
    a chunk at a time, before anything is written)."""
    for source, key, target, label in plan.ties:
        ckpt = sources.checkpoints[source]
        info = ckpt.tensors[key]
        out = plan.output(target)
        assert out is not None  # the planner checked the tie's target (output_checks.tie_problem)
        pos = 0
        for chunk in out.recipe.stream(sources):
            mine = ckpt.read(info, pos, len(chunk))
            if mine != bytes(chunk):
                first = next(i for i, (a, b) in enumerate(zip(mine, bytes(chunk))) if a != b)
                raise RequirementError(
                    f"{label}: tie: {source}:{key} differs from output {target!r} at byte {pos + first}; "
                    "tie only identical tensors (or write both, without tie)", key=key)
            pos += len(chunk)
