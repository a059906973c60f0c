"""The headline conversion end to end from Hub repos: the real ``ckptxform`` command and
the real huggingface_hub client against ``hubserver.HubServer`` (issue 4's Must-show).

Stand-ins of the three sources are served as repos ORG/D (K2 drafter, with its
``training_state.pt``), ORG/T (K2.5 drafter) and ORG/V (4-shard verifier whose last shard,
holding ``language_model.lm_head.weight``, is ~300 times the rows the conversion needs).
Every byte count is asserted from the server's request log. Each command runs in its own
process with HF_ENDPOINT, HF_HOME and HF_HUB_CACHE under tmp_path and every proxy variable
pointing at a trap, so a request that leaves 127.0.0.1 fails the test. ``pytest -s``
prints the measured figures.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    HEADLINE_SEED,
    LM_HEAD,
    REPO,
    error_lines,
    read_audit,
    read_output,
    same_bits,
)
from hub_fixtures import ProxyTrap, client_env, file_requests, header_size, tensor_span
from hubserver import HubServer, LoggedRequest, hub_file

from ckptxform import api
from ckptxform.sources.hub.checkpoint import SPECULATIVE_HEADER
from ckptxform.standins import KIMI_K2, HeadlineStandins, build_headline_standins

RULE = "rules/aqmedai_k2_to_k25.yaml"
REPOS = {"drafter": "ORG/D", "target_vocab": "ORG/T", "verifier": "ORG/V"}
GATED = "ORG/G"  # a gated copy of the drafter
#: a verifier vocabulary 64 times the draft vocabulary: its lm_head shard is ~4 MiB, the
#: rows the conversion reads from it ~13 KiB; its first shard (embed_tokens) as large
E2E_DIMS = KIMI_K2.scaled(hidden=64, head_dim=16, vocab=32768, draft_vocab=512, verifier_layers=4)


@dataclass
class Served:
    server: HubServer
    trap: ProxyTrap
    standins: HeadlineStandins
    folders: dict[str, Path]  # repo id -> folder served
    commits: dict[str, str]  # repo id -> commit of branch main
    reference: Path  # the same conversion applied from the local folders

    def env(self, home: Path, **extra: str) -> dict[str, str]:
        """A client's environment with ``home`` as HF_HOME and its own HF_HUB_CACHE."""
        env = client_env(self.server, home, self.trap, HF_HUB_CACHE=str(home / "hub-cache"), NO_COLOR="1",
                         **extra)
        env.pop("CKPTXFORM_DEBUG", None)  # the error tests need the user's view, not a traceback
        return env

    def cli(self, env: dict[str, str], *args: str | Path) -> subprocess.CompletedProcess[str]:
        """Run ``ckptxform ARGS`` from the repo root with a clean log."""
        self.server.clear_log()
        return subprocess.run([sys.executable, "-m", "ckptxform", *map(str, args)], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("hub-e2e")
    standins = build_headline_standins(root / "src", dims=E2E_DIMS, seed=HEADLINE_SEED)
    reference = root / "reference"
    api.apply(REPO / RULE, out=reference, sources=standins.sources, progress=False)
    folders = {REPOS["drafter"]: standins.drafter.path, REPOS["target_vocab"]: standins.target_vocab.path,
               REPOS["verifier"]: standins.verifier.path}
    trap = ProxyTrap()
    with HubServer() as server:
        commits = {repo: server.add_repo(repo, folder) for repo, folder in folders.items()}
        server.add_repo(GATED, standins.drafter.path, gated_token="hf_gateOnlyForThoseWhoAsked")
        yield Served(server, trap, standins, folders, commits, reference)
    trap.close()


@pytest.fixture
def fresh(served: Served) -> Iterator[Served]:
    served.trap.lines.clear()
    yield served
    assert served.trap.lines == [], "a request left 127.0.0.1"


# -- reading the server log ----------------------------------------------------------------
def by_file(log: list[LoggedRequest]) -> dict[tuple[str, str], int]:
    """(repo, file) -> body bytes sent, for every file requested (HEAD probes count 0)."""
    out: Counter[tuple[str, str]] = Counter()
    for r in file_requests(log):
        head, _, tail = r.path.lstrip("/").partition("/resolve/")
        out[(head, tail.partition("/")[2])] += r.sent
    return dict(out)


def ranges(log: list[LoggedRequest], repo: str, file: str) -> list[str | None]:
    return sorted((r.range for r in file_requests(log) if r.path.startswith(f"/{repo}/resolve/")
                   and r.path.endswith(f"/{file}") and r.sent), key=str)


def api_calls(log: list[LoggedRequest]) -> list[str]:
    return [r.path for r in log if r.path.startswith("/api/")]


def total(log: list[LoggedRequest]) -> int:
    return sum(r.sent for r in log)


# -- what the sources hold -----------------------------------------------------------------
def size(path: Path) -> int:
    return path.stat().st_size


def span_range(path: Path, key: str) -> str:
    offset, nbytes = tensor_span(path, key)
    return f"bytes={offset}-{offset + nbytes - 1}"


def header_ranges(path: Path) -> list[str]:
    return [f"bytes=0-{speculative(path) - 1}"]


def speculative(path: Path) -> int:
    """What the first read of a safetensors file moves: its first 256 KiB (its header
    and what follows), or all of a smaller file."""
    return min(size(path), SPECULATIVE_HEADER)


def vocab_bytes(path: Path) -> int:
    """The first read, and d2t and t2d where they lie beyond it: what a vocab map read moves."""
    beyond = (max(0, o + n - max(o, SPECULATIVE_HEADER)) for o, n in (tensor_span(path, k) for k in ("d2t", "t2d")))
    return speculative(path) + sum(beyond)


def lm_head_shard(served: Served) -> str:
    index = json.loads((served.standins.verifier.path / "model.safetensors.index.json").read_text())
    return str(index["weight_map"][LM_HEAD])


def rows_read(served: Served) -> list[int]:
    """K2.5 draft tokens the K2 drafter lacks: the rows read from the verifier's lm_head."""
    return sorted(set(served.standins.k25_ids) - set(served.standins.k2_ids))


def needed_rows(served: Served) -> int:
    return len(rows_read(served))


def sources(served: Served, revision: str | None = None) -> list[str]:
    """``--source NAME=REPO[@REV]`` for the three repos; ``revision="commit"`` pins each
    to its commit."""
    def at(repo: str) -> str:
        rev = served.commits[repo] if revision == "commit" else revision
        return f"@{rev}" if rev else ""

    return [a for name, repo in REPOS.items() for a in ("--source", f"{name}={repo}{at(repo)}")]


def events(audit: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The audit's ``kind`` events, with rule positions relative to the repo root (the
    reference ran the rule file by its absolute path)."""
    out = []
    for e in audit:
        if e["event"] == kind:
            rule = e.get("rule")
            out.append({**e, "rule": rule.removeprefix(f"{REPO}/")} if isinstance(rule, str) else e)
    return out


def assert_same_conversion(served: Served, out: Path) -> None:
    """Bit for bit the output of the local conversion; config.json too, except that
    ``${source.verifier.repo}`` names the Hub repo actually read."""
    want, got = read_output(served.reference), read_output(out)
    assert sorted(got) == sorted(want)
    assert [k for k in want if not same_bits(got[k], want[k])] == []
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in served.reference.iterdir())
    want_config = json.loads((served.reference / "config.json").read_text())
    # the local run names its local verifier as given (issue 35 item 4)
    assert want_config["speculators_config"]["verifier"]["name_or_path"] == served.standins.sources["verifier"]
    want_config["speculators_config"]["verifier"]["name_or_path"] = REPOS["verifier"]
    assert json.loads((out / "config.json").read_text()) == want_config


def assert_failed_cleanly(proc: subprocess.CompletedProcess[str], out: Path, code: int = 1) -> str:
    """Exit ``code``, exactly one error line, no traceback, nothing left where OUT goes."""
    assert proc.returncode == code, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout
    (line,) = error_lines(proc.stderr)
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir() if out.name in p.name] == []  # nor a temporary sibling
    return line


# -- plan, apply, rerun, offline -----------------------------------------------------------
def test_plan_and_apply_move_only_the_bytes_the_conversion_needs(fresh: Served, tmp_path: Path) -> None:
    served = fresh
    d_dir, t_dir, v_dir = (served.folders[REPOS[n]] for n in ("drafter", "target_vocab", "verifier"))
    d_model, t_model = d_dir / "model.safetensors", t_dir / "model.safetensors"
    shard = lm_head_shard(served)
    D, T, V = REPOS["drafter"], REPOS["target_vocab"], REPOS["verifier"]
    snapshot = sum(size(p) for folder in served.folders.values() for p in folder.rglob("*") if p.is_file())

    # plan: small JSON, the headers of the files holding needed tensors, d2t/t2d. No other byte.
    plan_home = tmp_path / "plan-home"
    proc = served.cli(served.env(plan_home), "plan", RULE, *sources(served))
    assert proc.returncode == 0, proc.stderr
    log = served.server.log
    assert by_file(log) == {
        (D, "config.json"): size(d_dir / "config.json"),
        (D, "model.safetensors.index.json"): 0,  # a HEAD answered 404: the drafter is one file
        (D, "model.safetensors"): vocab_bytes(d_model),
        (T, "config.json"): size(t_dir / "config.json"),
        (T, "model.safetensors.index.json"): 0,
        (T, "model.safetensors"): vocab_bytes(t_model),
        (V, "config.json"): size(v_dir / "config.json"),
        (V, "model.safetensors.index.json"): size(v_dir / "model.safetensors.index.json"),
        (V, "model.safetensors"): 0,  # a HEAD answered 404 (asked alongside the index)
        (V, shard): speculative(v_dir / shard),  # one header of four shards, in one request
    }
    # The drafters are smaller than the first read: header, d2t and t2d in one request.
    assert size(d_model) <= SPECULATIVE_HEADER and size(t_model) <= SPECULATIVE_HEADER
    for repo, model in ((D, d_model), (T, t_model)):
        assert ranges(log, repo, "model.safetensors") == header_ranges(model)
    assert ranges(log, V, shard) == header_ranges(v_dir / shard)
    assert header_size(v_dir / shard) < SPECULATIVE_HEADER
    assert sorted(api_calls(log)) == [f"/api/models/{repo}" for repo in (D, T, V)]  # the default branch, once each
    assert not any("training_state" in r.path for r in log)
    for repo, commit in served.commits.items():
        assert f"{repo} @ {commit}" in proc.stdout
    plan_bytes = total(log)

    # Offline from the plan's cache: the verifier's rows were never fetched (the drafter's
    # file, all in its first read, was), so apply fails on that file, names it and the
    # fix, and leaves no output.
    out = tmp_path / "offline-miss"
    proc = served.cli(served.env(plan_home, HF_HUB_OFFLINE="1"), "apply", RULE, *sources(served, "main"),
                      "--out", out)
    line = assert_failed_cleanly(proc, out)
    assert line == (
        f"error: source 'verifier' (Hub repo {V}@main): HF_HUB_OFFLINE=1 and file {shard!r} is not in "
        f"the Hugging Face cache ({plan_home / 'hub-cache'}); run once without HF_HUB_OFFLINE=1, or fill the "
        f"cache with `hf download {V} {shard} --revision {served.commits[V]}`")
    assert served.server.log == []

    # apply from a cold cache: the drafter's weights, the target's d2t/t2d, the verifier's rows.
    home = tmp_path / "home"
    env = served.env(home)
    out = tmp_path / "out"
    proc = served.cli(env, "apply", RULE, *sources(served, "main"), "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert_same_conversion(served, out)
    log = served.server.log
    moved = by_file(log)
    row_bytes = E2E_DIMS.verifier_hidden * 2  # bf16
    rows, header = needed_rows(served), header_size(v_dir / shard)
    verifier_weights = moved.pop((V, shard))
    assert moved == {
        (D, "config.json"): size(d_dir / "config.json"),
        (D, "model.safetensors.index.json"): 0,
        (D, "model.safetensors"): size(d_model),  # all of it in the first read: prefetch finds it cached
        (T, "config.json"): size(t_dir / "config.json"),
        (T, "model.safetensors.index.json"): 0,
        (T, "model.safetensors"): vocab_bytes(t_model),
        (V, "config.json"): size(v_dir / "config.json"),
        (V, "model.safetensors.index.json"): size(v_dir / "model.safetensors.index.json"),
        (V, "model.safetensors"): 0,
    }
    assert not any("training_state" in r.path for r in log)  # nor any other verifier shard (above)
    first = speculative(v_dir / shard)
    beyond = len([t for t in rows_read(served) if tensor_span(v_dir / shard, LM_HEAD)[0] + t * row_bytes >= first])
    assert first + beyond * row_bytes <= verifier_weights <= first + 1.10 * beyond * row_bytes
    assert verifier_weights < size(v_dir / shard) / 10
    assert sorted(api_calls(log)) == [f"/api/models/{repo}/revision/main" for repo in (D, T, V)]
    apply_bytes = total(log)

    audit, reference_audit = read_audit(out), read_audit(served.reference)
    run = audit[0]
    assert {name: {k: s[k] for k in ("location", "revision", "commit")} for name, s in run["sources"].items()} == {
        name: {"location": f"{repo}@main", "revision": "main", "commit": served.commits[repo]}
        for name, repo in REPOS.items()}
    # The same fate for every tensor of every file opened, and the same bytes written, as
    # the local conversion: the verifier's lm_head shard is accounted for from its header.
    assert events(audit, "tensor") == events(reference_audit, "tensor")
    # (how the bytes got there differs: fetched bytes are written, local ones kernel-copied)
    def what(e: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in e.items() if k != "moved"}

    assert [what(e) for e in events(audit, "written")] == [what(e) for e in events(reference_audit, "written")]
    assert all(e["moved"]["written"] == sum(e["moved"].values()) for e in events(audit, "written"))
    (lm_rows,) = [e for e in audit if e["event"] == "tensor" and e["action"] == "rows"]
    assert (lm_rows["source"], lm_rows["key"]) == ("verifier", LM_HEAD)
    assert lm_rows["reason"].startswith(f"{rows} rows read")

    verifier_total = sum(n for (repo, _), n in by_file(log).items() if repo == V)
    print(f"\n[hub e2e] verifier lm_head shard {size(v_dir / shard):,} B; needed {rows} rows x {row_bytes} B "
          f"= {rows * row_bytes:,} B + header {header:,} B = {rows * row_bytes + header:,} B; fetched "
          f"{verifier_weights:,} B from the shard ({verifier_weights / (rows * row_bytes + header):.4f}x), "
          f"{verifier_total:,} B from ORG/V with config.json and the index")
    print(f"[hub e2e] plan moved {plan_bytes:,} B, apply (cold cache) {apply_bytes:,} B, plan+apply "
          f"{plan_bytes + apply_bytes:,} B; naive snapshot_download of the three repos {snapshot:,} B; "
          f"apply/snapshot {apply_bytes / snapshot:.4f} (1/{snapshot / apply_bytes:.1f}), "
          f"plan/snapshot {plan_bytes / snapshot:.5f} (1/{snapshot / plan_bytes:.0f})")

    # A second apply to a fresh OUT: the revision lookups, and no file byte.
    out2 = tmp_path / "out2"
    proc = served.cli(env, "apply", RULE, *sources(served, "main"), "--out", out2)
    assert proc.returncode == 0, proc.stderr
    assert_same_conversion(served, out2)
    assert sorted((r.method, r.path, r.status) for r in served.server.log) == [
        ("GET", f"/api/models/{repo}/revision/main", 200) for repo in (D, T, V)]

    # Offline from the warm cache: not a single request.
    out3 = tmp_path / "out3"
    proc = served.cli(served.env(home, HF_HUB_OFFLINE="1"), "apply", RULE, *sources(served, "main"),
                      "--out", out3)
    assert proc.returncode == 0, proc.stderr
    assert_same_conversion(served, out3)
    assert served.server.log == []

    # --require-pinned: a branch fails before anything is written and gives the commit to pin...
    out4 = tmp_path / "out4"
    proc = served.cli(env, "apply", RULE, *sources(served, "main"), "--require-pinned", "--out", out4)
    line = assert_failed_cleanly(proc, out4, code=2)
    assert line == (
        f"error: source 'drafter' (Hub repo {D}@main): revision 'main' is not a commit; it resolved to "
        f"{served.commits[D]} for this run; pin revision: {served.commits[D]} so that a rerun reads the same "
        "bytes (a pinned commit is required)")
    # ...and pinned commits run, from the warm cache without contacting the server at all.
    proc = served.cli(env, "apply", RULE, *sources(served, "commit"), "--require-pinned", "--out", out4)
    assert proc.returncode == 0, proc.stderr
    assert "is not a commit" not in proc.stderr
    assert_same_conversion(served, out4)
    assert served.server.log == []


# -- errors ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "location", "message"),
    [
        ("verifier", "ORG/NOPE@main",
         ("error: source 'verifier' (Hub repo ORG/NOPE@main): repo not found on {endpoint} (or it is private and "
          "the token has no access); check the name, or set HF_TOKEN or run `hf auth login` for a private repo")),
        ("drafter", f"{GATED}@main",
         (f"error: source 'drafter' (Hub repo {GATED}@main): the repo is gated and no token was sent; accept the "
          f"conditions on the repo page ({{endpoint}}/{GATED}) and set HF_TOKEN or run `hf auth login`")),
        ("target_vocab", "ORG/T@v9",
         ("error: source 'target_vocab' (Hub repo ORG/T@v9): revision 'v9' does not exist in the repo; give an "
          "existing branch, tag or commit (see {endpoint}/ORG/T/tree/main)")),
    ],
    ids=["repo-not-found", "gated-repo", "revision-not-found"],
)
def test_hub_errors_name_the_source_repo_and_revision(
        fresh: Served, tmp_path: Path, name: str, location: str, message: str) -> None:
    served = fresh
    args = [*sources(fresh, "main"), "--source", f"{name}={location}"]  # the last --source wins
    out = tmp_path / "out"
    proc = served.cli(served.env(tmp_path / "home"), "apply", RULE, *args, "--out", out)
    line = assert_failed_cleanly(proc, out)
    assert line == message.format(endpoint=served.server.endpoint)
    # Failed while opening the sources: of the weight files, headers only travelled.
    weights = [r for r in file_requests(served.server.log) if r.path.endswith(".safetensors")]
    assert all(r.method == "HEAD" or (r.range or "").startswith("bytes=0-") for r in weights), weights


# -- inspect and vocab-diff ------------------------------------------------------------------
def test_inspect_and_vocab_diff_read_headers_and_maps_only(fresh: Served, tmp_path: Path) -> None:
    served = fresh
    env = served.env(tmp_path / "home")
    D, T, V = REPOS["drafter"], REPOS["target_vocab"], REPOS["verifier"]
    d_dir, t_dir, v_dir = served.folders[D], served.folders[T], served.folders[V]

    proc = served.cli(env, "inspect", f"{D}@main")
    assert proc.returncode == 0, proc.stderr
    assert f"{D}@main @ {served.commits[D]}" in proc.stdout
    assert all(key in proc.stdout for key in served.standins.drafter.keys)
    assert by_file(served.server.log) == {
        (D, "config.json"): size(d_dir / "config.json"),
        (D, "model.safetensors.index.json"): 0,
        (D, "model.safetensors"): speculative(d_dir / "model.safetensors"),
    }

    # A sharded repo: every header (inspect lists every tensor), each in one request.
    proc = served.cli(env, "inspect", f"hf://{V}@main", "--json")
    assert proc.returncode == 0, proc.stderr
    listed = json.loads(proc.stdout)
    assert (listed["commit"], listed["revision"]) == (served.commits[V], "main")
    assert {t["key"]: (tuple(t["shape"]), t["file"]) for t in listed["tensors"]} == {
        key: (served.standins.verifier.shapes[key], file)
        for key, file in json.loads((v_dir / "model.safetensors.index.json").read_text())["weight_map"].items()}
    shards = sorted({t["file"] for t in listed["tensors"]})
    assert by_file(served.server.log) == {
        (V, "config.json"): size(v_dir / "config.json"),
        (V, "model.safetensors.index.json"): size(v_dir / "model.safetensors.index.json"),
        (V, "model.safetensors"): 0,
        **{(V, s): speculative(v_dir / s) for s in shards},
    }

    proc = served.cli(env, "vocab-diff", D, T)
    assert proc.returncode == 0, proc.stderr
    # The cache from inspect holds the drafter's config and first read (maps included):
    # nothing of it travels.
    assert by_file(served.server.log) == {
        (T, "config.json"): size(t_dir / "config.json"),
        (T, "model.safetensors.index.json"): 0,
        (T, "model.safetensors"): vocab_bytes(t_dir / "model.safetensors"),
    }
    assert proc.stdout.splitlines()[0].startswith(f"A: {D} (draft vocabulary")
    local = served.cli(env, "vocab-diff", d_dir, t_dir)
    assert local.returncode == 0, local.stderr
    assert proc.stdout.splitlines()[2:] == local.stdout.splitlines()[2:]  # all but the A:/B: lines


# -- a server that misbehaves while rows are read ------------------------------------------
SENTINEL = "hf_SENTINELtokenEchoedByTheServer0123"
#: what follows ``error: source 'verifier' (Hub repo ORG/V@main): file 'SHARD': `` per fault
BAD_SERVER = {
    "bytes-changed": r"changed on the server during the run \(ETag '\"{etag}\"' at the first read, "
                     r"'\"{other_etag}\"' now\); rerun to read one version",
    "wrong-content-range": r"asked for bytes (\d+)-(\d+) of {size}, the server answered Content-Range "
                           r"'bytes (\d+)-(\d+)/{size}' \(check HF_ENDPOINT and any proxy\)",
    "short-body": r"the server answered 10 bytes for bytes (\d+)-(\d+) \(\d+ asked\) \(check HF_ENDPOINT and any "
                  r"proxy\)",
    "gzip-range": r"the server answered a range with Content-Encoding 'gzip' although 'identity' was asked; "
                  r"ckptxform reads raw bytes only \(check HF_ENDPOINT and any proxy\)",
    "redirect-loop": r"more than 10 redirects \(a redirect loop at {cdn}\); check HF_ENDPOINT and any proxy",
    "stall": r"the server stopped sending \(no byte for 1 s, after \d+ bytes of the answer\); check the "
             r"network, or raise CKPTXFORM_HUB_STALL for a server that pauses longer",
}
MISBEHAVIOUR = {"bytes-changed": "swap", "wrong-content-range": "bad_range", "short-body": "short",
                "gzip-range": "gzip", "redirect-loop": "loop", "stall": "stall"}


@pytest.mark.parametrize("case", list(BAD_SERVER))
def test_a_misbehaving_server_fails_the_apply_with_one_line_naming_the_file(
        fresh: Served, tmp_path: Path, case: str) -> None:
    """Item 4 of issue 17 (and 9 of issue 12): whatever the CDN does wrong after the plan
    read the shard's header, apply exits 1 with one line naming the file, leaves no output
    and never mixes bytes."""
    served = fresh
    v_dir = served.folders[REPOS["verifier"]]
    shard = lm_head_shard(served)
    changed = tmp_path / shard  # same size, other bytes: only the ETag tells
    blob = bytearray((v_dir / shard).read_bytes())
    blob[-1] ^= 0xFF
    changed.write_bytes(bytes(blob))
    other = hub_file(shard, changed)
    served.server.misbehave(f"/{REPOS['verifier']}/resolve/*/{shard}", MISBEHAVIOUR[case], host="cdn", skip=1,
                            times=1000, other=other, after_bytes=10, delay=0.5)
    out = tmp_path / "out"
    try:
        proc = served.cli(served.env(tmp_path / "home", HF_HUB_DOWNLOAD_TIMEOUT="1", CKPTXFORM_HUB_STALL="1"), "apply", RULE,
                          *sources(served, "main"), "--source", f"verifier={REPOS['verifier']}@main?fetch=ranges",
                          "--out", out)
    finally:
        served.server.clear_faults()
    line = assert_failed_cleanly(proc, out)
    sha = hashlib.sha256((v_dir / shard).read_bytes()).hexdigest()
    reason = BAD_SERVER[case].format(
        etag=hashlib.md5(sha.encode()).hexdigest(), other_etag=hashlib.md5(other.sha256.encode()).hexdigest(),
        size=size(v_dir / shard), cdn=re.escape(served.server.cdn_endpoint.removeprefix("http://")))
    prefix = re.escape(f"error: source 'verifier' (Hub repo {REPOS['verifier']}@main): file {shard!r}: ")
    match = re.fullmatch(prefix + reason, line)
    assert match, line
    if case == "wrong-content-range":
        assert int(match.group(3)) == int(match.group(1)) + 1  # the answer's range is one byte off


@pytest.mark.parametrize("case", ["retry-after-an-hour", "server-echoes-the-token"])
def test_a_server_that_asks_to_wait_or_echoes_the_token_fails_in_one_clean_line(
        fresh: Served, tmp_path: Path, case: str) -> None:
    """Issue 12, items 8 and 11: a 429 asking for an hour fails at once; a server error
    that quotes the Authorization header is shown with the token redacted."""
    served = fresh
    shard = lm_head_shard(served)
    if case == "retry-after-an-hour":
        served.server.misbehave(f"/{REPOS['verifier']}/resolve/*/{shard}", "retry_after", host="cdn", skip=1,
                                times=1000, retry_after=3600)
    else:
        served.server.misbehave(f"/{REPOS['verifier']}/resolve/*/{shard}", "echo_auth", host="hub", method="HEAD",
                                times=1000)
    out = tmp_path / "out"
    try:
        proc = served.cli(served.env(tmp_path / "home", HF_TOKEN=SENTINEL), "apply", RULE, *sources(served, "main"),
                          "--out", out)
    finally:
        served.server.clear_faults()
    line = assert_failed_cleanly(proc, out)
    who = f"error: source 'verifier' (Hub repo {REPOS['verifier']}@main)"
    if case == "retry-after-an-hour":
        assert line == (f"{who}: the server asks to wait 3600 s (HTTP 429) before reading file {shard!r}, longer "
                        "than ckptxform waits (60 s); rerun later")
    else:
        assert line == (f"{who}: HTTP 400 reading file {shard!r}: Invalid credentials in header 'Authorization: "
                        "Bearer ***'")
        assert any(r.authorized for r in served.server.log)  # the token was sent: its absence means something
    assert SENTINEL not in proc.stdout + proc.stderr


def test_fetch_option_forces_a_download_and_the_audit_says_why(fresh: Served, tmp_path: Path) -> None:
    """``?fetch=download`` on a --source location: the verifier's shard is downloaded into
    the Hugging Face cache; the audit's fetch events say what each file cost and why."""
    served = fresh
    v_dir, shard = served.folders[REPOS["verifier"]], lm_head_shard(served)
    home, out = tmp_path / "home", tmp_path / "out"
    proc = served.cli(served.env(home), "apply", RULE, *sources(served, "main"),
                      "--source", f"verifier={REPOS['verifier']}@main?fetch=download", "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert_same_conversion(served, out)
    commit = served.commits[REPOS["verifier"]]
    assert (home / "hub-cache" / f"models--ORG--V/snapshots/{commit}/{shard}").read_bytes() == (v_dir / shard).read_bytes()
    fetch = {e["source"]: e for e in read_audit(out) if e["event"] == "fetch"}
    assert sorted(fetch) == ["drafter", "verifier"]  # target_vocab gives vocab maps only, read at plan time
    assert fetch["drafter"] == {"event": "fetch", "source": "drafter", "file": "model.safetensors", "policy": "auto",
                                "choice": "cached"}  # all of it came with its header's first read
    verifier = fetch["verifier"]
    assert (verifier["file"], verifier["policy"], verifier["choice"]) == (shard, "download", "download")
    assert verifier["estimate"]["download"]["bytes"] == size(v_dir / shard)
    assert verifier["estimate"]["ranges"]["bytes"] >= needed_rows(served) * E2E_DIMS.verifier_hidden * 2 - SPECULATIVE_HEADER
    assert verifier["estimate"]["link"] == {"rtt_s": 0.05, "bandwidth_Bps": 100000, "parallel": 32,
                                            "from": "CKPTXFORM_HUB_LINK"}
    whole = [(r.host, r.method, r.range) for r in file_requests(served.server.log) if r.path.endswith(shard)
             and r.range is None]
    assert sorted(whole) == [("cdn", "GET", None), ("hub", "HEAD", None), ("hub", "HEAD", None)]
