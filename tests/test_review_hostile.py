"""Review of issues 12 and 16 after they landed: the variations the first suites did not try.

Each case runs the real command in a subprocess on real files, like tests/test_hostile_inputs.py
(whose ``Case`` asserts the one error line, the exit code, no output and unchanged sources).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
from test_hostile_inputs import Case, make_source, write_rule


@pytest.fixture
def case(tmp_path: Path, run_cli: Any) -> Case:
    return Case(tmp_path, run_cli)


def files_rule(case: Case, glob: str = "tokenizer.json") -> Path:
    return write_rule(case.root / "r.yaml", f"sources:\n  m: {{path: m}}\ntensors:\n  - match: 'w'\n"
                      f"files:\n  - {{glob: '{glob}'}}\n")


def vocab_rule(case: Case, file: str) -> Path:
    make_source(case.root / "d", {"lm_head.weight": torch.ones(4, 2), "d2t": torch.zeros(4, dtype=torch.int64),
                                  "t2d": torch.tensor([1, 1, 1, 1, 0, 0, 0, 0], dtype=torch.bool)})
    return write_rule(case.root / "r.yaml", f"""sources: {{d: {{path: d}}}}
convert: d
vocab:
  a: {{source: d, encoding: offset}}
  b: {{file: {file}, encoding: offset}}
tensors:
  - match: 'lm_head\\.weight'
    permute_rows: {{from: a, to: b}}
    missing_rows: {{init: zeros}}
  - match: 'd2t|t2d'
    skip: replaced
