"""Hub sources through the real huggingface_hub client, against ``hubserver.HubServer``.

Byte counts are asserted from the server's request log: what ``plan`` (index + headers)
and a row gather transfer, that a warm cache transfers no weight byte, that
``HF_HUB_OFFLINE=1`` works from the cache, and every error's one-line message. Client
code runs in subprocesses (huggingface_hub reads its environment at import), with every
proxy variable pointing at a trap that fails the test if a request leaves 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hub_fixtures import (
    ProxyTrap,
    body_bytes,
    client_env,
    file_bytes,
    file_requests,
    header_size,
    run_client,
    tensor_span,
    write_safetensors,
)
from hubserver import HubServer

from ckptxform.errors import HubError, UsageError, redact, register_secret
from ckptxform.sources.hub.checkpoint import SPECULATIVE_HEADER, parse_hub_location
from ckptxform.sources.hub.fetch import PROBE_BYTES, PROBE_SMALL, link_cost, split_fetch_option
from ckptxform.sources.hub.ranges import MAX_REQUEST, REQUEST_CPU, LinkCost, RangeCache, Span, plan_requests

SENTINEL_TOKEN = "hf_SENTINELtokenMustNeverBePrinted0123"
GATE_TOKEN = "hf_gateAccessGranted456"
LM_HEAD = "language_model.lm_head.weight"
VOCAB, HIDDEN = 32768, 256  # the verifier's lm_head: 16 MiB of bf16, rows of 512 bytes
ROW = HIDDEN * 2
SHARDS = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
#: 10 scattered rows; 3 and 4 (like BRIDGED) lie in the first 256 KiB, which the
#: speculative header read brought already; the others are 300 KB apart or more
ROWS = [3, 4, 517, 1200, 2048, 3001, 4095, 5555, 7000, 8191]
BRIDGED = [*range(100, 140), 141]


@dataclass
class Hub:
    server: HubServer
    root: Path
    commits: dict[str, str]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _drafter(folder: Path, seed: int = 0) -> None:
    g = _gen(seed)
    write_safetensors(
        folder / "model.safetensors",
        {
            "midlayer.self_attn.q_proj.weight": torch.randn(64, 128, generator=g).to(torch.bfloat16),
            # 512 KiB: the file outgrows the speculative header read (256 KiB)
            "fc.weight": torch.randn(64, 4096, generator=g).to(torch.bfloat16),
            "norm.weight": torch.ones(64, dtype=torch.bfloat16),
            "lm_head.weight": torch.randn(32, 64, generator=g).to(torch.bfloat16),
            "d2t": torch.arange(32, dtype=torch.int64) * 3,
            "t2d": torch.arange(VOCAB // 32) % 3 == 0,
        },
    )
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "seed": seed}))
    # Optimizer state a conversion never needs: it must never be requested.
    (folder / "training_state.pt").write_bytes(torch.randn(50_000, generator=g).numpy().tobytes())


def _verifier(folder: Path) -> None:
    g = _gen(1)
    write_safetensors(
        folder / SHARDS[0],
        {"language_model.model.embed_tokens.weight": torch.randn(VOCAB, 64, generator=g).to(torch.bfloat16)},
    )
    norm = torch.ones(HIDDEN, dtype=torch.bfloat16)
    write_safetensors(folder / SHARDS[1], {"language_model.model.norm.weight": norm})
    write_safetensors(folder / SHARDS[2], {LM_HEAD: torch.randn(VOCAB, HIDDEN, generator=g).to(torch.bfloat16)})
    weight_map = {
        "language_model.model.embed_tokens.weight": SHARDS[0],
        "language_model.model.norm.weight": SHARDS[1],
        LM_HEAD: SHARDS[2],
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps({"model_type": "kimi_k25"}))


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    root = tmp_path_factory.mktemp("repos")
    _drafter(root / "drafter")
    _verifier(root / "verifier")
    _drafter(root / "tagged-v1", seed=1)
    _drafter(root / "tagged-v2", seed=2)
    shutil.copytree(root / "verifier", root / "broken")
    (root / "broken" / SHARDS[1]).unlink()  # the index names a shard the repo lacks
    (root / "binonly").mkdir()
    (root / "binonly" / "pytorch_model.bin").write_bytes(b"\0" * 64)
    (root / "binonly" / "config.json").write_text("{}")
    (root / "flaky").mkdir()
    shutil.copy(root / "drafter" / "model.safetensors", root / "flaky")
    with HubServer() as server:
        commits = {
            "org/drafter": server.add_repo("org/drafter", root / "drafter"),
            "org/verifier": server.add_repo("org/verifier", root / "verifier"),
            "org/gated": server.add_repo("org/gated", root / "drafter", gated_token=GATE_TOKEN),
            "org/broken": server.add_repo("org/broken", root / "broken"),
            "org/binonly": server.add_repo("org/binonly", root / "binonly"),
            "org/flaky": server.add_repo("org/flaky", root / "flaky"),
            "v1": server.add_repo("org/tagged", root / "tagged-v1", tags=["v1"]),
            "v2": server.add_repo("org/tagged", root / "tagged-v2"),
        }
        yield Hub(server, root, commits)


@pytest.fixture(scope="module")
def trap() -> Iterator[ProxyTrap]:
    proxy = ProxyTrap()
    yield proxy
    proxy.close()


@pytest.fixture
def fresh(hub: Hub, trap: ProxyTrap) -> Iterator[None]:
    hub.server.clear_log()
    hub.server.clear_faults()
    trap.lines.clear()
    yield
    assert trap.lines == [], "a request left 127.0.0.1"


def _sha(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


def _expected_rows(path: Path, rows: list[int]) -> dict[str, str]:
    offset, _ = tensor_span(path, LM_HEAD)
    return {str(r): _sha(file_bytes(path, offset + r * ROW, ROW)) for r in rows}


def _ranges(log: list, suffix: str) -> list[str | None]:
    return sorted((r.range for r in file_requests(log) if r.path.endswith(suffix)), key=str)


def span_range(offset: int, nbytes: int) -> str:
    return f"bytes={offset}-{offset + nbytes - 1}"


def _requests(log: list) -> list[tuple]:
    """(host, method, path, range, status) of every request, sorted: requests sent at once
    arrive in any order."""
    return sorted(((r.host, r.method, r.path, r.range, r.status) for r in log), key=str)


# -- plan, rows, warm cache, offline ------------------------------------------------------
PLAN = """
ckpt = open_hub("org/verifier", "main", name="verifier", retry=FAST)
info = ckpt.tensors["language_model.lm_head.weight"]
emit(commit=ckpt.commit, revision=ckpt.revision, files=list(ckpt.files), count=len(ckpt.tensors),
     loaded=list(ckpt.tensors.loaded_files), info=[info.file, info.offset, info.nbytes, list(info.shape)])
