"""What every benchmark script shares: running a command for its wall time and peak RSS,
alternating contenders, per-repetition ratios, sizes. A leaf: the scenario scripts
(bench.py and the ``*_bench.py`` beside it) import it by bare name, it imports none of them.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PY = sys.executable


@dataclass
class Result:
    name: str
    walls: list[float]
    rss: list[int]

    @property
    def wall(self) -> float:
        return statistics.median(self.walls)

    @property
    def best(self) -> float:
        return min(self.walls)

    @property
    def peak_mb(self) -> float:
        return max(self.rss) / 1024


def paired_ratio(a: Result, b: Result) -> float:
    """The median over repetitions of a's time / b's time in the same repetition: on a
    shared machine whose speed drifts, runs measured minutes apart compare nothing."""
    return statistics.median(x / y for x, y in zip(a.walls, b.walls, strict=True))


def measure(argv: list[str], ok: tuple[int, ...] = (0,)) -> tuple[float, int]:
    """Wall seconds and peak RSS (KiB) of one command, which must exit with a code of
    ``ok``. GNU time reports the RSS: a child forked from this Python process would count
    the parent's pages as its own."""
    with tempfile.NamedTemporaryFile("r") as rss_file:
        start = time.perf_counter()
        proc = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", rss_file.name, *argv],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wall = time.perf_counter() - start
        if proc.returncode not in ok:
            raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.decode()}")
        return wall, int(rss_file.read().split()[-1])


def warm(path: Path) -> None:
    for f in sorted(path.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass


def compile_ckptxform() -> None:
    """Write ckptxform's bytecode (the contenders' libraries, from pip, already have theirs)."""
    import compileall
    import importlib.util

    spec = importlib.util.find_spec("ckptxform")
    assert spec is not None and spec.submodule_search_locations
    for location in spec.submodule_search_locations:
        compileall.compile_dir(location, quiet=1)


def parse_size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    for unit, factor in units.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def run_contenders(contenders: dict[str, Callable[[Path], list[str]]], work: Path, reps: int,
                   ok: tuple[int, ...] = (0,), settle: float = 0.0) -> dict[str, Result]:
    """``settle``: seconds to wait after removing the last output, before each run. A vm
    with free page reporting hands freed memory back to its host about 2 s after it is
    freed, and a writer that gets such pages pays the host's fault on each: with no wait,
    a command shorter than that delay writes into pages that were never handed back and
    a longer one mostly into pages that were (benchmarks/README.md, "seventh pass")."""
    results = {name: Result(name, [], []) for name in contenders}
    for rep in range(reps):
        order = list(contenders) if rep % 2 == 0 else list(reversed(contenders))
        for name in order:
            out = work / f"out-{name.replace(' ', '_')}"
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run(["sync"], check=True)
            time.sleep(settle)
            wall, rss = measure(contenders[name](out), ok)
            results[name].walls.append(wall)
            results[name].rss.append(rss)
            shutil.rmtree(out, ignore_errors=True)
    return results
