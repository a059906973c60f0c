"""What the command line says (issue 24 items 3 and 5): quiet means quiet, ``--json``
before the subcommand, "up to date" once, summary lines that tell what this run wrote
apart from what OUT holds (after a resume, after ``finalize``), and a refusal that says
OUT came from another rule or other sources.

Runs on the Mixtral stand-in of ``demo mixtral_legacy_to_fused`` with a small shard size,
so the output has several shards and ``--shard-of`` ranks leave a job to resume.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

from ckptxform.cli.report import _human_bytes
from ckptxform.standins.for_rules import STANDINS


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A sharded variant of mixtral_legacy_to_fused and the stand-in it converts."""
    root = tmp_path_factory.mktemp("report-lines")
    rule = root / "mixtral_sharded.yaml"
    text = (REPO / "rules" / "mixtral_legacy_to_fused.yaml").read_text()
    rule.write_text(text.replace("../schemas/", f"{REPO}/schemas/") + "\noutput:\n  max_shard_size: 64KB\n")
    [model] = STANDINS["mixtral_legacy_to_fused"].build(root / "sources").values()
    return rule, model


def apply_args(mixtral: tuple[Path, str], out: Path, *extra: str) -> list[Any]:
    rule, model = mixtral
    return ["apply", rule, "--source", f"model={model}", "--out", out, *extra]


def shard_count(out: Path) -> int:
    return len(set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values()))


def holds(run_cli: Any, out: Path) -> str:
    """What OUT holds, as the summary says it, from OUT's own headers."""
    seen = json.loads(run_cli("inspect", out, "--json").stdout)
    files = shard_count(out)
    return f"{out} holds {len(seen['tensors'])} tensors, {_human_bytes(seen['total_bytes'])} in {files} files"


def test_quiet_apply_prints_nothing_but_warnings(mixtral: tuple[Path, str], run_cli: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    rank = run_cli(*apply_args(mixtral, out, "--shard-of", "0/2", "-q"))
    assert (rank.returncode, rank.stdout, rank.stderr) == (0, "", "")
    # a warning still shows under -q, alone: the interrupted job --no-resume discards
    fresh = run_cli("-q", *apply_args(mixtral, out, "--no-resume"))
    assert (fresh.returncode, fresh.stdout) == (0, "")
    [warning] = fresh.stderr.splitlines()
    assert warning.startswith("WARNING ") and "--no-resume starts over" in warning
    again = run_cli(*apply_args(mixtral, out, "--quiet"))
    assert (again.returncode, again.stdout, again.stderr) == (0, "", "")
    checked = run_cli("verify", out, "-q")
    assert (checked.returncode, checked.stdout, checked.stderr) == (0, "", "")
    loud = run_cli(*apply_args(mixtral, out))  # without -q the same run reports
    assert loud.stdout.splitlines()[0] == (f"{out} is up to date (same plan from the same inputs, verified); "
                                           "nothing written")


def test_up_to_date_is_said_once(mixtral: tuple[Path, str], run_cli: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run_cli(*apply_args(mixtral, out)).returncode == 0
    again = run_cli(*apply_args(mixtral, out))
    assert again.returncode == 0
    assert again.stdout.splitlines() == [
        f"{out} is up to date (same plan from the same inputs, verified); nothing written",
        f"audit: {out / 'ckptxform_audit.jsonl'}"]
    assert again.stderr == ""


def test_json_before_the_subcommand(mixtral: tuple[Path, str], run_cli: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = run_cli("--json", *apply_args(mixtral, out))
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["status"] == "ok"
    # -q does not silence the JSON object asked for
    assert json.loads(run_cli("-q", "--json", *apply_args(mixtral, out)).stdout)["status"] == "up_to_date"
    assert json.loads(run_cli("--json", "verify", out).stdout)["status"] == "ok"
    missing = run_cli("--json", "apply", mixtral[0])
    assert missing.returncode == 2
    assert json.loads(missing.stdout)["messages"] == ["Missing option '--out'."]
    none = run_cli("--json", "invert", mixtral[0])
    assert none.returncode == 2
    assert json.loads(none.stdout)["messages"] == ["--json: the invert command has no JSON output; drop --json"]


def test_the_summary_after_a_resume_says_what_this_run_wrote(mixtral: tuple[Path, str], run_cli: Any,
                                                             tmp_path: Path) -> None:
    out = tmp_path / "out"
    rank = json.loads(run_cli(*apply_args(mixtral, out, "--shard-of", "0/2", "--json")).stdout)
    kept = rank["shards_of_rank"]
    resumed = run_cli(*apply_args(mixtral, out, "--jobs", "1"))
    assert resumed.returncode == 0, resumed.stderr
    files = shard_count(out)
    assert kept < files
    total = json.loads(run_cli("inspect", out, "--json").stdout)["total_bytes"]
    lines = resumed.stdout.splitlines()
    assert lines[-3] == (f"resumed {out}: kept {kept} of {files} shard(s) finished earlier (by an interrupted run "
                         f"or --shard-of ranks); this run wrote the other {files - kept} "
                         f"({_human_bytes(total - rank['bytes_written'])})")
    assert lines[-2] == holds(run_cli, out)
    assert lines[-1] == f"audit: {out / 'ckptxform_audit.jsonl'}"


def test_the_summary_after_finalize_says_it_wrote_no_tensor_data(mixtral: tuple[Path, str], run_cli: Any,
                                                                 tmp_path: Path) -> None:
    out = tmp_path / "out"
    for rank in ("0/2", "1/2"):
        assert run_cli(*apply_args(mixtral, out, "--shard-of", rank)).returncode == 0
    rule, model = mixtral
    done = run_cli("finalize", rule, "--source", f"model={model}", "--out", out)
    assert done.returncode == 0, done.stderr
    files = shard_count(out)
    assert done.stdout.splitlines()[-3:] == [
        f"committed {out} from the {files} shard(s) finished earlier (by --shard-of ranks or an interrupted run); "
        "this run wrote no tensor data",
        holds(run_cli, out),
        f"audit: {out / 'ckptxform_audit.jsonl'}"]


def test_an_output_of_another_rule_and_sources_is_refused_saying_so(run_cli: Any, tmp_path: Path) -> None:
    [llama] = STANDINS["untie_embeddings"].build(tmp_path / "tied").values()
    [phi3] = STANDINS["phi3_to_llama"].build(tmp_path / "phi3").values()
    out = tmp_path / "out"
    assert run_cli("apply", "untie_embeddings", "--source", f"model={llama}", "--out", out).returncode == 0
    refused = run_cli("apply", "phi3_to_llama", "--source", f"model={phi3}", "--out", out)
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.splitlines() == [
        f"error: '{out}' already exists and was made by another rule ('untie-embeddings' from "
        f"'{REPO / 'rules' / 'untie_embeddings.yaml'}') and from other sources (model '{llama}' then, "
        f"'{phi3}' now); pass --force to replace it"]
    moved = shutil.copytree(llama, tmp_path / "elsewhere")
    same_rule = run_cli("apply", "untie_embeddings", "--source", f"model={moved}", "--out", out)
    assert same_rule.stderr.splitlines() == [
        f"error: '{out}' already exists and was made from other sources (model '{llama}' then, '{moved}' now); "
        "pass --force to replace it"]