"""

APPLY = """
import hashlib
ckpt = open_hub("org/verifier", "main", name="verifier", retry=FAST)
info = ckpt.tensors["language_model.lm_head.weight"]
rows = ckpt.read_rows(info, ROWS)
rows.update(ckpt.read_rows(info, BRIDGED))
emit(rows={r: hashlib.sha256(b).hexdigest() for r, b in rows.items()}, local=ckpt.local_path(info.file) is None)
"""


def test_plan_reads_index_and_one_header_then_rows_by_range(
    hub: Hub, trap: ProxyTrap, fresh: None, tmp_path: Path
) -> None:
    commit = hub.commits["org/verifier"]
    folder = hub.root / "verifier"
    env = client_env(hub.server, tmp_path / "home", trap)

    run = run_client(PLAN, env)
    assert run.returncode == 0, run.stderr
    (plan,) = run.records
    offset, nbytes = tensor_span(folder / SHARDS[2], LM_HEAD)
    assert plan == {
        "commit": commit,
        "revision": "main",
        "files": SHARDS,
        "count": 3,
        "loaded": [SHARDS[2]],  # the other shards' headers were not read
        "info": [SHARDS[2], offset, nbytes, [VOCAB, HIDDEN]],
    }
    assert f"revision 'main' is not a commit; it resolved to {commit}" in run.stderr
    # The branch is resolved once; every file request names the commit. Config, index and
    # the single-file probe go out at once; the shard is resolved once (a 302 to the CDN)
    # and its header read in one speculative request.
    base = f"/org/verifier/resolve/{commit}"
    assert _requests(hub.server.log) == sorted([
        ("hub", "GET", "/api/models/org/verifier/revision/main", None, 200),
        ("hub", "HEAD", f"{base}/config.json", None, 200),
        ("hub", "GET", f"{base}/config.json", None, 200),
        ("hub", "HEAD", f"{base}/model.safetensors.index.json", None, 200),
        ("hub", "GET", f"{base}/model.safetensors.index.json", None, 200),
        ("hub", "HEAD", f"{base}/model.safetensors", None, 404),
        ("hub", "HEAD", f"{base}/{SHARDS[2]}", None, 302),
        ("cdn", "GET", f"{base}/{SHARDS[2]}", f"bytes=0-{SPECULATIVE_HEADER - 1}", 206),
    ], key=str)
    json_bytes = (folder / "config.json").stat().st_size + (folder / "model.safetensors.index.json").stat().st_size
    assert header_size(folder / SHARDS[2]) < SPECULATIVE_HEADER
    assert body_bytes(hub.server.log) == json_bytes + SPECULATIVE_HEADER
    assert not any(r.authorized for r in hub.server.log if r.host == "cdn")  # the token stays on the Hub

    # apply: only the rows' bytes travel (JSON and header come from the caches), rows in
    # the speculative read's first 256 KiB not even those.
    hub.server.clear_log()
    apply = APPLY.replace("ROWS", repr(ROWS)).replace("BRIDGED", repr(BRIDGED))
    run = run_client(apply, env)
    assert run.returncode == 0, run.stderr
    expected = _expected_rows(folder / SHARDS[2], ROWS + BRIDGED)
    assert run.records == [{"rows": expected, "local": True}]
    log = hub.server.log
    fetched = [r for r in ROWS if offset + (r + 1) * ROW > SPECULATIVE_HEADER]
    assert fetched == ROWS[2:]  # 3, 4 and BRIDGED were in the first 256 KiB
    assert _requests(log) == sorted(
        [("hub", "GET", "/api/models/org/verifier/revision/main", None, 200),
         ("hub", "HEAD", f"{base}/{SHARDS[2]}", None, 302)]
        + [("cdn", "GET", f"{base}/{SHARDS[2]}", f"bytes={offset + r * ROW}-{offset + (r + 1) * ROW - 1}", 206)
           for r in fetched], key=str)
    assert body_bytes(log) == len(fetched) * ROW

    # A second apply transfers nothing but the revision lookup.
    hub.server.clear_log()
    run = run_client(apply, env)
    assert run.returncode == 0, run.stderr
    assert run.records == [{"rows": expected, "local": True}]
    assert [(r.method, r.path) for r in hub.server.log] == [("GET", "/api/models/org/verifier/revision/main")]

    # Offline from the same cache: no request at all.
    hub.server.clear_log()
    run = run_client(apply, {**env, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr
    assert run.records == [{"rows": expected, "local": True}]
    assert hub.server.log == []


# -- a single-file drafter: vocab by ranges, weights through the HF cache -----------------
DRAFTER = """
import hashlib
sha = lambda b: hashlib.sha256(b).hexdigest()
vocab = open_hub("org/drafter", "COMMIT", name="target_vocab", policy="ranges", retry=FAST)
emit(step="vocab", d2t=sha(vocab.read(vocab.tensors["d2t"])), t2d=sha(vocab.read(vocab.tensors["t2d"])),
     cached=vocab.local_path("model.safetensors") is not None)
