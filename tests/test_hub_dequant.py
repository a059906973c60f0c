"""An FP8 block dequant whose source is a Hub repo (the test server): each worker of
quant/pipeline.then_in_order reads its own blocks, so the Hub source is read by several
threads, one at a time; the output is byte for byte the one made from the local folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptxform import api
from ckptxform.ops import dequant
from ckptxform.standins.quantized import build_kimi_k2

REPO = Path(__file__).resolve().parent.parent
RULE = REPO / "rules" / "fp8_block_to_bf16.yaml"
#: a block of rows a task, so that every FP8 weight is many tasks and both workers read
CHUNK = 4096

APPLY_FROM_HUB = """
import threading
from ckptxform import api
from ckptxform.ops import dequant
from ckptxform.sources.hub.checkpoint import HubCheckpoint

dequant.FP8_CHUNK_BYTES = CHUNK
readers = set()
read = HubCheckpoint.read

def reading(self, *args, **kwargs):
    readers.add(threading.current_thread().name)
    return read(self, *args, **kwargs)

HubCheckpoint.read = reading
result = api.apply(RULE, out=OUT, sources={"model": "hf://org/kimi-k2-fp8@main"}, progress=False)
emit(out=str(result.out), readers=sorted(readers))
"""


def test_an_fp8_dequant_from_the_hub_is_the_local_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hub_fixtures import ProxyTrap, client_env, run_client
    from hubserver import HubServer

    model = build_kimi_k2(tmp_path / "Kimi-K2-Instruct", num_shards=3, seed=5)
    monkeypatch.setattr(dequant, "FP8_CHUNK_BYTES", CHUNK)
    local = api.apply(RULE, out=tmp_path / "local", progress=False, sources={"model": str(model.path)})
    trap = ProxyTrap()
    try:
        with HubServer() as server:
            server.add_repo("org/kimi-k2-fp8", model.path)
            env = client_env(server, tmp_path / "home", trap)
            run = run_client(f"RULE, OUT, CHUNK = {str(RULE)!r}, {str(tmp_path / 'hub')!r}, {CHUNK}\n"
                             + APPLY_FROM_HUB, env)
        assert run.returncode == 0, run.stderr
        assert trap.lines == []
    finally:
        trap.close()
    readers = run.records[-1]["readers"]
    if (os.cpu_count() or 1) > 1:  # two workers: a helper thread read too
        assert any(name.startswith("ckptxform-block") for name in readers), readers
    written = sorted(p.name for p in local.out.iterdir() if p.name != "ckptxform_audit.jsonl")  # its times differ
    assert any(name.endswith(".safetensors") for name in written), written
    assert sorted(p.name for p in (tmp_path / "hub").iterdir() if p.name != "ckptxform_audit.jsonl") == written
    for name in written:
        assert (tmp_path / "hub" / name).read_bytes() == (local.out / name).read_bytes(), name