""")


# ---------------------------------------------------------------- 8: bounded waits


def test_verify_does_not_wait_on_a_fifo_in_place_of_a_copied_file(case: Case) -> None:
    make_source(case.root / "m", {"w": torch.ones(2)})
    (case.root / "m" / "tokenizer.json").write_text("{}")
    assert case.run_cli("apply", files_rule(case), "--out", "out", cwd=case.root).returncode == 0
    (case.out / "tokenizer.json").unlink()
    os.mkfifo(case.out / "tokenizer.json")
    proc = case.run_cli("verify", "out", cwd=case.root, timeout=60)
    assert (proc.returncode, proc.stderr.splitlines()) == (1, [
        "error: out/tokenizer.json: is a FIFO (named pipe), not a regular file; apply copied it from source 'm' "
        "('tokenizer.json')"])


def test_fifo_vocab_file_is_named_as_a_fifo(case: Case) -> None:
    os.mkfifo(case.root / "vocab.safetensors")
    case.fails("plan", vocab_rule(case, "vocab.safetensors"), code=1, line=(
        "error: 'vocab.safetensors': is a FIFO (named pipe), not a regular file; give the path of the file itself"))


def test_fifo_t2d_beside_a_d2t_npy_is_refused_not_ignored(case: Case) -> None:
    (case.root / "vf").mkdir()
    numpy.save(case.root / "vf" / "d2t.npy", numpy.array([0, 0, 0, 1], dtype=numpy.int64))
    os.mkfifo(case.root / "vf" / "t2d.npy")
    case.fails("plan", vocab_rule(case, "vf"), code=1, line=(
        "error: 'vf/t2d.npy': is a FIFO (named pipe), not a regular file; give the path of the file itself"))


# ---------------------------------------------------------------- 9 and 12: configs


def test_config_number_beyond_a_float_is_refused_not_an_internal_error(case: Case) -> None:
    make_source(case.root / "m", {"w": torch.ones(2)}, config='{"rope_theta": 1e400}')
    rule = write_rule(case.root / "r.yaml", "sources:\n  m: {path: m}\ntensors:\n  - match: 'w'\n"
                      "config: {from: m}\n")
    case.fails("apply", rule, "--out", case.out, code=1, line=(
        "error: m/config.json: config holds the number 1e400, beyond a 64-bit float (written back it would be "
        "Infinity, which is not JSON); fix or remove the file"))


# ---------------------------------------------------------------- 10: hostile names


def test_hostile_key_in_a_rule_label_stays_on_one_line(case: Case) -> None:
    make_source(case.root / "m", {"w": torch.ones(2), "evil\x1b[31m\nline": torch.ones(1)})
    rule = write_rule(case.root / "r.yaml", "sources:\n  m: {path: m}\ntensors:\n  - match: 'w'\n"
                      "  - match: '(?s)(evil.*)'\n    rename: '\\1'\n")
    case.fails("plan", rule, code=1, line=(
        "error: tensors[1] (r.yaml:6) (from m:'evil\\x1b[31m\\nline'): output key 'evil\\x1b[31m\\nline' is not a "
        "valid tensor name: it contains a control character; change the rule's rename (or the add entry's name) "
        "so that it writes another key"))


# ---------------------------------------------------------------- 16: the library by name, the demo


def test_an_output_named_like_the_shipped_rule_does_not_shadow_it(tmp_path: Path, run_cli: Any) -> None:
    """``apply aqmedai_k2_to_k25 --out aqmedai_k2_to_k25`` twice: a directory is never a rule
    file, so the rerun still finds the shipped rule (and is up to date)."""
    demo = tmp_path / "demo"
    assert run_cli("demo", "--out", demo).returncode == 0
    sources = [f"--source={n}={demo / 'sources' / d}" for n, d in
               [("drafter", "Kimi-K2-Instruct-eagle3"), ("target_vocab", "Kimi-K25-eagle3"), ("verifier", "Kimi-K2.5")]]
    first = run_cli("apply", "aqmedai_k2_to_k25", *sources, "--out", "aqmedai_k2_to_k25", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    again = run_cli("apply", "aqmedai_k2_to_k25", *sources, "--out", "aqmedai_k2_to_k25", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "is up to date" in again.stdout


def test_the_demo_never_advises_removing_what_it_did_not_make(run_cli: Any, tmp_path: Path) -> None:
    mine = tmp_path / "my dir"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    demo = run_cli("demo", "--out", mine)
    assert demo.returncode == 0, demo.stderr
    made = " ".join(shlex.quote(str(mine / d)) for d in ("sources", "converted"))
    assert demo.stdout.splitlines()[-1] == f"the stand-ins and the output stay in {mine}; remove them with: rm -r {made}"


# ---------------------------------------------------------------- 16: files: what plan can know, plan says


def test_fifo_matched_by_a_files_glob_is_refused_at_plan_time(case: Case) -> None:
    """Not "matches no file" (the user sees it with ls), and not a hang in apply."""
    make_source(case.root / "m", {"w": torch.ones(2)})
    os.mkfifo(case.root / "m" / "tokenizer.json")
    line = "error: 'm/tokenizer.json': is a FIFO (named pipe), not a regular file; give the path of the file itself"
    case.fails("plan", files_rule(case), code=1, line=line)
    case.fails("apply", files_rule(case), "--out", case.out, code=1, line=line)


def test_link_out_of_the_source_matched_by_a_files_glob_is_refused_at_plan_time(case: Case) -> None:
    make_source(case.root / "m", {"w": torch.ones(2)})
    (case.root / "secret").write_text("not for the output")
    (case.root / "m" / "tokenizer.json").symlink_to(case.root / "secret")
    case.fails("plan", files_rule(case), code=1, line=(
        f"error: m/tokenizer.json: links to {case.root / 'secret'}, outside the checkpoint directory "
        f"{case.root / 'm'}; replace the link with the file itself"))


# ---------------------------------------------------------------- 10: hostile paths on screen


def test_a_hostile_output_path_is_escaped_in_every_line_that_shows_it(case: Case) -> None:
    """A directory name from an archive can hold escapes and newlines: the up-to-date lines,
    the log line and verify's line show them as escapes, each on one line."""
    make_source(case.root / "m", {"w": torch.ones(2)})
    rule = write_rule(case.root / "r.yaml", "sources:\n  m: {path: m}\ntensors:\n  - match: 'w'\n")
    out = "o\x1b[31m\nX"
    shown = "o\\x1b[31m\\nX"
    assert case.run_cli("apply", rule, "--out", out, cwd=case.root).returncode == 0
    again = case.run_cli("apply", rule, "--out", out, cwd=case.root)
    assert (again.returncode, again.stdout.splitlines()) == (0, [
        f"{case.root}/{shown} is up to date (same plan from the same inputs, verified); nothing written",
        f"audit: {case.root}/{shown}/ckptxform_audit.jsonl"])
    assert again.stderr == ""  # said once, on stdout
    debug = case.run_cli("apply", rule, "--out", out, "-v", cwd=case.root)
    assert [line for line in debug.stderr.splitlines() if "up to date" in line] == [
        f"DEBUG   {shown} is up to date: made from the same plan and inputs, and it verifies; nothing to do "
        "(pass --force to rewrite it)"]
    verify = case.run_cli("verify", out, cwd=case.root)
    assert (verify.returncode, verify.stdout.splitlines()) == (0, [f"{shown}: 1 tensors verified (8 bytes)"])


def test_tables_stay_aligned_with_a_float8_tensor(case: Case) -> None:
    make_source(case.root / "m", {"w": torch.ones(2), "q": torch.ones(2).to(torch.float8_e4m3fn)})
    rule = write_rule(case.root / "r.yaml", "sources:\n  m: {path: m}\ntensors:\n  - match: '.*'\n")
    plan = case.run_cli("plan", rule, cwd=case.root)
    assert plan.stdout.splitlines()[-2:] == ["  q  F8_E4M3 [2]            <- m:q", "  w  F32     [2]            <- m:w"]
    inspect = case.run_cli("inspect", "m", cwd=case.root)
    assert sorted(inspect.stdout.splitlines()[1:3]) == ["  q  F8_E4M3 [2]              model.safetensors",
                                                        "  w  F32     [2]              model.safetensors"]
