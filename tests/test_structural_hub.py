"""Op chains over a Hub source (the real huggingface_hub client against tests/hubserver.py):
the same bytes as from the local folder, in a few requests, not a range per row."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import read_output
from hub_fixtures import ProxyTrap, client_env
from hubserver import HubServer
from test_structural_engine import MIXTRAL_RULE, assert_same, mixtral_legacy, rand, rule_file, write_model

from ckptxform import api

RULE = MIXTRAL_RULE.replace("  - match: '.+'\n", "  - key: 'h.{N}.mlp.c_fc.weight'\n    ops: [{transpose: [0, 1]}]\n"
                            "  - match: '.+'\n")


def test_stack_concat_and_transpose_from_the_hub(tmp_path: Path) -> None:
    src = mixtral_legacy(3)
    src["h.0.mlp.c_fc.weight"] = rand(40, 24, seed=9)
    write_model(tmp_path / "src", src, {"num_local_experts": 3})
    rules = rule_file(tmp_path, RULE)
    api.apply(rules, out=tmp_path / "local", sources={"model": str(tmp_path / "src")}, progress=False)
    trap = ProxyTrap()
    try:
        with HubServer() as server:
            server.add_repo("ORG/M", tmp_path / "src")
            env = client_env(server, tmp_path / "home", trap, HF_HUB_CACHE=str(tmp_path / "cache"))
            env.pop("CKPTXFORM_DEBUG", None)
            proc = subprocess.run([sys.executable, "-m", "ckptxform", "apply", str(rules), "--source",
                                   "model=hf://ORG/M", "--out", str(tmp_path / "hub")], env=env,
                                  capture_output=True, text=True, timeout=180, check=False)
            assert proc.returncode == 0, proc.stderr
            weights = [r for r in server.log if r.path.endswith("/model.safetensors") and r.method == "GET"]
    finally:
        trap.close()
    assert_same(read_output(tmp_path / "hub"), read_output(tmp_path / "local"))
    # a few requests (the header's first 256 KiB holds all of this small file; else the file
    # downloaded or read in large ranges), not a range request per row or expert
    assert 1 <= len(weights) <= 3, [r.range for r in weights]
    assert trap.lines == []