drafter = open_hub("org/drafter", "COMMIT", name="drafter", policy="download", retry=FAST)
drafter.prefetch(drafter.files)
emit(step="drafter", local=str(drafter.local_path("model.safetensors")),
     lm_head=sha(drafter.read(drafter.tensors["lm_head.weight"])), config=drafter.config())
"""


def test_drafter_vocab_by_ranges_and_weights_through_hf_cache(
    hub: Hub, trap: ProxyTrap, fresh: None, tmp_path: Path
) -> None:
    commit = hub.commits["org/drafter"]
    model = hub.root / "drafter" / "model.safetensors"
    cache = tmp_path / "hub-cache"  # HF_HUB_CACHE outside HF_HOME: both are honoured
    env = client_env(hub.server, tmp_path / "home", trap, HF_HUB_CACHE=str(cache))
    code = DRAFTER.replace("COMMIT", commit)

    run = run_client(code, env)
    assert run.returncode == 0, run.stderr
    spans = {k: tensor_span(model, k) for k in ("d2t", "t2d", "lm_head.weight")}
    vocab, drafter = run.records
    assert vocab == {
        "step": "vocab",
        "d2t": _sha(file_bytes(model, *spans["d2t"])),
        "t2d": _sha(file_bytes(model, *spans["t2d"])),
        "cached": False,
    }
    assert Path(drafter["local"]).is_relative_to(cache / f"models--org--drafter/snapshots/{commit}")
    assert drafter["lm_head"] == _sha(file_bytes(model, *spans["lm_head.weight"]))
    assert drafter["config"] == {"architectures": ["LlamaForCausalLMEagle3"], "seed": 0}
    assert "is not a commit" not in run.stderr  # pinned: no warning,
    assert not any("/api/" in r.path for r in hub.server.log)  # and no revision lookup
    assert "100%" not in run.stderr  # no progress bar when stderr is not a terminal

    log = hub.server.log
    assert not any("training_state" in r.path for r in log)
    # int64 d2t comes first in the file, within the speculative read; bool t2d last.
    assert spans["d2t"][0] + spans["d2t"][1] <= SPECULATIVE_HEADER < spans["t2d"][0]
    ranged = [r for r in file_requests(log) if r.range]
    assert sorted(r.range for r in ranged) == sorted(
        [f"bytes=0-{SPECULATIVE_HEADER - 1}", span_range(*spans["t2d"])]
    )
    assert {r.host for r in ranged} == {"cdn"}
    assert sum(r.sent for r in ranged) == SPECULATIVE_HEADER + spans["t2d"][1]
    whole = [(r.host, r.method, r.status, r.sent) for r in file_requests(log)
             if r.path.endswith("/model.safetensors") and not r.range]
    # resolved once by the vocab reader (HEAD, 302), then by hf_hub_download: HEAD, CDN GET
    assert sorted(whole) == [("cdn", "GET", 200, model.stat().st_size), ("hub", "HEAD", 302, 0), ("hub", "HEAD", 302, 0)]

    hub.server.clear_log()
    run = run_client(code, env)
    assert run.returncode == 0, run.stderr
    assert run.records == [{**vocab, "cached": True}, drafter]  # now read from the downloaded file
    assert hub.server.log == []  # pinned commit + warm cache: not even a HEAD


# -- revisions ----------------------------------------------------------------------------
PINNING = """
import hashlib
def norm(ckpt):
    return hashlib.sha256(ckpt.read(ckpt.tensors["lm_head.weight"])).hexdigest()
