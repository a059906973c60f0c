"""A shard task's slice of the plan, and the sources a worker opens to execute it.

The parent plans once and saves the ``RunPlan`` of its tasks in the job directory
(JSON through ``CODEC``, which admits only the classes listed: a tampered file cannot run
code), one file a shard, made and written one shard at a time: the shard's layout with
the output plans of its tensors (their recipes: byte and block programs, ops named by
verb) and every source tensor they read as the parent's header described it; and one
file for all, naming those: the vocabulary maps, the local files' pins and the Hub
files' ETags. Tasks of the parent's own process take their shard's slice made from the
plan when they ask for it (nothing is written). A worker opens the pinned sources itself
(``open_pinned``: a local path, a Hub repo at the run's commit) and refuses, naming the
file, a source that cannot be opened or that changed since the run planned: it never
plans again, so it needs no rule file and imports no planner.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import ChainMap
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

from ...errors import OutputError, SourceChangedError
from ...ops import OPS
from ...ops.base import Block, Run, View
from ...ops.rows import FILL_ROWS
from ...sources.base import Checkpoint, TensorInfo
from ...sources.pins import FilePin, changed_error
from ...vocab.maps import VocabMap
from ...where import Where
from ..output.jobdir import JobDir
from ..plan.codec import Codec
from ..plan.layout import MadeHeader, OutputTensorSpec, ShardLayout
from ..plan.opened import OpenSources
from ..plan.planner import Plan
from ..plan.recipes import (
    BlockProgram,
    ByteProgram,
    Constant,
    CopyTensor,
    OutputPlan,
    RowAccount,
    RowsOrigin,
    Sources,
    TensorRef,
    VocabField,
)


@dataclass(frozen=True)
class PinnedSource:
    """How a worker opens one source of the run: a local ``location``, or Hub ``repo`` at ``commit``."""

    name: str
    location: str
    repo: str | None = None
    #: the revision the run was given (a branch, a tag) and the commit it resolved to
    revision: str | None = None
    commit: str | None = None
    policy: str = "auto"

    @classmethod
    def of(cls, name: str, ckpt: Checkpoint) -> PinnedSource:
        if ckpt.commit is None:
            return cls(name, ckpt.location)
        # a Hub source (the only kind with a commit, a HubCheckpoint): reopened at the commit the run resolved
        return cls(name, ckpt.location, repo=ckpt.repo_id,  # type: ignore[attr-defined]
                   revision=ckpt.revision, commit=ckpt.commit,
                   policy=ckpt.policy)  # type: ignore[attr-defined]

    def open(self) -> Checkpoint:
        if self.commit is None:
            from ...sources.resolve import open_location

            return open_location(self.location, name=self.name)
        from ...sources.hub.checkpoint import open_hub

        assert self.repo is not None
        ckpt = open_hub(self.repo, self.commit, name=self.name, policy=self.policy, location=self.location)
        ckpt.revision = self.revision  # messages and records name the revision as the run does
        return ckpt


@dataclass(frozen=True)
class ShardPlan:
    """What one shard task executes: the shard's layout, whose tensors are its outputs
    (the plan's ``OutputPlan``s), and what they read."""

    shard: ShardLayout
    #: (source, key) -> the tensor as the run's plan read its header
    reads: Mapping[tuple[str, str], TensorInfo]

    @property
    def outputs(self) -> tuple[OutputPlan, ...]:
        """The shard's outputs in data order (made on each call)."""
        return cast("tuple[OutputPlan, ...]", self.shard.specs)


@dataclass(frozen=True)
class RunPlan:
    """The shard plans of a run's tasks (by file: each made, or read from the job
    directory, when asked for, so that one shard's is held at a time) and what they
    share: how to open the sources, the vocabulary maps, the pins and ETags the run read."""

    shards: Mapping[str, ShardPlan]
    sources: Mapping[str, PinnedSource]
    #: every vocabulary map of the plan (a recipe names the one it streams)
    vocab_maps: Mapping[str, VocabMap] = field(default_factory=dict)
    #: the local files the run had read when it planned (source -> pins)
    pins: Mapping[str, tuple[FilePin, ...]] = field(default_factory=dict)
    #: source -> file -> ETag of the first bytes the run was served of it (Hub sources)
    etags: Mapping[str, Mapping[str, str]] = field(default_factory=dict)


def slice_plan(plan: Plan, sources: Sources, shards: list[ShardLayout],
               etags: Mapping[str, Mapping[str, str]], *, for_workers: bool = True) -> RunPlan:
    """The part of ``plan`` that writes ``shards`` (``sources``: the checkpoints it was
    planned from), each shard's made when asked for (``_SlicedShards``). Not
    ``for_workers``: only the shards and their outputs, for tasks that read through
    ``sources`` themselves (what a worker opens and checks, ~150 bytes a tensor read, is
    left out); ``for_workers``, the sources they read are found by a walk of the shards'
    outputs, one shard at a time."""
    works = _SlicedShards(plan, sources, shards, for_workers)
    names = sorted({source for shard in shards for out in works.outputs_of(shard)
                    for source, _ in _refs(out, sources)}) if for_workers else []
    return RunPlan(shards=works, sources={n: PinnedSource.of(n, sources.checkpoints[n]) for n in names},
                   vocab_maps=plan.vocab_maps, pins={n: sources.checkpoints[n].pins() for n in names},
                   etags={n: etags[n] for n in names if n in etags})


def _refs(out: OutputPlan, sources: Sources) -> list[tuple[str, str]]:
    """(source, key) of every tensor ``out`` reads."""
    refs = [(ref.source, ref.key) for ref in out.recipe.inputs]
    return refs + [(source, key) for source, key, _ in out.recipe.prefetch_reads(sources)]


class _SlicedShards(Mapping[str, ShardPlan]):
    """File -> the ``ShardPlan`` of that shard of ``plan``, made when asked for: a shard laid
    out over the plan's outputs takes them as they are; a layout of copies of their specs
    (GGUF's) gets the outputs by key. For workers, a shard holds its own outputs and its
    header bytes, and what they read."""

    def __init__(self, plan: Plan, sources: Sources, shards: list[ShardLayout], for_workers: bool) -> None:
        self._plan, self._sources, self._for_workers = plan, sources, for_workers
        self._shards = {shard.file: shard for shard in shards}

    def __getitem__(self, file: str) -> ShardPlan:
        shard = self._shards[file]
        outputs = self.outputs_of(shard)
        if not self._for_workers:
            return ShardPlan(shard if shard.items is self._plan.outputs else shard.standalone(outputs), {})
        reads: dict[tuple[str, str], TensorInfo] = {}
        for out in outputs:
            for source, key in _refs(out, self._sources):
                reads[(source, key)] = self._sources.checkpoints[source].tensors[key]
        return ShardPlan(shard.standalone(outputs), reads)

    def outputs_of(self, shard: ShardLayout) -> tuple[OutputPlan, ...]:
        specs = shard.specs
        if shard.items is self._plan.outputs or all(type(spec) is OutputPlan for spec in specs):
            return cast("tuple[OutputPlan, ...]", specs)
        found = tuple(self._plan.output(spec.key) for spec in specs)  # a layout of copies (GGUF's: one shard)
        assert all(found), "a layout names an output the plan does not have"
        return cast("tuple[OutputPlan, ...]", found)

    def __iter__(self) -> Iterator[str]:
        return iter(self._shards)

    def __len__(self) -> int:
        return len(self._shards)


def open_pinned(run: RunPlan, work: ShardPlan, opened: dict[str, Checkpoint]) -> OpenSources:
    """The sources ``work`` reads, opened (or taken from ``opened``, this worker's earlier
    ones, which it extends) and checked to be what the run planned against."""
    names = sorted({source for source, _ in work.reads})
    for name in names:
        if name not in opened:
            ckpt = opened[name] = run.sources[name].open()
            ckpt.expect_etags(run.etags.get(name, {}))
    checkpoints = {name: opened[name] for name in names}
    for (source, key), then in work.reads.items():
        now = checkpoints[source].tensors.get(key)
        if now != then:
            what = "no longer has it" if now is None else f"now describes it as {_header(now)}"
            raise SourceChangedError(
                f"source {source!r} changed since the run planned: tensor {key!r} of {then.file!r} was "
                f"{_header(then)}, the file {what}; rerun the command", path=then.file, source=source)
    for source in names:
        mine = {pin.path: pin for pin in checkpoints[source].pins()}
        for pin in run.pins.get(source, ()):
            moved = pin.difference(mine[pin.path]) if pin.path in mine else None
            if moved is not None:
                raise changed_error(pin.path, moved)
    return OpenSources(checkpoints, dict(run.vocab_maps))


def _header(info: TensorInfo) -> str:
    return f"{info.dtype} {list(info.shape)} at byte {info.offset}"


#: what a run plan holds, and nothing else decodes from a job's plan file
CODEC = Codec([RunPlan, ShardPlan, PinnedSource, TensorInfo, VocabMap, FilePin, ShardLayout, MadeHeader,
               OutputTensorSpec, OutputPlan, CopyTensor, ByteProgram, BlockProgram, RowsOrigin, RowAccount,
               VocabField, TensorRef, View, Run, Block, Where, Constant],
              ChainMap({FILL_ROWS.verb: FILL_ROWS}, OPS))  # fill_rows: made by permute_rows, not a verb of ops:


def keep_run_plan(job: JobDir, run: RunPlan) -> str:
    """Hold ``run`` for this process's own tasks (``load_run_plan``) without writing it:
    the name a saved plan would have. Encoding a run of 200,000 tensors cost ~6 s and
    ~60 MB at once, for tasks that take it as it is; ``forget_run_plans`` frees it."""
    name = _plan_name()
    _LOADED.clear()
    _IN_MEMORY.clear()
    _IN_MEMORY[str(job.path / name)] = run
    return name


def forget_run_plans() -> None:
    """Free the run plans this process holds (its tasks have run): a run's commit and
    audit need none of it, and it is ~150 bytes a tensor."""
    _LOADED.clear()
    _IN_MEMORY.clear()


def _plan_name() -> str:
    return f"plan-{os.uname().nodename}-{os.getpid()}.json"


def save_run_plan(job: JobDir, run: RunPlan) -> str:
    """Write ``run`` into ``job``'s directory, where its tasks read it (``load_run_plan``);
    the file's name. Each shard's plan is its own file, made, encoded (a tensor at a
    time) and written one shard at a time, and the run's file names them: a worker reads
    only its task's. One set of files per run: the ranks of ``--shard-of`` share the
    directory."""
    name = _plan_name()
    files = {}
    for number, (file, work) in enumerate(run.shards.items(), 1):
        files[file] = shard_name = f"{name.removesuffix('.json')}-shard-{number:05d}.json"
        body = CODEC.iter_json(work, (ShardPlan, ShardLayout))
        job.write_pieces(shard_name, _pieces('{"format": 2, "shard": ', body, "}"))
    path = job.write_json(name, {"format": 2, "plan": CODEC.encode(replace(run, shards={})), "shards": files})
    # this process's tasks take ``run`` as it is: decoding what was just encoded cost a
    # sixth of a many-tensor rename (other processes, Ray's and --shard-of's, decode)
    forget_run_plans()
    with contextlib.suppress(OSError):
        _LOADED[_file_key(path)] = run
    return name


def _pieces(head: str, body: Iterator[str], tail: str) -> Iterator[str]:
    yield head
    yield from body
    yield tail


def _file_key(path: Path) -> tuple[str, int, int, int, int]:
    stat = path.stat()
    return (str(path), stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


def load_run_plan(job: JobDir, name: str) -> RunPlan:
    """The run plan saved as ``name`` in ``job`` (decoded once per process and file), its
    shards' plans read when asked for."""
    path = job.path / name
    if str(path) in _IN_MEMORY:
        return _IN_MEMORY[str(path)]
    try:
        key = _file_key(path)
        text = path.read_bytes() if key not in _LOADED else b""
    except OSError as err:
        raise _unreadable(path, err) from None
    if key not in _LOADED:
        data = _read_json(path, text)
        files = data.get("shards") if isinstance(data, dict) and data.get("format") == 2 else None
        run = CODEC.decode(data.get("plan") if files is not None else data, str(path))
        if not isinstance(run, RunPlan) or not isinstance(files, dict) \
                or not all(isinstance(v, str) and "/" not in v for v in files.values()):
            raise OutputError(f"{path}: holds no run plan; remove it and rerun", path=str(path))
        _LOADED.clear()  # one run at a time per process
        _LOADED[key] = replace(run, shards=_SavedShards(job.path, files))
    return _LOADED[key]


class _SavedShards(Mapping[str, ShardPlan]):
    """File -> the ``ShardPlan`` saved for it in the job directory, read when asked for
    (the last one kept: a task asks for its own more than once)."""

    def __init__(self, directory: Path, files: dict[str, str]) -> None:
        self._directory, self._files = directory, files
        self._last: tuple[str, ShardPlan] | None = None

    def __getitem__(self, file: str) -> ShardPlan:
        if self._last is not None and self._last[0] == file:
            return self._last[1]
        path = self._directory / self._files[file]
        try:
            text = path.read_bytes()
        except OSError as err:
            raise _unreadable(path, err) from None
        data = _read_json(path, text)
        work = CODEC.decode(data.get("shard") if isinstance(data, dict) and data.get("format") == 2 else data,
                            str(path))
        if not isinstance(work, ShardPlan):
            raise OutputError(f"{path}: holds no shard's plan; remove it and rerun", path=str(path))
        self._last = (file, work)
        return work

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def _read_json(path: Path, text: bytes) -> Any:
    try:
        return json.loads(text)
    except ValueError as err:
        raise OutputError(f"{path}: not valid JSON ({err}); remove it and rerun", path=str(path)) from None


def _unreadable(path: Path, err: OSError) -> OutputError:
    return OutputError(f"cannot read the run's plan {str(path)!r}: {err.strerror or err} (the job directory "
                       "must be on a filesystem every worker shares)", path=str(path))


_LOADED: dict[tuple[str, int, int, int, int], RunPlan] = {}
#: path a saved plan would have -> the run plan of this process's own tasks, never written
_IN_MEMORY: dict[str, RunPlan] = {}
