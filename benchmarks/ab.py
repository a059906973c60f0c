"""A/B of two ckptxform checkouts in one run: rename and headline against ``cp -r``.

    git worktree add /tmp/old 01500b5
    python benchmarks/ab.py /tmp/old .                    # 2 GB drafter, 7 repetitions
    python benchmarks/ab.py /tmp/old . --size 500MB --reps 3
    python benchmarks/ab.py /tmp/old . --scenario dequant --size 1GB --reps 3   # FP8, int4 and NVFP4 to bf16

Each command runs in its own process with ``PYTHONPATH`` set to one checkout and
``PYTHONSAFEPATH=1`` (without it, ``python -m`` puts the current directory first on the
path, and run from a checkout both A and B import that checkout: every A/B before
this fix that was run from the repository root compared B with B); before timing, each
checkout is checked to be the one its commands import,
alternating (the order reverses every repetition), after a ``sync``; ratios are medians
of per-repetition ratios against ``cp -r`` of the same repetition, as bench.py reports.
The dequant scenario (dequant_bench.py's sources and rules, ``--size`` of quantized
weights per format) times ``apply --no-fsync`` of each checkout against ``cp -r`` of the
bf16 output and reports GB/s of output, and the load average before and after.
"""

from __future__ import annotations

import argparse
import compileall
import functools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench import HEADLINE, RENAME_RULE  # noqa: E402
from harness import PY, measure, parse_size, warm  # noqa: E402
from synthetic import build_benchmark_sources  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", type=Path, help="checkout A (its ckptxform package is imported)")
    ap.add_argument("new", type=Path, help="checkout B")
    ap.add_argument("--size", default="2GB")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--scenario", choices=("rename", "dequant"), default="rename")
    ap.add_argument("--formats", default="fp8,int4,nvfp4", help="dequant scenario: the formats")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ckptxform-ab-"))
    if args.scenario == "dequant":
        try:
            for fmt in args.formats.split(","):
                dequant_ab(fmt, args, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    try:
        src = build_benchmark_sources(work / "src", parse_size(args.size))
        for path in src.values():
            warm(path)
        for checkout in (args.old, args.new):  # as pip install does: no contender compiles in its runs
            compileall.compile_dir(checkout / "ckptxform", quiet=1)
        rename = work / "rename.yaml"
        rename.write_text(RENAME_RULE)
        headline = [f"--source={name}={path}" for name, path in src.items()]

        def ckptxform(checkout: Path, *argv: str) -> list[str]:
            return [*_python(checkout.resolve()), "-m", "ckptxform", "-q", "apply", *argv, "--no-fsync"]

        commands = {"cp -r": lambda out: ["cp", "-r", str(src["drafter"]), str(out)]}
        for label, checkout in (("A", args.old), ("B", args.new)):
            commands[f"rename, {label}"] = lambda out, c=checkout: ckptxform(
                c, str(rename), f"--source=drafter={src['drafter']}", "--out", str(out))
            commands[f"rename --digest sha256, {label}"] = lambda out, c=checkout: ckptxform(
                c, str(rename), f"--source=drafter={src['drafter']}", "--out", str(out), "--digest", "sha256")
            commands[f"headline, {label}"] = lambda out, c=checkout: ckptxform(
                c, str(HEADLINE), *headline, "--out", str(out))
        print(f"A = {args.old}, B = {args.new}; {args.reps} repetitions, alternating")
        print("| contender | median (s) | best (s) | / cp -r |\n|---|---|---|---|")
        for name, times in alternated(commands, work / "out", args.reps).items():
            print(f"| {name} | {statistics.median(times):.2f} | {min(times):.2f} | {times.ratio:.2f} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


class Walls(list[float]):
    """One contender's walls, and the median of their ratios to ``cp -r``'s of the same repetition."""

    ratio = 0.0


def alternated(commands: dict[str, Callable[[Path], list[str]]], out: Path, reps: int) -> dict[str, Walls]:
    """Each command's walls, ``reps`` times, the order reversed every repetition."""
    walls = {name: Walls() for name in commands}
    for rep in range(reps):
        for name in (list(commands) if rep % 2 == 0 else list(reversed(commands))):
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run(["sync"], check=True)
            walls[name].append(measure(commands[name](out))[0])
    shutil.rmtree(out, ignore_errors=True)
    for times in walls.values():
        times.ratio = statistics.median(a / b for a, b in zip(times, walls["cp -r"]))
    return walls


def dequant_ab(fmt: str, args: argparse.Namespace, work: Path) -> None:
    """``apply --no-fsync`` of dequant_bench's ``fmt`` rule, A against B, and ``cp -r`` of the output."""
    from dequant_bench import RULES, build_source, output_bytes

    src = build_source(work / fmt, fmt, parse_size(args.size))
    warm(src)
    probe = work / "probe"
    subprocess.run([PY, "-m", "ckptxform", "-q", "apply", str(RULES[fmt]), f"--source=model={src}", "--out",
                    str(probe), "--no-fsync"], check=True, stdout=subprocess.DEVNULL, env=_env(args.new))
    written = output_bytes(probe)
    warm(probe)
    commands: dict[str, Callable[[Path], list[str]]] = {"cp -r": lambda out: ["cp", "-r", str(probe), str(out)]}
    # B with one process too: what --jobs (by default the cores here) adds
    for label, checkout, jobs in (("A", args.old, []), ("B", args.new, []), ("B --jobs 1", args.new, ["--jobs", "1"])):
        compileall.compile_dir(checkout / "ckptxform", quiet=1)  # no contender compiles in its first run
        commands[f"{fmt} apply --no-fsync, {label}"] = lambda out, c=checkout, j=jobs: [
            *_python(c.resolve()), "-m", "ckptxform", "-q", "apply", str(RULES[fmt]),
            f"--source=model={src}", "--out", str(out), "--no-fsync", *j]
    load = os.getloadavg()[0]
    walls = alternated(commands, work / "out", args.reps)
    print(f"{fmt}: {written / 1e9:.2f} GB of bf16 out; A = {args.old}, B = {args.new}; {args.reps} repetitions, "
          f"alternating; load average {load:.1f} before, {os.getloadavg()[0]:.1f} after")
    print("| contender | median (s) | best (s) | GB/s out (median) | / cp -r |\n|---|---|---|---|---|")
    for name, times in walls.items():
        print(f"| {name} | {statistics.median(times):.2f} | {min(times):.2f} | "
              f"{written / statistics.median(times) / 1e9:.2f} | {times.ratio:.2f} |")
    shutil.rmtree(probe)
    shutil.rmtree(work / fmt)


def _imports_from(checkout: Path) -> dict[str, str]:
    """The variables that make a Python import ckptxform from ``checkout`` (``PYTHONSAFEPATH``:
    not from the current directory, which ``python -m`` would put first)."""
    return {"PYTHONPATH": str(checkout.resolve()), "PYTHONSAFEPATH": "1"}


def _env(checkout: Path) -> dict[str, str]:
    return {**os.environ, **_imports_from(checkout)}


@functools.cache
def _python(checkout: Path) -> list[str]:
    """The interpreter, importing ckptxform from ``checkout`` and nowhere else (checked)."""
    argv = ["env", *(f"{name}={value}" for name, value in _imports_from(checkout).items()), PY]
    where = subprocess.run([*argv, "-c", "import ckptxform; print(ckptxform.__file__)"], check=True,
                           capture_output=True, text=True).stdout.strip()
    if not Path(where).resolve().is_relative_to(checkout.resolve()):
        sys.exit(f"ab.py: {checkout} would import ckptxform from {where}, not from itself")
    return argv


if __name__ == "__main__":
    main()
