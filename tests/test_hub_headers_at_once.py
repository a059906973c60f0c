"""A plan that needs every shard of a sharded Hub repo reads their headers at once (issue 36
item 3): 64 shards at 50 ms round trips are a few round trips, not 64 in a row.

Asserted without a clock: in the client, each shard's header read waits at a barrier that
only opens when another header read is in flight at the same time. Read one after another,
the first read never gets past it (the barrier breaks after its timeout and the plan fails).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hub_fixtures import ProxyTrap, client_env, file_requests, run_client, write_safetensors
from hubserver import HubServer


SHARDS = 6
RULE = """version: 1
name: rename-all
sources:
  model: {path: unused}
convert: model
tensors:
  - match: 'layers\\.(\\d+)\\.w'
    rename: 'l.\\1.w'
"""

PLAN_WITH_BARRIER = """
import threading
from ckptxform import api
from ckptxform.sources.hub.checkpoint import HubCheckpoint

together = threading.Barrier(2, timeout=60)
read_header = HubCheckpoint._header_blob
overlapped = []

def header_blob(self, file):
    if file.startswith("model-"):  # a shard named by the index, not the single-file probe
        together.wait()  # raises BrokenBarrierError if no other read comes while this one waits
        overlapped.append(file)
    return read_header(self, file)

HubCheckpoint._header_blob = header_blob
plan = api.plan(RULES, sources={"model": "org/many@main"})
emit(outputs=len(plan.outputs), overlapped=sorted(overlapped))
"""


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    folder = tmp_path_factory.mktemp("many-shards")
    weight_map = {}
    for s in range(SHARDS):
        name = f"model-{s + 1:05d}-of-{SHARDS:05d}.safetensors"
        write_safetensors(folder / name, {f"layers.{s}.w": torch.full((3, 5), float(s))})
        weight_map[f"layers.{s}.w"] = name
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text('{"model_type": "llama"}')
    with HubServer() as server:
        server.add_repo("org/many", folder)
        yield server


def test_a_plan_reads_the_headers_of_the_shards_it_needs_at_once(many: HubServer, tmp_path: Path) -> None:
    rules = tmp_path / "rename.yaml"
    rules.write_text(RULE)
    trap = ProxyTrap()
    try:
        env = client_env(many, tmp_path / "home", trap)
        run = run_client(f"RULES = {str(rules)!r}\n" + PLAN_WITH_BARRIER, env)
    finally:
        trap.close()
    assert run.returncode == 0, run.stderr
    (record,) = run.records
    assert record["outputs"] == SHARDS
    assert record["overlapped"] == sorted(f"model-{s + 1:05d}-of-{SHARDS:05d}.safetensors" for s in range(SHARDS))


PLAN_WITH_ONE_HEADER_KEPT = """
from ckptxform import api
from ckptxform.sources import lazy_index

lazy_index.HEADER_CACHE_BYTES = 1  # the header read last kept: every other read again when asked
reads = []
keep = lazy_index.LazyTensors._keep

def counted(self, file, columns):
    reads.append(file)
    return keep(self, file, columns)

lazy_index.LazyTensors._keep = counted
plan = api.plan(RULES, sources={"model": "org/many@main"})
emit(outputs=len(plan.outputs), reads=len(reads), files=len(set(reads)))
"""


def test_a_header_dropped_and_read_again_comes_from_the_range_cache_not_the_hub(
        many: HubServer, tmp_path: Path) -> None:
    rules = tmp_path / "rename.yaml"
    rules.write_text(RULE)
    trap = ProxyTrap()
    try:
        env = client_env(many, tmp_path / "home", trap)
        many.clear_log()
        run = run_client(f"RULES = {str(rules)!r}\n" + PLAN_WITH_ONE_HEADER_KEPT, env)
    finally:
        trap.close()
    assert run.returncode == 0, run.stderr
    (record,) = run.records
    assert record["outputs"] == SHARDS and record["files"] == SHARDS
    assert record["reads"] > SHARDS  # some were read again
    # one request a shard (its header, speculatively with its first bytes), however often read
    shard_requests = [r for r in file_requests(many.log) if "/model-" in r.path and r.range is not None]
    assert len(shard_requests) == SHARDS, [(r.path, r.range) for r in shard_requests]
