"""Planning a many-tensor Hub repo (issue 36 item 3): ``ckptxform plan`` of the tensor-count
benchmark's rename on 200,000 tensors in 64 shards, served by the test Hub server at a
round-trip time per request, from a cold Hugging Face cache, against the same plan of the
same checkpoint on local disk.

    python benchmarks/hub_count_bench.py                       # 200,000 tensors, RTT 50 ms, 3 reps
    python benchmarks/hub_count_bench.py --count 20000 --rtt 100

A cold Hub plan reads the index and the 64 safetensors headers (by range, in parallel);
what it adds to the local plan is those requests. Contenders alternate, each in its own
process; every Hub run starts from an empty HF_HOME. Reported: median wall, peak RSS,
the median of paired ratios to the local plan, and the requests and bytes the server sent.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from count_bench import RULE, build_source  # noqa: E402
from harness import Result, compile_ckptxform, measure, paired_ratio, warm  # noqa: E402
from hubserver import HubServer  # noqa: E402

PY = sys.executable
REPO_ID = "ORG/many-tensors"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=200_000)
    ap.add_argument("--shards", type=int, default=64)
    ap.add_argument("--rtt", type=float, default=50.0, help="milliseconds per request")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    compile_ckptxform()
    work = Path(tempfile.mkdtemp(prefix="ckptxform-hub-count-"))
    try:
        src = work / "src"
        build_source(src, args.count, args.shards)
        warm(src)
        rules = work / "rename.yaml"
        rules.write_text(RULE)
        plan = [PY, "-m", "ckptxform", "plan", "-q", str(rules)]
        local, hub = Result("local plan", [], []), Result("cold Hub plan", [], [])
        requests = sent = 0
        with HubServer(latency=args.rtt / 1000) as server:
            server.add_repo(REPO_ID, src)
            os.environ.update(HF_ENDPOINT=server.endpoint, HF_HUB_DISABLE_TELEMETRY="1", NO_PROXY="127.0.0.1")
            os.environ.pop("HF_TOKEN", None)
            for rep in range(args.reps):
                wall, rss = measure([*plan, "--source", f"model={src}"])
                local.walls.append(wall)
                local.rss.append(rss)
                os.environ["HF_HOME"] = str(work / f"home-{rep}")
                server.clear_log()
                wall, rss = measure([*plan, "--source", f"model={REPO_ID}@main"])
                hub.walls.append(wall)
                hub.rss.append(rss)
                log = list(server.log)
                requests, sent = len(log), sum(r.sent for r in log)
                shutil.rmtree(work / f"home-{rep}", ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{args.count:,} tensors in {args.shards} shards, RTT {args.rtt:g} ms, {args.reps} repetition(s), "
          "median wall, ratio = median of paired ratios\n")
    print("| contender | wall s | peak RSS MB | x local plan |")
    print("|---|---|---|---|")
    for r in (local, hub):
        print(f"| {r.name} | {r.wall:.2f} | {r.peak_mb:.0f} | {paired_ratio(r, local):.2f} |")
    print(f"\nthe cold Hub plan made {requests} requests for {sent / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
