"""Hub benchmark: the headline ``apply`` through a Hub-compatible server that behaves like the
real one (302 to a CDN host, a round-trip time per request, optionally a bandwidth cap), at
the row counts of the real conversion, for ``fetch: ranges``, ``download`` and ``auto``.

    python benchmarks/hub_bench.py                      # RTT 0/20/50/100 ms, then 50 ms at 25 MB/s
    python benchmarks/hub_bench.py --rtt 50 --bandwidth 25e6 --modes auto

Stand-ins: vocab 163,840, draft vocab 32,000, hidden 1024, a 6-shard verifier whose last
shard holds the 335 MB lm_head; the conversion reads ~6,400 of its rows. Every apply runs
in its own process from a cold Hugging Face cache (its own HF_HOME), with the link left to
be measured (no CKPTXFORM_HUB_LINK). Printed per run: wall time, requests and body bytes
the server sent, and what ``auto`` chose (from the audit's ``fetch`` events). The output
of every run is compared bit for bit with the first one's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from hubserver import HubServer  # noqa: E402

from ckptxform.standins import KIMI_K2, build_headline_standins  # noqa: E402

RULE = REPO / "rules" / "aqmedai_k2_to_k25.yaml"
REPOS = {"drafter": "ORG/D", "target_vocab": "ORG/T", "verifier": "ORG/V"}
DIMS = KIMI_K2.scaled(hidden=1024, head_dim=128, vocab=163840, draft_vocab=32000, verifier_layers=6)


def digest(out: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(out.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()


def run(server: HubServer, work: Path, command: str, mode: str | None, tag: str) -> dict[str, object]:
    home = work / f"home-{tag}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "CKPTXFORM_HUB_LINK"))}
    env.update(HF_ENDPOINT=server.endpoint, HF_HOME=str(home), HF_HUB_DISABLE_TELEMETRY="1", NO_PROXY="127.0.0.1")
    option = f"?fetch={mode}" if mode else ""
    args = [a for name, repo in REPOS.items() for a in ("--source", f"{name}={repo}@main{option}")]
    out = work / f"out-{tag}"
    cmd = [sys.executable, "-m", "ckptxform", "-q", command, str(RULE), *args]
    if command == "apply":
        cmd += ["--out", str(out)]
    server.clear_log()
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{tag}: {proc.stderr}")
    log = list(server.log)
    result: dict[str, object] = {"seconds": seconds, "requests": len(log), "bytes": sum(r.sent for r in log)}
    if command == "apply":
        events = [json.loads(line) for line in (out / "ckptxform_audit.jsonl").read_text().splitlines()]
        fetch = [e for e in events if e["event"] == "fetch" and e["source"] == "verifier" and e["choice"] != "cached"]
        result["choice"] = fetch[0]["choice"] if fetch else "cached"
        result["estimate"] = fetch[0].get("estimate") if fetch else None
        result["fetch_s"] = fetch[0].get("seconds") if fetch else None
        result["digest"] = digest(out)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rtt", type=float, nargs="*", default=None, help="milliseconds (default 0 20 50 100)")
    parser.add_argument("--bandwidth", type=float, default=None, help="bytes/s cap for --rtt runs")
    parser.add_argument("--modes", nargs="*", default=["ranges", "download", "auto"])
    args = parser.parse_args()
    scenarios = ([(r, args.bandwidth) for r in args.rtt] if args.rtt is not None
                 else [(0.0, None), (20.0, None), (50.0, None), (100.0, None), (50.0, 25e6)])
    with tempfile.TemporaryDirectory(prefix="ckptxform-hub-bench-") as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        standins = build_headline_standins(work / "src", dims=DIMS, seed=0)
        print(f"stand-ins built in {time.perf_counter() - t0:.0f} s", flush=True)
        folders = {"ORG/D": standins.drafter.path, "ORG/T": standins.target_vocab.path,
                   "ORG/V": standins.verifier.path}
        digests: set[str] = set()
        for rtt_ms, bandwidth in scenarios:
            with HubServer(latency=rtt_ms / 1000, bandwidth=bandwidth) as server:
                for repo, folder in folders.items():
                    server.add_repo(repo, folder)
                link = f"RTT {rtt_ms:g} ms" + (f", {bandwidth / 1e6:g} MB/s" if bandwidth else "")
                plans = [run(server, work, "plan", None, f"plan{i}-{rtt_ms}-{bandwidth}") for i in range(3)]
                walls = sorted(float(p["seconds"]) for p in plans)
                print(f"{link:>20}  plan      {walls[1]:6.2f} s {plans[0]['requests']:6d} req "
                      f"{plans[0]['bytes'] / 1e6:9.2f} MB  (median of {', '.join(f'{w:.2f}' for w in walls)})",
                      flush=True)
                for mode in args.modes:
                    r = run(server, work, "apply", mode, f"{mode}-{rtt_ms}-{bandwidth}")
                    digests.add(str(r["digest"]))
                    est = r["estimate"] or {}
                    guess = (f" in {r['fetch_s']:.2f} s (est. ranges {est['ranges']['seconds']:.2f} s / download "
                             f"{est['download']['seconds']:.2f} s)") if est else ""
                    print(f"{link:>20}  {mode:9} {r['seconds']:6.2f} s {r['requests']:6d} req "
                          f"{r['bytes'] / 1e6:9.2f} MB  verifier: {r['choice']}{guess}", flush=True)
        print(f"outputs bit-identical across runs: {len(digests) == 1}")


if __name__ == "__main__":
    main()
