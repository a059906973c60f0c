"""``ckptxform demo``: the headline conversion on small stand-ins, offline, in seconds;
``ckptxform demo RULE``: stand-ins of any shipped rule's sources and the command converting them
(``--run``: converted, too).

Builds stand-ins of the three headline sources (the Kimi-K2 drafter, a Kimi-K2.5 drafter
for its vocabulary, the sharded Kimi-K2.5 verifier; real key names and layouts, small
dimensions, different draft vocabularies), then runs the shipped
``rules/aqmedai_k2_to_k25.yaml`` on them through ``--source`` overrides.
"""

from __future__ import annotations

import os
import shlex
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from .. import api
from .._data import data_dir
from ..engine.run.execute import ApplyResult
from ..engine.plan.planner import Plan
from ..errors import OutputError, UsageError


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
    from ..standins import build_headline_standins

    root = Path(os.path.abspath(out) if out is not None else tempfile.mkdtemp(prefix="ckptxform-demo-"))
    made = (root,) if not root.exists() or not any(root.iterdir()) else (root / "sources", root / "converted")
    converted = root / "converted"
    if converted.exists() and not force:
        raise OutputError(f"{str(converted)!r} already exists from an earlier demo; pass --force to "
                          "replace it or choose another --out", path=str(converted))
    standins = build_headline_standins(root / "sources")
    rules = data_dir("rules") / f"{RULE_NAME}.yaml"
    plan = api.plan(rules, sources=standins.sources)
    result = api.apply(rules, out=converted, sources=standins.sources, force=force, progress=False)
    return DemoResult(root, standins.sources, rules, RULE_NAME, plan, result, made)


@dataclass(frozen=True)
class RuleDemo:
    """Stand-ins of one shipped rule's sources, and where its ``apply`` is to write."""

    root: Path
    rule_name: str
    sources: dict[str, str]
    converted: Path
    made: tuple[Path, ...]
    #: the conversion ``demo RULE --run`` ran (None: only the stand-ins were built)
    result: ApplyResult | None = None

    def apply_command(self, *, force: bool = False) -> str:
        """The command converting the stand-ins, ready to paste (quoted for a POSIX shell)."""
        overrides = " ".join(f"--source {shlex.quote(f'{n}={loc}')}" for n, loc in self.sources.items())
        return (f"ckptxform apply {self.rule_name} {overrides} --out {shlex.quote(str(self.converted))}"
                + (" --force" if force else ""))


def build_rule_demo(rule: str, out: str | Path | None = None, *, force: bool = False,
                    run: bool = False) -> RuleDemo:
    """Stand-ins of the sources of the shipped rule ``rule`` (file stem or name) under
    ``out/sources`` (default: a new temporary directory); converted into ``out/converted``
    when ``run`` (``demo RULE --run``), else left for the command the demo prints."""
    from ..rules.library import shipped_rule_path
    from ..standins.for_rules import STANDINS

    path = shipped_rule_path(rule)
    standin = STANDINS.get(path.stem) if path is not None else None
    if path is None or standin is None:
        raise UsageError(f"demo {rule!r}: no shipped rule of that file stem or name has stand-ins "
                         f"(these do: {', '.join(sorted(STANDINS))}; `ckptxform rules` describes them)")
    root = Path(os.path.abspath(out) if out is not None else tempfile.mkdtemp(prefix=f"ckptxform-demo-{path.stem}-"))
    made = (root,) if not root.exists() or not any(root.iterdir()) else (root / "sources", root / "converted")
    sources = root / "sources"
    if sources.exists():
        if not force:
            raise OutputError(f"{str(sources)!r} already exists from an earlier demo; pass --force to "
                              "rebuild it or choose another --out", path=str(sources))
        shutil.rmtree(sources)
    built = RuleDemo(root, path.stem, standin.build(sources), root / "converted", made)
    if not run:
        return built
    result = api.apply(path, out=built.converted, sources=built.sources, force=force, progress=False)
    return replace(built, result=result)
