"""``ckptxform demo``: the headline conversion on small stand-ins, offline, in seconds.

Builds stand-ins of the three headline sources (the Kimi-K2 drafter, a Kimi-K2.5 drafter
for its vocabulary, the sharded Kimi-K2.5 verifier; real key names and layouts, small
dimensions, different draft vocabularies), then runs the shipped
``rules/aqmedai_k2_to_k25.yaml`` on them through ``--source`` overrides.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import api
from ._data import data_dir
from .engine.execute import ApplyResult
from .engine.planner import Plan
from .errors import OutputError


@dataclass(frozen=True)
class DemoResult:
    root: Path
    sources: dict[str, str]
    rules: Path
    plan: Plan
    result: ApplyResult


def run_demo(out: str | Path | None = None, *, force: bool = False) -> DemoResult:
    """Build the stand-ins under ``out`` (default: a new temporary directory) and convert them."""
    from .standins import build_headline_standins

    root = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="ckptxform-demo-"))
    converted = root / "converted"
    if converted.exists() and not force:
        raise OutputError(f"{str(converted)!r} already exists from an earlier demo; pass --force to "
                          "replace it or choose another --out", path=str(converted))
    standins = build_headline_standins(root / "sources")
    rules = data_dir("rules") / "aqmedai_k2_to_k25.yaml"
    plan = api.plan(rules, sources=standins.sources)
    plan.close()
    result = api.apply(rules, out=converted, sources=standins.sources, force=force, progress=False)
    return DemoResult(root, standins.sources, rules, plan, result)