tag = open_hub("org/tagged", "v1", name="drafter", policy="ranges", retry=FAST)
default = open_hub("org/tagged", None, name="drafter", policy="download", retry=FAST)
pinned = open_hub("org/tagged", tag.commit, name="drafter", policy="ranges", retry=FAST)
emit(tag=[tag.commit, norm(tag)], default=[default.commit, norm(default)], pinned=[pinned.commit, norm(pinned)])
attempt("require_pinned", lambda: open_hub("org/tagged", "main", name="drafter", require_pinned=True, retry=FAST))
"""


def test_branch_and_tag_resolve_to_commits(hub: Hub, trap: ProxyTrap, fresh: None, tmp_path: Path) -> None:
    v1, v2 = hub.commits["v1"], hub.commits["v2"]
    run = run_client(PINNING, client_env(hub.server, tmp_path / "home", trap))
    assert run.returncode == 0, run.stderr

    def lm_head(folder: str) -> str:
        model = hub.root / folder / "model.safetensors"
        return _sha(file_bytes(model, *tensor_span(model, "lm_head.weight")))

    assert run.records[0] == {
        "tag": [v1, lm_head("tagged-v1")],
        "default": [v2, lm_head("tagged-v2")],
        "pinned": [v1, lm_head("tagged-v1")],
    }
    assert run.records[1] == {
        "case": "require_pinned",
        "error": "UsageError",
        "message": f"source 'drafter' (Hub repo org/tagged@main): revision 'main' is not a commit; it resolved "
        f"to {v2} for this run; pin revision: {v2} so that a rerun reads the same bytes (a pinned commit is required)",
        "exit_code": 2,
        "source": "drafter",
    }
    default_warning = f"source 'drafter' (Hub repo org/tagged): the default branch is not a commit; it resolved to {v2}"
    assert default_warning in run.stderr
    resolves = file_requests(hub.server.log)
    assert resolves and all(f"/resolve/{v1}/" in r.path or f"/resolve/{v2}/" in r.path for r in resolves)
    # Policy "download": headers by range, then the whole file through the cache.
    v2_model = hub.root / "tagged-v2" / "model.safetensors"
    # (sorted: a handler logs when it is done, so a HEAD may be logged after the GET it led to)
    assert sorted(((r.host, r.method, r.range, r.sent) for r in resolves
                   if r.path.endswith(f"/resolve/{v2}/model.safetensors")), key=str) == sorted([
        ("hub", "HEAD", None, 0),
        ("cdn", "GET", f"bytes=0-{SPECULATIVE_HEADER - 1}", SPECULATIVE_HEADER),
        ("hub", "HEAD", None, 0),
        ("cdn", "GET", None, v2_model.stat().st_size),
    ], key=str)
    assert [r.path for r in hub.server.log if "/api/" in r.path] == [
        "/api/models/org/tagged/revision/v1",
        "/api/models/org/tagged",
        "/api/models/org/tagged/revision/main",
    ]


# -- the CDN and the link -------------------------------------------------------------------
EXPIRY = """
import hashlib, time
ckpt = open_hub("org/verifier", "COMMIT", name="verifier", policy="ranges", retry=FAST)
info = ckpt.tensors["language_model.lm_head.weight"]
rows = ckpt.read_rows(info, [600, 601])
time.sleep(4)  # the signed CDN URL, valid 3 s, expires
rows.update(ckpt.read_rows(info, [900]))
emit(rows={r: hashlib.sha256(b).hexdigest() for r, b in rows.items()})
"""


def test_an_expired_cdn_url_is_resolved_again(hub: Hub, trap: ProxyTrap, fresh: None, tmp_path: Path) -> None:
    commit = hub.commits["org/verifier"]
    with HubServer(cdn_ttl=3) as server:
        assert server.add_repo("org/verifier", hub.root / "verifier") == commit
        run = run_client(EXPIRY.replace("COMMIT", commit), client_env(server, tmp_path / "home", trap))
        log = [r for r in file_requests(server.log) if r.path.endswith(SHARDS[2])]
    assert run.returncode == 0, run.stderr
    assert run.records == [{"rows": _expected_rows(hub.root / "verifier" / SHARDS[2], [600, 601, 900])}]
    # resolved, read (header, rows); then refused (expired), resolved again, read
    statuses = [(r.host, r.method, r.status) for r in log]
    assert sorted(statuses[-3:]) == [("cdn", "GET", 206), ("cdn", "GET", 403), ("hub", "HEAD", 302)]
    assert statuses.count(("hub", "HEAD", 302)) == 2


MEASURED = """
ckpt = open_hub("org/verifier", "COMMIT", name="verifier", retry=FAST)
ckpt.prefetch([], rows={"language_model.lm_head.weight": ROWS})
emit(events=ckpt.fetch_events())
"""


def test_auto_picks_by_the_link_it_measured(hub: Hub, trap: ProxyTrap, fresh: None, tmp_path: Path) -> None:
    """50 ms a request and 4 MB/s: the bandwidth is measured by reading 4 KiB then 4 MiB
    of what is needed anyway; the rows left then take ~0.1 s by ranges, the 16 MiB shard ~4 s."""
    commit = hub.commits["org/verifier"]
    offset, _ = tensor_span(hub.root / "verifier" / SHARDS[2], LM_HEAD)
    rows = [*ROWS, 20_000, 30_000]
    with HubServer(latency=0.05, bandwidth=4e6) as server:
        server.add_repo("org/verifier", hub.root / "verifier")
        env = client_env(server, tmp_path / "home", trap, CKPTXFORM_HUB_LINK="")
        run = run_client(MEASURED.replace("COMMIT", commit).replace("ROWS", repr(rows)), env)
        log = [r for r in file_requests(server.log) if r.path.endswith(SHARDS[2])]
    assert run.returncode == 0, run.stderr
    ((event,),) = [r["events"] for r in run.records]
    estimate = event.pop("estimate")
    assert event.pop("seconds") > 0  # how long the rows took
    assert event == {"event": "fetch", "source": "verifier", "file": SHARDS[2], "policy": "auto", "choice": "ranges"}
    probe = offset + ROWS[2] * ROW  # from the first row beyond the header's first read (3, 4 are in it)
    assert [(r.range, r.sent) for r in log if r.host == "cdn"][:3] == [
        (f"bytes=0-{SPECULATIVE_HEADER - 1}", SPECULATIVE_HEADER),
        (span_range(probe, PROBE_SMALL), PROBE_SMALL),
        (span_range(probe + PROBE_SMALL, PROBE_BYTES - PROBE_SMALL), PROBE_BYTES - PROBE_SMALL)]
    left = [r for r in rows if offset + r * ROW >= probe + PROBE_BYTES]
    assert left == [20_000, 30_000]
    assert estimate["ranges"] == {"requests": len(left), "bytes": len(left) * ROW,
                                  "seconds": estimate["ranges"]["seconds"]}
    assert estimate["download"]["bytes"] == (hub.root / "verifier" / SHARDS[2]).stat().st_size
    link = estimate["link"]
    assert link["rtt_s"] >= 0.05 and link["parallel"] == 32 and link["from"].endswith(" requests")
    assert 2e6 < link["bandwidth_Bps"] < 8e6  # the cap, as the probe saw it
    assert estimate["ranges"]["seconds"] < 0.5 < 2 < estimate["download"]["seconds"]
    assert len([r for r in log if r.host == "cdn"]) == 3 + len(left)  # header, probe, then the rows


# -- errors -------------------------------------------------------------------------------
ERRORS = """
import pathlib
token_file = pathlib.Path(os.environ["HF_HOME"]) / "token"
def read_shard_2():
    ckpt = open_hub("org/broken", "main", name="verifier", retry=FAST)
    ckpt.tensors["language_model.model.norm.weight"]
