"""A/B of two ckptxform checkouts in one run: rename and headline against ``cp -r``.

    git worktree add /tmp/old 01500b5
    python benchmarks/ab.py /tmp/old .                    # 2 GB drafter, 7 repetitions
    python benchmarks/ab.py /tmp/old . --size 500MB --reps 3

Each command runs in its own process with ``PYTHONPATH`` set to one checkout,
alternating (the order reverses every repetition), after a ``sync``; ratios are medians
of per-repetition ratios against ``cp -r`` of the same repetition, as bench.py reports.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench import HEADLINE, PY, RENAME_RULE, measure, parse_size, warm  # noqa: E402
from synthetic import build_benchmark_sources  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", type=Path, help="checkout A (its ckptxform package is imported)")
    ap.add_argument("new", type=Path, help="checkout B")
    ap.add_argument("--size", default="2GB")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ckptxform-ab-"))
    try:
        src = build_benchmark_sources(work / "src", parse_size(args.size))
        for path in src.values():
            warm(path)
        rename = work / "rename.yaml"
        rename.write_text(RENAME_RULE)
        headline = [f"--source={name}={path}" for name, path in src.items()]

        def ckptxform(checkout: Path, *argv: str) -> list[str]:
            return ["env", f"PYTHONPATH={checkout.resolve()}", PY, "-m", "ckptxform", "-q", "apply", *argv, "--no-fsync"]

        commands = {"cp -r": lambda out: ["cp", "-r", str(src["drafter"]), str(out)]}
        for label, checkout in (("A", args.old), ("B", args.new)):
            commands[f"rename, {label}"] = lambda out, c=checkout: ckptxform(
                c, str(rename), f"--source=drafter={src['drafter']}", "--out", str(out))
            commands[f"rename --digest sha256, {label}"] = lambda out, c=checkout: ckptxform(
                c, str(rename), f"--source=drafter={src['drafter']}", "--out", str(out), "--digest", "sha256")
            commands[f"headline, {label}"] = lambda out, c=checkout: ckptxform(
                c, str(HEADLINE), *headline, "--out", str(out))
        walls: dict[str, list[float]] = {name: [] for name in commands}
        out = work / "out"
        for rep in range(args.reps):
            for name in (list(commands) if rep % 2 == 0 else list(reversed(commands))):
                shutil.rmtree(out, ignore_errors=True)
                subprocess.run(["sync"], check=True)
                walls[name].append(measure(commands[name](out))[0])
        print(f"A = {args.old}, B = {args.new}; {args.reps} repetitions, alternating")
        print("| contender | median (s) | best (s) | / cp -r |\n|---|---|---|---|")
        for name, times in walls.items():
            ratio = statistics.median(a / b for a, b in zip(times, walls["cp -r"]))
            print(f"| {name} | {statistics.median(times):.2f} | {min(times):.2f} | {ratio:.2f} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
