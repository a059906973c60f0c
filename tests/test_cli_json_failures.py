"""With --json a failure is a JSON object on stdout too, so a provisioning script can
branch on it without parsing stderr; stderr keeps its one line per problem."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from conftest import assert_clean_failure, source_args

from ckptxform.standins import HeadlineStandins


def failure(proc: subprocess.CompletedProcess[str], code: int) -> dict[str, Any]:
    assert_clean_failure(proc, code)
    obj: dict[str, Any] = json.loads(proc.stdout)
    assert obj["status"] == "failed" and obj["exit_code"] == code
    # the same problems as on stderr, one per entry (rule-file lines carry FILE:LINE:COL, not "error: ")
    prefix = "" if obj["error"] == "RuleError" else "error: "
    assert proc.stderr.splitlines()[-len(obj["messages"]):] == [prefix + m for m in obj["messages"]]
    return obj


def test_apply_json_names_the_missing_source(headline: HeadlineStandins, headline_rule: Path, run_cli: Any,
                                             tmp_path: Path) -> None:
    sources = {**headline.sources, "verifier": str(tmp_path / "no-such-verifier")}
    proc = run_cli("apply", headline_rule, *source_args(sources), "--out", tmp_path / "out", "--json")
    obj = failure(proc, 1)
    assert obj["error"] == "SourceNotFoundError"
    assert obj["source"] == "verifier"
    assert "no-such-verifier" in obj["messages"][0]
    assert not (tmp_path / "out").exists()


def test_plan_json_of_an_invalid_rule_file_lists_every_problem(tmp_path: Path, run_cli: Any) -> None:
    rule = tmp_path / "bad.yaml"
    rule.write_text("version: 1\nname: x\nsources: {a: {path: p}}\nconvert: a\nconvertt: a\n"
                    "tensors: [{match: 3}]\n")
    obj = failure(run_cli("plan", rule, "--json"), 2)
    assert obj["error"] == "RuleError" and obj["path"] == str(rule)
    assert [m.split(": ")[0] for m in obj["messages"]] == [f"{rule}:5:1", f"{rule}:6:19"]


def test_inspect_json_of_a_missing_location(tmp_path: Path, run_cli: Any) -> None:
    obj = failure(run_cli("inspect", tmp_path / "nothing", "--json"), 1)
    assert obj["error"] == "SourceNotFoundError"


def test_without_json_stdout_stays_empty(tmp_path: Path, run_cli: Any) -> None:
    proc = run_cli("inspect", tmp_path / "nothing")
    assert_clean_failure(proc, 1)
    assert proc.stdout == ""