def gated(case, token=None, saved=None):
    os.environ.pop("HF_TOKEN", None)
    if token:
        os.environ["HF_TOKEN"] = token
    if saved:
        token_file.write_text(saved)
    attempt(case, lambda: open_hub("org/gated", "main", name="drafter", retry=FAST))
    token_file.unlink(missing_ok=True)
def rows():
    ckpt = open_hub("org/verifier", "main", name="verifier", retry=FAST)
    info = ckpt.tensors["language_model.lm_head.weight"]
    ckpt.read_rows(info, [1, 2])
    ckpt.read(ckpt.tensors["language_model.model.norm.weight"])

attempt("repo_not_found", lambda: open_hub("org/nope", "main", name="drafter", retry=FAST))
gated("gated_wrong_token", token="SENTINEL")
gated("gated_no_token")
gated("gated_saved_token", saved="GATE")
gated("gated_env_token", token="GATE")
os.environ["HF_TOKEN"] = "SENTINEL"
attempt("revision_not_found", lambda: open_hub("org/drafter", "nobranch", name="drafter", retry=FAST))
attempt("no_safetensors", lambda: open_hub("org/binonly", "main", name="drafter", retry=FAST))
attempt("missing_shard", read_shard_2)
attempt("flaky_then_ok", rows)
attempt("revision_500", lambda: open_hub("org/flaky", "main", name="verifier", retry=FAST))
attempt("range_500", lambda: open_hub("org/flaky", "FLAKY", name="verifier", retry=FAST))
"""


def test_errors_name_source_repo_revision_and_fix(hub: Hub, trap: ProxyTrap, fresh: None, tmp_path: Path) -> None:
    server, commits = hub.server, hub.commits
    # Transient faults the client must ride out: two 503s on the lm_head shard, and a
    # connection reset 4 bytes into the norm shard's first range.
    server.fail(f"/org/verifier/resolve/*/{SHARDS[2]}", status=503, times=2)
    server.reset(f"/org/verifier/resolve/*/{SHARDS[1]}", after_bytes=4)
    # Persistent 500s: on the revision lookup, and on every range read of a file.
    server.fail("/api/models/org/flaky/revision/*", times=100)
    server.fail("/org/flaky/resolve/*/model.safetensors", times=100, method="GET")
    code = (
        ERRORS.replace('"SENTINEL"', repr(SENTINEL_TOKEN))
        .replace('"GATE"', repr(GATE_TOKEN))
        .replace("FLAKY", commits["org/flaky"])
    )
    run = run_client(code, client_env(server, tmp_path / "home", trap, HF_TOKEN=SENTINEL_TOKEN))
    assert run.returncode == 0, run.stderr
    endpoint = server.endpoint
    got = {r["case"]: r for r in run.records}
    assert {case: r["error"] for case, r in got.items()} == {
        "repo_not_found": "RepoNotFoundError",
        "gated_wrong_token": "GatedRepoError",
        "gated_no_token": "GatedRepoError",
        "gated_saved_token": None,
        "gated_env_token": None,
        "revision_not_found": "RevisionNotFoundError",
        "no_safetensors": "EntryNotFoundError",
        "missing_shard": "EntryNotFoundError",
        "flaky_then_ok": None,
        "revision_500": "HubError",
        "range_500": "HubError",
    }
    messages = {case: r["message"] for case, r in got.items() if r["error"]}
    assert messages == {
        "repo_not_found": "source 'drafter' (Hub repo org/nope@main): repo not found on "
        f"{endpoint} (or it is private and the token has no access); check the name, or set HF_TOKEN "
        "or run `hf auth login` for a private repo",
        "gated_wrong_token": "source 'drafter' (Hub repo org/gated@main): the repo is gated and the token has "
        f"no access to it; accept the conditions on the repo page ({endpoint}/org/gated) and set HF_TOKEN "
        "or run `hf auth login`",
        "gated_no_token": "source 'drafter' (Hub repo org/gated@main): the repo is gated and no token was "
        f"sent; accept the conditions on the repo page ({endpoint}/org/gated) and set HF_TOKEN or run "
        "`hf auth login`",
        "revision_not_found": "source 'drafter' (Hub repo org/drafter@nobranch): revision 'nobranch' does "
        f"not exist in the repo; give an existing branch, tag or commit (see {endpoint}/org/drafter/tree/main)",
        "no_safetensors": f"source 'drafter' (Hub repo org/binonly@main): commit {commits['org/binonly']} has "
        "neither model.safetensors.index.json nor model.safetensors (it holds 'config.json', "
        "'pytorch_model.bin'); ckptxform reads safetensors from the Hub (download other formats and give "
        "a local path)",
        "missing_shard": "source 'verifier' (Hub repo org/broken@main): file "
        f"'{SHARDS[1]}' does not exist at commit {commits['org/broken']}",
        "revision_500": "source 'verifier' (Hub repo org/flaky@main): could not read the commit of "
        f"revision 'main' after 5 tries (last: HTTP 500); check the network and HF_ENDPOINT ({endpoint}) "
        "and rerun",
        "range_500": f"source 'verifier' (Hub repo org/flaky@{commits['org/flaky']}): could not read file "
        f"'model.safetensors' after 5 tries (last: HTTP 500); check the network and HF_ENDPOINT "
        f"({endpoint}) and rerun",
    }
    assert {r["exit_code"] for r in got.values() if r["error"]} == {1}
    assert {r["source"] for r in got.values() if r["error"]} == {"drafter", "verifier"}

    log = server.log
    assert [r.status for r in log if r.fault and "verifier" in r.path] == [503, 503, 206]
    assert len([r for r in log if r.path.startswith("/api/models/org/flaky") and r.status == 500]) == 5
    assert len([r for r in log if r.path.startswith("/org/flaky/") and r.status == 500]) == 5
    # The sentinel token was sent (so its absence below means something) and never shown.
    assert any(r.authorized for r in log)
    assert SENTINEL_TOKEN not in run.stdout + run.stderr
    assert GATE_TOKEN not in run.stdout + run.stderr


LOOP = """
def header():
    ckpt = open_hub("org/verifier", "COMMIT", name="verifier", retry=FAST)
    ckpt.tensors["language_model.lm_head.weight"]
