"""Zero-copy benchmark: a rename-only conversion on a loop-mounted XFS (reflink=1) or btrfs
image against ``cp -r --reflink=never`` (and ``--reflink=always``), wall time and the
filesystem's used-space growth, one run, alternating.

    python benchmarks/zero_copy_bench.py --fs xfs --size 8GB --reps 3 --dir /work/tmp

Needs root, a loop device and mkfs.xfs / mkfs.btrfs. The image is a sparse file in
``--dir`` (it grows by about twice ``--size`` on that disk) and is removed at the end.
The source: shards of 2 GiB (64 MiB bf16 tensors), as a hub checkpoint is sharded; the rule
renames every tensor and keeps the same shard size, so each output shard holds one source
shard's tensors. ``--cold`` evicts the source and image from the page cache before every
run (posix_fadvise on the files only), so the read-back hash of a clone reads the disk.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import compile_ckptxform, parse_size  # noqa: E402
from synthetic import Tensor, write_sharded  # noqa: E402

PY = sys.executable
SHARD = 2 << 30
TENSOR = 64 << 20
RULE = """version: 1
name: rename-only
sources: {src: {path: unused}}
convert: src
output: {max_shard_size: %d}
tensors:
  - match: 'layers\\.(.+)'
    rename: 'model.layers.\\1'
  - match: '.*'
""" % SHARD
MKFS = {"xfs": ["mkfs.xfs", "-q", "-f", "-m", "reflink=1"], "btrfs": ["mkfs.btrfs", "-q", "-f"]}


def used(path: Path) -> int:
    """The filesystem's used bytes once it has settled: XFS and btrfs free a removed file's
    blocks in the background, so one reading right after ``rm`` can still hold them (or
    drop them during the next run, which then seems to shrink the disk)."""
    last = -1
    for _ in range(50):
        os.sync()
        now = shutil.disk_usage(path).used
        if now == last:
            return now
        last = now
        time.sleep(0.1)
    return last


def evict(*roots: Path) -> None:
    """Drop these files' pages from the page cache (not the whole machine's: it is shared)."""
    for root in roots:
        files = [root] if root.is_file() else [f for f in root.rglob("*") if f.is_file()]
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd) if root.is_file() else None
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fs", choices=sorted(MKFS), required=True)
    ap.add_argument("--size", default="8GB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/tmp"))
    ap.add_argument("--cold", action="store_true")
    args = ap.parse_args()
    size = parse_size(args.size)
    base = args.dir / f"zero-copy-{args.fs}"
    image, mnt = base / "image", base / "mnt"
    mnt.mkdir(parents=True, exist_ok=True)
    with open(image, "wb") as f:
        f.truncate(3 * size + (4 << 30))
    subprocess.run([*MKFS[args.fs], str(image)], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True)
    try:
        per_shard = SHARD // TENSOR
        count = -(-size // TENSOR)
        shards = [[Tensor(f"layers.{i:04d}.weight", "BF16", (TENSOR // 2 // 4096, 4096))
                   for i in range(s, min(s + per_shard, count))] for s in range(0, count, per_shard)]
        src = mnt / "src"
        write_sharded(src, shards)
        rule = mnt / "rename.yaml"
        rule.write_text(RULE)
        compile_ckptxform()
        subprocess.run([PY, "-m", "ckptxform", "-q", "validate", str(rule)], check=True, stdout=subprocess.DEVNULL)
        contenders = {
            "cp -r --reflink=never": lambda out: ["cp", "-r", "--reflink=never", str(src), str(out)],
            "cp -r --reflink=always": lambda out: ["cp", "-r", "--reflink=always", str(src), str(out)],
            "ckptxform rename --no-fsync": lambda out: [PY, "-m", "ckptxform", "-q", "apply", str(rule),
                                                        f"--source=src={src}", "--out", str(out), "--no-fsync"],
            "ckptxform rename": lambda out: [PY, "-m", "ckptxform", "-q", "apply", str(rule),
                                             f"--source=src={src}", "--out", str(out)],
            "ckptxform rename --digest none --no-fsync": lambda out: [
                PY, "-m", "ckptxform", "-q", "apply", str(rule), f"--source=src={src}", "--out", str(out),
                "--digest", "none", "--no-fsync"],
        }
        walls: dict[str, list[float]] = {name: [] for name in contenders}
        grown: dict[str, list[int]] = {name: [] for name in contenders}
        for rep in range(args.reps):
            for name in (list(contenders) if rep % 2 == 0 else list(reversed(contenders))):
                out = mnt / "out"
                before = used(mnt)
                if args.cold:
                    evict(src, image)
                start = time.perf_counter()
                subprocess.run(contenders[name](out), check=True, stdout=subprocess.DEVNULL)
                walls[name].append(time.perf_counter() - start)
                grown[name].append(used(mnt) - before)
                shutil.rmtree(out)
                os.sync()
        total = sum(t.nbytes for group in shards for t in group)
        cp = walls["cp -r --reflink=never"]
        print(f"{args.fs}, {total / 1e9:.2f} GB in {len(shards)} shards, {args.reps} reps"
              f"{', cold page cache' if args.cold else ''}")
        print("| contender | median (s) | best (s) | / cp -r --reflink=never (paired median) "
              "| used space growth, each run (% of the output) |")
        print("|---|---|---|---|---|")
        for name in contenders:
            ratio = statistics.median(a / b for a, b in zip(walls[name], cp, strict=True))
            each = ", ".join(f"{100 * g / total:.2f}" for g in grown[name])
            print(f"| {name} | {statistics.median(walls[name]):.2f} | {min(walls[name]):.2f} | {ratio:.3f} | "
                  f"{each} |")
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        image.unlink(missing_ok=True)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
