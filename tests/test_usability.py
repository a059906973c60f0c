"""What a new user meets first: the rule library by name, -q/-v anywhere, --json for every
outcome, a silent library, a demo whose commands run as printed."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import PRIVATE_CACHE, REPO, assert_clean_failure, read_audit, source_args

from ckptxform import load_rules
from ckptxform.rules.catalogue import shipped_rules
from ckptxform.standins import HeadlineStandins

SHIPPED = sorted(p.stem for p in (REPO / "rules").glob("*.yaml"))


# --- the rule library by name ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["aqmedai_k2_to_k25", "aqmedai-k2-to-k25", "aqmedai_k2_to_k25.yaml"])
def test_apply_finds_a_shipped_rule_by_stem_or_name_from_any_directory(
        name: str, headline: HeadlineStandins, run_cli: Any, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run_cli("apply", name, *source_args(headline.sources), "--out", "OUT", cwd=empty)
    assert proc.returncode == 0, proc.stderr
    run = read_audit(empty / "OUT")[0]
    assert run["rules"] == str(REPO / "rules" / "aqmedai_k2_to_k25.yaml")
    assert run["name"] == "aqmedai-k2-to-k25"


def test_a_local_file_wins_over_the_library(tmp_path: Path) -> None:
    local = tmp_path / "aqmedai_k2_to_k25"
    local.write_text("version: 1\nname: mine\nsources: {a: {path: a}}\ntensors: []\n")
    assert load_rules(local).name == "mine"
    assert load_rules("aqmedai_k2_to_k25").name == "aqmedai-k2-to-k25"


def test_an_unknown_name_lists_the_library(run_cli: Any, tmp_path: Path) -> None:
    proc = run_cli("plan", "aqmedai_k2_to_k52", cwd=tmp_path)
    assert_clean_failure(proc, 2)
    assert proc.stderr.splitlines() == [
        f"'aqmedai_k2_to_k52': no such rule file, and no shipped rule has that file stem or name "
        f"(shipped: {', '.join(SHIPPED)}; `ckptxform rules` describes them); did you mean 'aqmedai_k2_to_k25'?"]


def test_a_missing_path_is_still_file_not_found(run_cli: Any, tmp_path: Path) -> None:
    proc = run_cli("validate", "rules/nothing.yaml", cwd=tmp_path)
    assert_clean_failure(proc, 2)
    assert proc.stderr.splitlines() == ["rules/nothing.yaml: file not found; check the path"]


def test_extends_may_name_a_shipped_rule(tmp_path: Path) -> None:
    child = tmp_path / "mine.yaml"
    child.write_text("version: 1\nextends: aqmedai_k2_to_k25\nname: mine\noutput: {max_shard_size: 1GB}\n")
    rules = load_rules(child)
    assert rules.name == "mine" and sorted(rules.sources) == ["drafter", "target_vocab", "verifier"]
    assert rules.files == (str(REPO / "rules" / "aqmedai_k2_to_k25.yaml"), str(child))
    # a file of that name beside the child wins over the library
    (tmp_path / "aqmedai_k2_to_k25").write_text("version: 1\nsources: {only: {path: x}}\n")
    assert sorted(load_rules(child).sources) == ["only"]


def test_rules_lists_every_shipped_rule(run_cli: Any, tmp_path: Path) -> None:
    listed = json.loads(run_cli("rules", "--json", cwd=tmp_path).stdout)
    assert [r["stem"] for r in listed] == SHIPPED
    for entry in listed:
        rules = load_rules(entry["stem"])
        assert entry["name"] == rules.name and entry["description"] == rules.description != ""
        # a trainer's checkpoint has no default location: its example is shown
        assert entry["sources"] == {n: s.location.removeprefix("hf://") if s.repo or s.path
                                    else f"(give one, e.g. {s.example})" for n, s in rules.sources.items()}
    text = run_cli("rules", cwd=tmp_path).stdout
    for rule in shipped_rules():
        assert f"{rule.stem}  ({rule.name})" in text and rule.description in text
    assert "aqmedai_k2_to_k25_sglang  (aqmedai-k2-to-k25-sglang)  extends aqmedai_k2_to_k25" in text


# --- -q / -v anywhere, --json for every outcome ----------------------------------------------

def test_quiet_and_verbose_work_after_the_subcommand(headline: HeadlineStandins, run_cli: Any,
                                                    tmp_path: Path) -> None:
    args = ("apply", "aqmedai_k2_to_k25", *source_args(headline.sources), "--out", tmp_path / "out")
    assert run_cli(*args).returncode == 0
    loud = run_cli(*args)  # a rerun says once, on stdout, that it is up to date
    assert loud.returncode == 0 and "is up to date" in loud.stdout and loud.stderr == ""
    for flag in ("-q", "--quiet"):
        quiet = run_cli(*args, flag)
        assert quiet.returncode == 0 and quiet.stderr == quiet.stdout == "", quiet.stderr
    assert run_cli("-q", *args).stderr == ""
    assert "is up to date" in run_cli(*args, "-v").stderr
    plan = ("plan", "aqmedai_k2_to_k25", *source_args(headline.sources))
    before, after, short = run_cli("-v", *plan).stdout, run_cli(*plan, "--verbose").stdout, run_cli(*plan).stdout
    assert before == after != short  # -v lists every tensor not written out, wherever it is given


def test_json_usage_errors_are_json_on_stdout(run_cli: Any) -> None:
    proc = run_cli("apply", "aqmedai_k2_to_k25", "--json")
    assert_clean_failure(proc, 2)
    assert json.loads(proc.stdout) == {"status": "failed", "exit_code": 2, "error": "UsageError",
                                       "messages": ["Missing option '--out'."]}
    assert "Error: Missing option '--out'." in proc.stderr  # click's own text stays on stderr
    bad = run_cli("plan", "aqmedai_k2_to_k25", "--json", "--frobnicate")
    assert json.loads(bad.stdout)["messages"] == ["No such option '--frobnicate'."]
    assert run_cli("apply", "aqmedai_k2_to_k25").stdout == ""  # without --json, stdout stays empty


def test_validate_json(run_cli: Any, tmp_path: Path) -> None:
    ok = run_cli("validate", "aqmedai_k2_to_k25", "prune-draft-vocab", "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout) == {"status": "ok", "valid": [
        {"rules": "aqmedai_k2_to_k25", "file": str(REPO / "rules" / "aqmedai_k2_to_k25.yaml"),
         "name": "aqmedai-k2-to-k25"},
        {"rules": "prune-draft-vocab", "file": str(REPO / "rules" / "prune_draft_vocab.yaml"),
         "name": "prune-draft-vocab"}]}
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 2\n")
    failed = run_cli("validate", "aqmedai_k2_to_k25", bad, "--json")
    assert_clean_failure(failed, 2)
    obj = json.loads(failed.stdout)
    assert obj["status"] == "failed" and obj["error"] == "RuleError"
    assert obj["messages"] == [f"{bad}:1:10: version: expected 1, got 2"]


# --- as a library ----------------------------------------------------------------------------

_LIBRARY_RUN = """
import sys
{prelude}
import ckptxform
{enable}
sources = dict(arg.split("=", 1) for arg in sys.argv[2:])
for _ in range(2):  # the second run is up to date: ckptxform logs that at INFO
    result = ckptxform.apply("aqmedai_k2_to_k25", out=sys.argv[1], sources=sources)