attempt("loop", header)
"""


def test_a_redirect_loop_on_the_hub_is_one_error_naming_the_file(
        hub: Hub, trap: ProxyTrap, fresh: None, tmp_path: Path) -> None:
    commit = hub.commits["org/verifier"]
    hub.server.misbehave(f"/org/verifier/resolve/*/{SHARDS[2]}", "loop", host="hub", method="HEAD", times=1000)
    run = run_client(LOOP.replace("COMMIT", commit), client_env(hub.server, tmp_path / "home", trap))
    assert run.returncode == 0, run.stderr
    ((record),) = run.records
    base = f"{hub.server.endpoint}/org/verifier/resolve/{commit}/{SHARDS[2]}"
    assert (record["error"], record["message"]) == (
        "HubError",
        f"source 'verifier' (Hub repo org/verifier@{commit}): file {SHARDS[2]!r}: the server redirected in a loop "
        f"(TooManyRedirects: Exceeded 20 redirects while resolving {base!r}.); check HF_ENDPOINT and any proxy")
    assert len([r for r in hub.server.log if r.status == 302]) == 20  # huggingface_hub's bound, then it stops


def test_redact_removes_tokens_whatever_text_carries_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "plainSecretValue42")
    register_secret("savedTokenFromAFile9")
    text = ("401: Authorization: Bearer hf_abcdefghijklmnop; {'authorization': 'Bearer abc.def'} "
            "token plainSecretValue42 and savedTokenFromAFile9 at https://cdn/x?Expires=1&Signature=c2lnbmF0dXJl")
    assert redact(text) == ("401: Authorization: Bearer ***; {'authorization': 'Bearer ***'} "
                            "token *** and *** at https://cdn/x?Expires=1&Signature=***")
    # every ckptxform error is redacted when it is made, whatever raised it
    assert str(HubError("HTTP 400: bad header 'Authorization: Bearer hf_abcdefghijklmnop'")) == (
        "HTTP 400: bad header 'Authorization: Bearer ***'")


OFFLINE = """
attempt("branch", lambda: open_hub("org/drafter", "main", name="drafter", retry=FAST))
attempt("commit", lambda: open_hub("org/drafter", "COMMIT", name="drafter", retry=FAST))
"""


def test_offline_cache_miss_names_the_file_and_the_fix(hub: Hub, trap: ProxyTrap, fresh: None, tmp_path: Path) -> None:
    commit = hub.commits["org/drafter"]
    cache = tmp_path / "home" / "hub"
    env = client_env(hub.server, tmp_path / "home", trap, HF_HUB_OFFLINE="1")
    run = run_client(OFFLINE.replace("COMMIT", commit), env)
    assert run.returncode == 0, run.stderr
    assert [(r["error"], r["message"], r["exit_code"]) for r in run.records] == [
        (
            "OfflineCacheMissError",
            "source 'drafter' (Hub repo org/drafter@main): HF_HUB_OFFLINE=1 and the commit of revision "
            f"'main' is not in the Hugging Face cache ({cache}); pin the source to a commit, or run once "
            "without HF_HUB_OFFLINE=1 to resolve revision 'main'",
            1,
        ),
        (
            "OfflineCacheMissError",
            f"source 'drafter' (Hub repo org/drafter@{commit}): HF_HUB_OFFLINE=1 and file 'config.json' is not "
            f"in the Hugging Face cache ({cache}); run once without HF_HUB_OFFLINE=1, or fill the cache with "
            f"`hf download org/drafter config.json --revision {commit}`",
            1,
        ),
    ]
    assert hub.server.log == []


# -- pure helpers -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("loc", "parsed"),
    [
        ("hf://org/name@v1.0", ("org/name", "v1.0")),
        ("hf://org/name", ("org/name", None)),
        ("org/name@refs/pr/3", ("org/name", "refs/pr/3")),
        ("AQ-MedAI/Kimi-K2-Instruct-eagle3", ("AQ-MedAI/Kimi-K2-Instruct-eagle3", None)),
        ("./checkpoints/drafter", None),
        ("/abs/path", None),
        ("a/b/c", None),
        ("model.safetensors", None),
        ("org/name@", None),
    ],
)
def test_parse_hub_location(loc: str, parsed: tuple[str, str | None] | None) -> None:
    assert parse_hub_location(loc) == parsed


def test_parse_hub_location_rejects_a_bad_hf_url() -> None:
    with pytest.raises(UsageError) as err:
        parse_hub_location("hf://just-a-name")
    assert str(err.value) == "'hf://just-a-name' is not a Hub location; write hf://ORG/NAME or hf://ORG/NAME@REVISION"


def test_plan_requests_bridges_a_gap_exactly_when_it_costs_less_than_a_request() -> None:
    # 50 ms round trips shared by 16 requests in flight: 3.125 ms a request; at 25 MB/s
    # that is what 78,125 bytes cost.
    far = LinkCost(rtt=0.05, bandwidth=25e6, parallel=16)
    assert far.per_request == 0.05 / 16 and far.gap_worth_bridging == 78_125
    rows = [Span(i * 100, (i + 1) * 100) for i in range(40)]  # adjacent: always one request
    assert plan_requests(rows, far) == [Span(0, 4000)]
    assert plan_requests([*rows, Span(4000 + 78_125, 82_225)], far) == [Span(0, 82_225)]
    assert plan_requests([*rows, Span(4000 + 78_126, 82_226)], far) == [Span(0, 4000), Span(82_126, 82_226)]
    # On a loopback link a request costs its CPU (2 ms), and 1 GB/s makes 2 MB gaps cheap.
    near = LinkCost(rtt=0.0002, bandwidth=1e9, parallel=32)
    assert near.per_request == REQUEST_CPU == 0.002 and near.gap_worth_bridging == 2_000_000
    assert plan_requests([Span(0, 10), Span(900_000, 900_010)], near) == [Span(0, 900_010)]
    assert plan_requests([Span(0, 10), Span(900_000, 900_010)], far) == [Span(0, 10), Span(900_000, 900_010)]
    # No response is larger than MAX_REQUEST: a large span is cut into pieces.
    big = plan_requests([Span(0, 2 * MAX_REQUEST + 5)], far)
    assert big == [Span(0, MAX_REQUEST), Span(MAX_REQUEST, 2 * MAX_REQUEST), Span(2 * MAX_REQUEST, 2 * MAX_REQUEST + 5)]


def test_fetch_estimates_pick_the_faster_of_ranges_and_download() -> None:
    far = LinkCost(rtt=0.05, bandwidth=25e6, parallel=16)
    # 6,400 rows of 2 KiB from a 335 MB shard: 6,400 requests at 3.125 ms, 13 MB; or 13.4 s
    assert far.ranges_time(6400, 6400 * 2048) == pytest.approx(0.05 + 20.0 + 0.524288)
    assert far.download_time(335_544_320) == pytest.approx(0.1 + 13.4217728)
    near = LinkCost(rtt=0.0002, bandwidth=1e9, parallel=32)
    assert near.ranges_time(6400, 6400 * 2048) > near.download_time(335_544_320)


def test_fetch_option_and_link_variable_are_parsed_strictly(monkeypatch: pytest.MonkeyPatch) -> None:
    assert split_fetch_option("org/v@main?fetch=download") == ("org/v@main", "download")
    assert split_fetch_option("hf://org/v?fetch=ranges") == ("hf://org/v", "ranges")
    assert split_fetch_option("org/v@main") == ("org/v@main", None)
    with pytest.raises(UsageError) as err:
        split_fetch_option("org/v@main?fetch=fast")
    assert str(err.value) == ("'org/v@main?fetch=fast': fetch='fast' is not one of auto, ranges, download; write "
                              "ORG/NAME@REVISION?fetch=auto|ranges|download")
    monkeypatch.setenv("CKPTXFORM_HUB_LINK", "rtt=0.02,bandwidth=1e8")
    assert link_cost() == LinkCost(rtt=0.02, bandwidth=1e8, parallel=32)
    monkeypatch.setenv("CKPTXFORM_HUB_LINK", "rtt=20ms")
    with pytest.raises(UsageError) as err:
        link_cost()
    assert str(err.value) == ("CKPTXFORM_HUB_LINK='rtt=20ms': write rtt=SECONDS,bandwidth=BYTES_PER_SECOND, "
                              "e.g. rtt=0.05,bandwidth=25e6")


def test_range_cache_serves_spans_across_pieces_and_across_instances(tmp_path: Path) -> None:
    cache = RangeCache.for_file(tmp_path, "c" * 40, "model.safetensors")
    data = bytes(range(256)) * 4
    cache.put(0, data[:100])
    cache.put(50, data[50:300])  # overlaps: only [100, 300) is stored
    cache.set_size(len(data))
    assert sorted(p.name for p in cache.folder.iterdir()) == ["0-100", "100-300", "size"]
    again = RangeCache.for_file(tmp_path, "c" * 40, "model.safetensors")
    assert again.get(Span(20, 280)) == data[20:280]
    assert again.get(Span(250, 301)) is None
    assert again.size() == len(data)
