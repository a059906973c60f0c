"""The sources a user gives are the ones the output names (issue 35 item 4).

``eagle3_to_speculators`` writes ``speculators_config.verifier``: the verifier the drafter
serves with. Given ``--source verifier=LOC``, it names LOC as given (a local path, which
speculators and vLLM then load offline; a Hub repo, whose commit the audit pins) with the
``architectures`` of that verifier's config.json, as speculators' own converter writes
them; without it, the rule's default repo, never opened.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import REPO, read_audit, source_args
from hub_fixtures import ProxyTrap, client_env
from hubserver import HubServer

from ckptxform import api
from ckptxform.standins.dflash import build_qwen3_verifier
from ckptxform.standins.drafters import build_llama_eagle3

RULE = REPO / "rules" / "eagle3_to_speculators.yaml"


def _verifier_named(out: Path) -> dict[str, object]:
    return json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]


def test_a_local_verifier_is_named_as_given_with_the_architectures_of_its_config(
        tmp_path: Path, monkeypatch, run_cli) -> None:
    drafter = build_llama_eagle3(tmp_path / "drafter").path
    build_qwen3_verifier(tmp_path / "my-verifier")
    monkeypatch.chdir(tmp_path)
    result = run_cli("apply", RULE, *source_args({"drafter": str(drafter), "verifier": "my-verifier"}),
                     "--out", tmp_path / "out", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert _verifier_named(tmp_path / "out") == {"name_or_path": "my-verifier",
                                                 "architectures": ["Qwen3ForCausalLM"]}
    run = read_audit(tmp_path / "out")[0]
    assert run["sources"]["verifier"]["location"] == "my-verifier"


def test_a_verifier_not_given_is_the_rules_default_and_is_not_opened(tmp_path: Path) -> None:
    drafter = build_llama_eagle3(tmp_path / "drafter").path
    result = api.apply(RULE, out=tmp_path / "out", sources={"drafter": str(drafter)}, progress=False)
    assert _verifier_named(result.out) == {"name_or_path": "meta-llama/Llama-3.1-8B-Instruct",
                                           "architectures": ["LlamaForCausalLM"]}
    assert set(read_audit(result.out)[0]["sources"]) == {"drafter"}


def test_a_hub_verifier_is_named_by_its_repo_and_pinned_by_its_commit_in_the_audit(tmp_path: Path) -> None:
    drafter = build_llama_eagle3(tmp_path / "drafter").path
    verifier = build_qwen3_verifier(tmp_path / "verifier").path
    trap = ProxyTrap()
    try:
        with HubServer() as server:
            commit = server.add_repo("ORG/Qwen3-8B", verifier)
            env = client_env(server, tmp_path / "home", trap, HF_HUB_CACHE=str(tmp_path / "home" / "hub"))
            result = subprocess.run(
                [sys.executable, "-m", "ckptxform", "apply", str(RULE), "--source", f"drafter={drafter}",
                 "--source", "verifier=ORG/Qwen3-8B", "--out", str(tmp_path / "out")],
                env=env, cwd=REPO, capture_output=True, text=True, timeout=180, check=False)
    finally:
        trap.close()
    assert result.returncode == 0, result.stderr
    assert trap.lines == [], "a request left 127.0.0.1"
    assert _verifier_named(tmp_path / "out") == {"name_or_path": "ORG/Qwen3-8B",
                                                 "architectures": ["Qwen3ForCausalLM"]}
    assert read_audit(tmp_path / "out")[0]["sources"]["verifier"]["commit"] == commit
