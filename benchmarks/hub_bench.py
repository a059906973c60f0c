"""Hub benchmark: the headline ``apply`` through a Hub-compatible server that behaves like the
real one (302 to a CDN host, a round-trip time per request, optionally a bandwidth cap), at
the row counts of the real conversion, for ``fetch: ranges``, ``download`` and ``auto``.

    python benchmarks/hub_bench.py                      # RTT 0/20/50/100 ms, then 50 ms at 25 MB/s
    python benchmarks/hub_bench.py --rtt 50 --bandwidth 25e6 --modes auto
    python benchmarks/hub_bench.py --rtt 50 --modes --versus-download   # only the comparison below

Stand-ins: vocab 163,840, draft vocab 32,000, hidden 1024, a 6-shard verifier whose last
shard holds the 335 MB lm_head; the conversion reads ~6,400 of its rows. Every apply runs
in its own process from a cold Hugging Face cache (its own HF_HOME), with the link left to
be measured (no CKPTXFORM_HUB_LINK). Printed per run: wall time, requests and body bytes
the server sent, and what ``auto`` chose (from the audit's ``fetch`` events). The output
of every run is compared bit for bit with the first one's.

``--versus-download`` also times, per link, what a user who does not trust Hub sources
would do: ``hf download`` of the files the Hub apply read (one command per repo, as the
server's log names them, into a cold cache), then the same ``apply`` from that cache, and prints both times and their ratio (Hub apply / download then apply).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import unquote

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from hubserver import HubServer, LoggedRequest  # noqa: E402

from ckptxform.standins import KIMI_K2, build_headline_standins  # noqa: E402

RULE = REPO / "rules" / "aqmedai_k2_to_k25.yaml"
REPOS = {"drafter": "ORG/D", "target_vocab": "ORG/T", "verifier": "ORG/V"}
DIMS = KIMI_K2.scaled(hidden=1024, head_dim=128, vocab=163840, draft_vocab=32000, verifier_layers=6)


def digest(out: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(out.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()


def client_env(server: HubServer, home: Path) -> dict[str, str]:
    """A client of ``server`` with a cold cache of its own (``home``) and the link left to be measured."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "CKPTXFORM_HUB_LINK"))}
    env.update(HF_ENDPOINT=server.endpoint, HF_HOME=str(home), HF_HUB_DISABLE_TELEMETRY="1", NO_PROXY="127.0.0.1")
    return env


def run(server: HubServer, work: Path, command: str, mode: str | None, tag: str) -> dict[str, object]:
    env = client_env(server, work / f"home-{tag}")
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
        result["files"] = files_read(log)
    return result


def files_read(log: list[LoggedRequest]) -> dict[str, list[str]]:
    """Repo -> the files a run was served (a 404 probe is not a file read)."""
    found: dict[str, set[str]] = {}
    for r in log:
        repo, sep, rest = r.path.lstrip("/").partition("/resolve/")
        if sep and r.status < 400:
            found.setdefault(repo, set()).add(unquote(rest.split("/", 1)[1]))
    return {repo: sorted(files) for repo, files in found.items()}


def download_then_apply(server: HubServer, work: Path, files: dict[str, list[str]], tag: str) -> dict[str, float]:
    """``hf download`` of ``files`` into a cold Hugging Face cache (one command per repo, in
    turn), then ``apply`` from that cache (a folder of a few of the verifier's shards is not
    a checkpoint: its index names the others; the apply still resolves each revision and
    probes the drafter for an index, a few round trips): the seconds of each part, and the
    output's digest."""
    env = client_env(server, work / f"home-{tag}")
    hf = Path(sys.executable).with_name("hf")
    started = time.perf_counter()
    for repo in REPOS.values():
        subprocess.run([str(hf), "download", repo, *files[repo], "--revision", "main"], env=env,
                       capture_output=True, text=True, check=True)
    downloaded = time.perf_counter() - started
    out = work / f"out-{tag}"
    args = [a for name, repo in REPOS.items() for a in ("--source", f"{name}={repo}@main")]
    proc = subprocess.run([sys.executable, "-m", "ckptxform", "-q", "apply", str(RULE), *args, "--out", str(out)],
                          env=env, cwd=REPO, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{tag}: {proc.stderr}")
    return {"download": downloaded, "apply": time.perf_counter() - started - downloaded, "digest": digest(out)}


def versus_download(server: HubServer, work: Path, link: str, tag: str, reps: int) -> str:
    """A cold Hub apply against ``hf download`` then a local apply, on one link, ``reps``
    times in turn (each cold); every pair and the median ratio printed; the outputs' digest."""
    ratios, digests = [], set()
    for rep in range(reps):
        hub = run(server, work, "apply", None, f"hub-{tag}-{rep}")
        files = hub["files"]
        assert isinstance(files, dict)
        local = download_then_apply(server, work, files, f"local-{tag}-{rep}")
        digests |= {str(hub["digest"]), str(local["digest"])}
        pair = local["download"] + local["apply"]
        ratios.append(float(hub["seconds"]) / pair)
        count = sum(len(f) for f in files.values())
        print(f"{link:>20}  Hub apply {hub['seconds']:6.2f} s;  hf download ({count} files) "
              f"{local['download']:6.2f} s + local apply {local['apply']:5.2f} s = {pair:6.2f} s;  "
              f"ratio {ratios[-1]:.2f}", flush=True)
    if len(digests) != 1:
        raise SystemExit(f"{link}: the Hub apply and the apply of the downloaded files differ")
    print(f"{link:>20}  Hub apply / (hf download + local apply): median {statistics.median(ratios):.2f} "
          f"of {reps} ({', '.join(f'{r:.2f}' for r in ratios)})", flush=True)
    return digests.pop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rtt", type=float, nargs="*", default=None, help="milliseconds (default 0 20 50 100)")
    parser.add_argument("--bandwidth", type=float, default=None, help="bytes/s cap for --rtt runs")
    parser.add_argument("--modes", nargs="*", default=["ranges", "download", "auto"])
    parser.add_argument("--versus-download", action="store_true",
                        help="also time hf download of the files read, then a local apply")
    parser.add_argument("--reps", type=int, default=3, help="pairs of --versus-download runs (default 3)")
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
                if args.versus_download:
                    digests.add(versus_download(server, work, link, f"{rtt_ms}-{bandwidth}", args.reps))
        if digests:  # none when only plans ran (--modes with no mode)
            print(f"outputs bit-identical across runs: {len(digests) == 1}")


if __name__ == "__main__":
    main()
