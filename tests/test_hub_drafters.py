"""The MTP rules with the verifier on the Hub: the real ``ckptxform`` command and the real
huggingface_hub client against ``hubserver.HubServer``, every count from its request log.

The verifier (ORG/QN) is a Qwen3-Next stand-in in five shards, its MTP layer in a shard of
its own, each shard larger than the first read of a header (256 KiB), so that the bytes a
run moves show which tensors it read. ``mtp_extract`` asks for nothing of the four main-stack
shards; ``mtp_graft`` writes the same bytes as the local graft, fetches no byte twice and
of the verifier's own MTP shard (replaced) only its header.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO, read_audit, read_output, same_bits
from hub_fixtures import ProxyTrap, client_env, file_requests
from hubserver import HubServer, LoggedRequest

from ckptxform import api
from ckptxform.sources.hub.checkpoint import SPECULATIVE_HEADER
from ckptxform.standins.mtp import Qwen3NextDims, build_qwen3_next_verifier

RULES = REPO / "rules"
VERIFIER = "ORG/QN"
#: main-stack shards of ~0.8 MB, an MTP shard of ~0.5 MB: all beyond a header's first read
HUB_DIMS = Qwen3NextDims(hidden=128, heads=4, kv_heads=2, head_dim=32, experts=8, experts_per_token=2,
                         moe_intermediate=64, vocab=2048)


@dataclass
class Served:
    server: HubServer
    trap: ProxyTrap
    verifier: Path
    commit: str
    drafter: Path  # a fine-tuned MTP drafter of the verifier (other MTP values), local
    local_graft: Path  # the graft with the verifier read from its local folder

    def cli(self, home: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
        """``ckptxform ARGS`` with a fresh HF_HOME and a clean log; no request may leave 127.0.0.1."""
        env = client_env(self.server, home, self.trap, HF_HUB_CACHE=str(home / "hub-cache"), NO_COLOR="1")
        env.pop("CKPTXFORM_DEBUG", None)
        self.server.clear_log()
        self.trap.lines.clear()
        proc = subprocess.run([sys.executable, "-m", "ckptxform", *map(str, args)], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=300, check=False)
        assert self.trap.lines == [], "a request left 127.0.0.1"
        return proc


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("hub-mtp")
    verifier = build_qwen3_next_verifier(root / "QN", HUB_DIMS, seed=31, num_shards=5, mtp_shard_alone=True).path
    tuned = build_qwen3_next_verifier(root / "tuned", HUB_DIMS, seed=31, mtp_seed=310, num_shards=5,
                                      mtp_shard_alone=True).path
    drafter = api.apply(RULES / "mtp_extract.yaml", out=root / "drafter", sources={"verifier": str(tuned)},
                        progress=False).out
    local_graft = api.apply(RULES / "mtp_graft.yaml", out=root / "local-graft",
                            sources={"drafter": str(drafter), "verifier": str(verifier)}, progress=False).out
    trap = ProxyTrap()
    with HubServer() as server:
        commit = server.add_repo(VERIFIER, verifier)
        yield Served(server, trap, verifier, commit, drafter, local_graft)
    trap.close()


def _requests_of(log: list[LoggedRequest], file: str) -> list[LoggedRequest]:
    return [r for r in file_requests(log) if r.path.startswith(f"/{VERIFIER}/resolve/") and r.path.endswith(f"/{file}")]


def _spans(requests: list[LoggedRequest], size: int) -> list[tuple[int, int]]:
    """The byte spans ``[start, stop)`` bodies carried (a request without Range: the file)."""
    spans = []
    for r in requests:
        if not r.sent:
            continue  # a HEAD, a redirect
        if r.range is None:
            spans.append((0, size))
            continue
        match = re.fullmatch(r"bytes=(\d+)-(\d+)", r.range)
        assert match, r.range
        spans.append((int(match.group(1)), int(match.group(2)) + 1))
    return sorted(spans)


def _weight_map(folder: Path) -> dict[str, str]:
    return dict(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"])


def test_mtp_extract_from_the_hub_asks_nothing_of_the_main_stack_shards(served: Served, tmp_path: Path) -> None:
    out = tmp_path / "drafter"
    proc = served.cli(tmp_path / "home", "apply", RULES / "mtp_extract.yaml",
                     "--source", f"verifier={VERIFIER}@{served.commit}", "--out", out)
    assert proc.returncode == 0, proc.stderr
    weight_map = _weight_map(served.verifier)
    (mtp_file,) = {f for k, f in weight_map.items() if k.startswith("mtp.")}
    requested = {r.path.rpartition("/")[2] for r in file_requests(served.server.log)}
    # (model.safetensors: the single-file probe asked beside the index, a miss: open_hub's)
    assert requested - {"model.safetensors"} == {"config.json", "model.safetensors.index.json", mtp_file}
    assert [r.status for r in file_requests(served.server.log) if r.path.endswith("/model.safetensors")] == [404]
    size = (served.verifier / mtp_file).stat().st_size
    assert size > SPECULATIVE_HEADER
    spans = _spans(_requests_of(served.server.log, mtp_file), size)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans  # no byte fetched twice
    # the same drafter as from the local folder, and the audit still lists every verifier key
    local = api.apply(RULES / "mtp_extract.yaml", out=tmp_path / "local", sources={"verifier": str(served.verifier)},
                      progress=False).out
    got, want = read_output(out), read_output(local)
    assert sorted(got) == sorted(want) and all(same_bits(got[k], want[k]) for k in want)
    records = {e["key"]: e for e in read_audit(out) if e["event"] == "tensor"}
    assert sorted(records) == sorted(weight_map)
    assert {k for k, r in records.items() if r.get("header") == "not read"} == {
        k for k, f in weight_map.items() if f != mtp_file}


def test_mtp_graft_from_the_hub_writes_the_local_grafts_bytes_fetching_each_byte_once(
        served: Served, tmp_path: Path) -> None:
    out = tmp_path / "grafted"
    proc = served.cli(tmp_path / "home", "apply", RULES / "mtp_graft.yaml", "--source", f"drafter={served.drafter}",
                     "--source", f"verifier={VERIFIER}@{served.commit}", "--out", out)
    assert proc.returncode == 0, proc.stderr
    names = sorted(p.name for p in served.local_graft.iterdir() if p.name != "ckptxform_audit.jsonl")
    assert sorted(p.name for p in out.iterdir() if p.name != "ckptxform_audit.jsonl") == names
    assert [n for n in names if (out / n).read_bytes() != (served.local_graft / n).read_bytes()] == []

    weight_map = _weight_map(served.verifier)
    (mtp_file,) = {f for k, f in weight_map.items() if k.startswith("mtp.")}
    log = served.server.log
    for file in sorted(set(weight_map.values())):
        size = (served.verifier / file).stat().st_size
        spans = _spans(_requests_of(log, file), size)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), (file, spans)  # no byte fetched twice
        if file == mtp_file:  # replaced by the drafter's: its header is read (the layout), nothing else
            assert spans == [(0, SPECULATIVE_HEADER)], spans
        else:  # every byte of a main-stack shard is copied, by ranges: none left out, none twice
            assert sum(b - a for a, b in spans) == size, (file, spans)
            assert all(r.range is not None for r in _requests_of(log, file) if r.sent), file
