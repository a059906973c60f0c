"""The Python API: ``plan`` and ``apply`` (what the CLI calls)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from .engine.plan.opened import OpenSources
from .engine.plan.planner import Plan, build_plan, needed_sources
from .engine.run.execute import ApplyResult, execute, layout_of
from .engine.run.options import RunOptions
from .errors import PlanError
from .log import logger
from .rules.loader import load_rules
from .rules.model import RuleSet
from .sources.base import Checkpoint
from .sources.resolve import open_sources
from .tensor_digest import DEFAULT_DIGEST


def plan(rules: str | os.PathLike[str] | RuleSet, *, sources: Mapping[str, str] | None = None,
         require_pinned: bool = False) -> Plan:
    """Plan a conversion from headers, the rule file and the vocab maps; no weight is read.

    ``require_pinned`` refuses a Hub source whose revision is a branch or tag (a
    ``UsageError`` giving the commit it resolved to) instead of warning.

    >>> p = plan("rules/aqmedai_k2_to_k25.yaml", sources={"drafter": "stand-ins/k2"})  # doctest: +SKIP
    >>> p.alignments["k2->k25"].summary()                                             # doctest: +SKIP
    '...positions agree; ... tokens shared; ...'

    The Plan is a value: the sources it was planned from are closed when it returns (use
    ``plan_open`` to keep them open for ``execute``).
    """
    the_plan, opened = plan_open(rules, sources=sources, require_pinned=require_pinned)
    with _closed_on_error(the_plan), opened:  # the files apply would write, laid out as apply does (headers only)
        layout = layout_of(the_plan, opened)
    the_plan.output_files = tuple((shard.file, shard.file_nbytes) for shard in layout.shards)
    return the_plan


def plan_open(rules: str | os.PathLike[str] | RuleSet, *, sources: Mapping[str, str] | None = None,
              require_pinned: bool = False) -> tuple[Plan, OpenSources]:
    """``plan``, and the sources it opened, left open for the caller to read through and
    close (``with opened: execute(the_plan, opened, out)``)."""
    ruleset = rules if isinstance(rules, RuleSet) else load_rules(rules)
    if sources:
        ruleset = ruleset.with_sources(dict(sources))
    opened: dict[str, Checkpoint] = {}
    try:
        opened = open_sources([ruleset.sources[name] for name in needed_sources(ruleset)],
                              require_pinned=require_pinned)
        named_in_config = set(re.findall(r"\$\{source\.([^.}]+)\.", repr(ruleset.config)))
        unused = [n for n in ruleset.sources if n not in opened and n not in named_in_config]
        for name in unused:
            logger.warning("source {!r} is declared but no rule reads it; it was not opened", name)
        the_plan = build_plan(ruleset, opened)
        return the_plan, OpenSources(dict(opened), the_plan.vocab_maps)
    except BaseException:
        for ckpt in opened.values():
            ckpt.close()
        raise


def apply(rules: str | os.PathLike[str] | RuleSet, *, out: str | os.PathLike[str],
          sources: Mapping[str, str] | None = None, options: RunOptions | None = None,
          **settings: Any) -> ApplyResult:
    """Plan, then write the converted checkpoint and its audit log to ``out``.

    How is one ``RunOptions`` (engine/run/options.py): pass ``options=``, or its fields as
    keywords (they replace those of ``options``):

    Every assertion is checked before any weight byte is read; the output directory
    appears whole or not at all; an existing ``out`` is replaced only with ``force``, and
    only when it is an earlier output of ckptxform; an ``out`` overlapping a source, a
    vocab file or the rule file is refused.
    ``fsync=False`` skips flushing to disk before the final rename: a killed process still
    leaves OUT whole or absent, a power loss may not. ``progress``: a progress bar on
    stderr (None: when stderr is a terminal, as the CLI does); a library call is silent
    by default, log messages included (enable them with ``logger.enable("ckptxform")``).
    ``require_pinned`` refuses a Hub source whose revision is a branch or tag.
    ``result.out`` and ``result.audit_path`` are absolute.
    ``hash_inputs=True`` also hashes every input over 64 MiB whole at the end, so that a
    rerun can tell such a file, touched or copied without its times, from one rewritten
    with other values in the same layout (without it such a rerun writes OUT again).
    ``digest`` is the hash the audit records for every written tensor: ``"blake3"``
    (default, ~5x faster), ``"sha256"``, or ``"none"`` (no byte read back: the audit holds
    byte ranges, ``verify`` checks structure and sizes only).
    ``jobs`` output shards are written at once, each in its own worker process (default:
    the cores, bounded by memory and by the shards; 1: all in this process); the output
    is the same for any ``jobs``. A run that fails or is killed keeps its finished shards
    beside ``out``, and the next run of the same plan keeps them (``resume=False``
    starts over). ``executor="ray"`` runs the shards on the Ray cluster at
    ``ray_address`` (or ``RAY_ADDRESS``; neither: a local Ray instance), whose nodes
    share the source and output paths. ``shard_of=(rank, world)`` writes only the
    shards of that rank and leaves ``out`` to ``finalize``. Workers never plan: each
    task carries its slice of this plan.
    The plan's warnings (a quantize op's doubtful pattern, say) are logged; ``strict=True`` makes
    the first of them a ``PlanError`` before anything is written.

    >>> result = apply("rules/aqmedai_k2_to_k25.yaml", out="k25-drafter",
    ...                sources={"drafter": "k2", "target_vocab": "k25", "verifier": "v"})  # doctest: +SKIP
    >>> result.audit_path                                                               # doctest: +SKIP
    PosixPath('/home/me/k25-drafter/ckptxform_audit.jsonl')
    """
    options = replace(options or RunOptions(), **settings)
    the_plan, opened = plan_open(rules, sources=sources, require_pinned=options.require_pinned)
    with _closed_on_error(the_plan), opened:  # else the result holds it (result.plan)
        _say_warnings(the_plan, options.strict)
        result = execute(the_plan, opened, Path(out), options)
    return replace(result, out=Path(os.path.abspath(result.out)),
                   audit_path=Path(os.path.abspath(result.audit_path)))


@contextmanager
def _closed_on_error(the_plan: Plan) -> Iterator[None]:
    """Close ``the_plan`` (its store, engine/plan/plan_store.py) when the block fails; a plan
    returned stays open until closed or no longer referenced."""
    try:
        yield
    except BaseException:
        the_plan.close()
        raise


def _say_warnings(the_plan: Plan, strict: bool) -> None:
    if strict and the_plan.warnings:
        more = len(the_plan.warnings) - 1
        raise PlanError(f"{the_plan.warnings[0]}" + (f" (and {more} more warning{'s' if more > 1 else ''})" if more else "")
                        + "; --strict makes a warning an error: fix the rule, or run without --strict")
    for warning in the_plan.warnings:
        logger.warning("{}", warning)


def finalize(rules: str | os.PathLike[str] | RuleSet, *, out: str | os.PathLike[str],
             sources: Mapping[str, str] | None = None, force: bool = False, fsync: bool = True,
             digest: str = DEFAULT_DIGEST) -> ApplyResult:
    """Commit ``out`` from the shards every ``apply(..., shard_of=(rank, world))`` wrote:
    the same plan (rules, sources, ``digest``); writes no shard and refuses, naming them,
    while some are not finished.

    >>> finalize("rules/big.yaml", out="big-out")   # doctest: +SKIP
    """
    options = RunOptions(force=force, fsync=fsync, digest=digest, finalize=True)
    the_plan, opened = plan_open(rules, sources=sources)
    with _closed_on_error(the_plan), opened:
        result = execute(the_plan, opened, Path(out), options)
    return replace(result, out=Path(os.path.abspath(result.out)),
                   audit_path=Path(os.path.abspath(result.audit_path)))