print(result.out.is_absolute(), result.audit_path.is_absolute(), result.out)
"""


@pytest.mark.parametrize(("prelude", "enable", "logs"), [
    ("", "", False),
    ("from loguru import logger", "", False),
    ("", "from loguru import logger; logger.enable('ckptxform')", True),
    ("from loguru import logger; logger.enable('ckptxform')", "", True),
])
def test_the_library_logs_nothing_unless_enabled(prelude: str, enable: str, logs: bool,
                                                 headline: HeadlineStandins, tmp_path: Path) -> None:
    code = _LIBRARY_RUN.format(prelude=prelude, enable=enable)
    proc = subprocess.run([sys.executable, "-c", code, "out", *(f"{n}={loc}" for n, loc in headline.sources.items())],
                          capture_output=True, text=True, cwd=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True", str(tmp_path / "out")]
    if logs:
        assert "is up to date" in proc.stderr
    else:
        assert proc.stderr == ""


def test_the_open_sources_of_a_plan_are_a_context_manager(headline: HeadlineStandins) -> None:
    import ckptxform
    from ckptxform import api

    plan, opened = api.plan_open("aqmedai_k2_to_k25", sources=headline.sources)
    with opened:
        ckpts = list(opened.checkpoints.values())
        assert ckpts and not any(getattr(c, "_closed", False) for c in ckpts)
    assert all(getattr(c, "_closed") for c in ckpts)
    # a plan is a value; code written for the plan that held its sources still runs
    with ckptxform.plan("aqmedai_k2_to_k25", sources=headline.sources) as again:
        assert again.outputs == plan.outputs


# --- the demo ----------------------------------------------------------------------------------

def test_the_demo_prints_commands_that_run_as_printed(run_cli: Any, tmp_path: Path) -> None:
    demo = run_cli("demo", "--out", tmp_path / "demo dir", cwd=tmp_path)
    assert demo.returncode == 0, demo.stderr
    commands = [line[2:] for line in demo.stdout.splitlines() if line.startswith("$ ckptxform ")]
    assert [c.split()[:2] for c in commands] == [["ckptxform", "plan"], ["ckptxform", "apply"]]
    assert "..." not in "".join(commands)
    assert f"stay in {tmp_path / 'demo dir'}; remove them with: rm -r {shlex.quote(str(tmp_path / 'demo dir'))}" \
        in demo.stdout
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for command in commands:
        args = shlex.split(command)[1:]
        proc = run_cli(*args, cwd=elsewhere)
        assert proc.returncode == 0, (command, proc.stderr)
    assert "is up to date" in proc.stdout  # the printed apply is the one the demo ran


def test_the_tests_use_a_private_cache(run_cli: Any, tmp_path: Path) -> None:
    """Tests never write to the user's ~/.cache/ckptxform (conftest points CKPTXFORM_CACHE_DIR
    at a temporary directory before any test module is imported)."""
    from ckptxform.rules.validity_cache import cache_dir

    assert cache_dir() == PRIVATE_CACHE and not PRIVATE_CACHE.is_relative_to(Path.home() / ".cache")
    rule = tmp_path / "fresh.yaml"
    rule.write_text(textwrap.dedent("""\
        version: 1
        name: written-to-the-private-cache
        sources: {a: {path: a}}
        tensors: []
        """))
    before = set((PRIVATE_CACHE / "valid-rules").glob("*")) if (PRIVATE_CACHE / "valid-rules").exists() else set()
    assert run_cli("validate", rule).returncode == 0
    assert len(set((PRIVATE_CACHE / "valid-rules").glob("*")) - before) == 1
