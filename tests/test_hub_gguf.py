"""A GGUF model in a Hub repo as a source (issue 38 item 1): one ``.gguf`` file or llama.cpp's
split set, named in the location (``ORG/NAME@REV/PATH.gguf``) or the repo's only GGUF model,
read by byte range through the real huggingface_hub client against ``hubserver.HubServer``
(.gguf files are LFS files there, served by its CDN, as on the Hub).

Only the headers are read to plan (``inspect`` transfers a few KB of a multi-MB file);
``apply`` from the Hub writes the same bytes as from the local files; a repo of several
GGUF models is refused, naming them, as is a later part of a split set.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO, assert_clean_failure, read_audit
from hub_fixtures import ProxyTrap, body_bytes, client_env
from hubserver import HubServer

from ckptxform import api
from ckptxform.standins.gguf_models import QWEN2_GGUF, GgufDims, build_llama_gguf

pytest.importorskip("gguf")

RULE = REPO / "rules" / "gguf_to_hf.yaml"
#: big enough that a header read is a small part of each file (the token embedding is 2.2 MB)
DIMS = GgufDims(hidden=512, heads=8, kv_heads=2, head_dim=48, intermediate=1000, layers=2, vocab=4096)


class Hub:
    def __init__(self, server: HubServer, trap: ProxyTrap, root: Path) -> None:
        self.server, self.trap, self.root = server, trap, root

    def run(self, home: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
        """``ckptxform ARGS`` against the server, ``home`` its HF_HOME, the log cleared first."""
        self.server.clear_log()
        env = {k: v for k, v in client_env(self.server, home, self.trap, HF_HUB_CACHE=str(home / "hub-cache"),
                                           NO_COLOR="1").items() if k != "CKPTXFORM_DEBUG"}
        command = [sys.executable, "-m", "ckptxform", *map(str, args)]
        return subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    root = tmp_path_factory.mktemp("hub-gguf")
    # a repo of one split set (and a README), a repo of two quant types, one in a folder
    build_llama_gguf(root / "split" / "tiny-Q8_0.gguf", dims=DIMS, qtype="Q8_0", seed=4, split_max_tensors=9)
    (root / "split" / "README.md").write_text("a model card\n")
    build_llama_gguf(root / "many" / "tiny-Q4_K.gguf", dims=DIMS, qtype="Q4_K", seed=5)
    build_llama_gguf(root / "many" / "Q6_K" / "tiny-Q6_K.gguf", dims=DIMS, qtype="Q6_K", seed=6, split_max_tensors=12)
    build_llama_gguf(root / "qwen" / "qwen2-q8_0.gguf", dims=QWEN2_GGUF, qtype="Q8_0", arch="qwen2", tied=True)
    trap = ProxyTrap()
    with HubServer() as server:
        server.add_repo("org/tiny-GGUF", root / "split")
        server.add_repo("org/many-GGUF", root / "many")
        server.add_repo("org/qwen-GGUF", root / "qwen")
        yield Hub(server, trap, root)
    trap.close()


def test_inspect_reads_the_headers_only(hub: Hub, tmp_path: Path) -> None:
    proc = hub.run(tmp_path / "home", "inspect", "org/tiny-GGUF@main")
    assert proc.returncode == 0, proc.stderr
    assert ": GGUF" in proc.stdout or "GGUF metadata" in proc.stdout
    assert "blk.1.ffn_down.weight" in proc.stdout and "Q8_0" in proc.stdout
    parts = sorted((hub.root / "split").glob("*.gguf"))
    assert len(parts) == 3
    sent = body_bytes(hub.server.log, ".gguf")
    assert 0 < sent <= 3 * 256 * 1024 < sum(p.stat().st_size for p in parts) / 3


@pytest.mark.parametrize(("location", "local"), [
    ("org/tiny-GGUF@main", "split/tiny-Q8_0-00001-of-00003.gguf"),
    ("org/many-GGUF@main/tiny-Q4_K.gguf", "many/tiny-Q4_K.gguf"),
    ("hf://org/many-GGUF/Q6_K/tiny-Q6_K-00001-of-00002.gguf", "many/Q6_K/tiny-Q6_K-00001-of-00002.gguf"),
    ("org/qwen-GGUF@main", "qwen/qwen2-q8_0.gguf"),
])
def test_apply_from_the_hub_writes_what_the_local_files_give(hub: Hub, tmp_path: Path, location: str,
                                                             local: str) -> None:
    rule = RULE.with_name("gguf_qwen2_to_hf.yaml") if "qwen" in location else RULE
    want = api.apply(str(rule), out=tmp_path / "local", sources={"model": str(hub.root / local)},
                     progress=False).out
    proc = hub.run(tmp_path / "home", "apply", rule, "--source", f"model={location}", "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (want / "model.safetensors").read_bytes()
    assert (tmp_path / "out" / "config.json").read_text() == (want / "config.json").read_text()
    notes = [e for e in read_audit(tmp_path / "out") if e["event"] == "metadata"]
    assert notes == [e for e in read_audit(want) if e["event"] == "metadata"]
    assert len(notes) == ("qwen" in location)  # the stand-in Llamas hold no tokenizer


def test_a_repo_of_several_models_is_refused_naming_them(hub: Hub, tmp_path: Path) -> None:
    err = assert_clean_failure(hub.run(tmp_path / "home", "inspect", "org/many-GGUF@main"))
    assert "holds 2 GGUF models ('Q6_K/tiny-Q6_K-00001-of-00002.gguf', 'tiny-Q4_K.gguf')" in err
    assert "org/many-GGUF@" in err and "/FILE.gguf" in err


@pytest.mark.parametrize(("location", "message"), [
    ("org/many-GGUF@main/Q6_K/tiny-Q6_K-00002-of-00002.gguf", "name its first part 'Q6_K/tiny-Q6_K-00001-of-00002.gguf'"),
    ("org/many-GGUF@main/tiny-Q5_K.gguf", "has no 'tiny-Q5_K.gguf'"),
])
def test_a_file_that_is_not_a_model_is_one_clear_error(hub: Hub, tmp_path: Path, location: str,
                                                       message: str) -> None:
    err = assert_clean_failure(hub.run(tmp_path / "home", "inspect", location))
    assert message in err
