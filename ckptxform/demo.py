"""``ckptxform demo``: the headline conversion on small stand-ins, offline, in seconds.

Builds stand-ins of the three headline sources (the Kimi-K2 drafter, a Kimi-K2.5 drafter
for its vocabulary, the sharded Kimi-K2.5 verifier; real key names and layouts, small
dimensions, different draft vocabularies), then runs the shipped
``rules/aqmedai_k2_to_k25.yaml`` on them through ``--source`` overrides.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import api
from ._data import data_dir
from .engine.run.execute import ApplyResult
from .engine.plan.planner import Plan
from .errors import OutputError


#: the shipped rule the demo runs, by the name a user types
RULE_NAME = "aqmedai_k2_to_k25"


@dataclass(frozen=True)
class DemoResult:
    #: absolute: the demo prints commands that must run from any directory
    root: Path
    sources: dict[str, str]
    rules: Path
    rule_name: str
    plan: Plan
    result: ApplyResult
    #: what the demo created: ``root`` itself, or inside a directory that held files before
    #: only its ``sources`` and ``converted`` (the only paths it tells the user to remove)
    made: tuple[Path, ...]


def run_demo(out: str | Path | None = None, *, force: bool = False) -> DemoResult:
    """Build the stand-ins under ``out`` (default: a new temporary directory) and convert them."""
    from .standins import build_headline_standins

    root = Path(os.path.abspath(out) if out is not None else tempfile.mkdtemp(prefix="ckptxform-demo-"))
    made = (root,) if not root.exists() or not any(root.iterdir()) else (root / "sources", root / "converted")
    converted = root / "converted"
    if converted.exists() and not force:
        raise OutputError(f"{str(converted)!r} already exists from an earlier demo; pass --force to "
                          "replace it or choose another --out", path=str(converted))
    standins = build_headline_standins(root / "sources")
    rules = data_dir("rules") / f"{RULE_NAME}.yaml"
    with api.plan(rules, sources=standins.sources) as plan:
        pass
    result = api.apply(rules, out=converted, sources=standins.sources, force=force, progress=False)
    return DemoResult(root, standins.sources, rules, RULE_NAME, plan, result, made)
