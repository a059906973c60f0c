"""The hostile-input suite (issue 12): inputs a careful user or an attacker would try.

Every class gives exactly one error line (asserted whole), the contract's exit code (2
for a rule-file problem, 1 otherwise), leaves no output and no temporary sibling, and
never changes a source file. Each case runs the real command in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

CONFIG = '{"hidden_size": 4}'


def make_source(directory: Path, tensors: dict[str, torch.Tensor], config: str | None = CONFIG) -> Path:
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        (directory / "config.json").write_text(config)
    return directory


def write_rule(path: Path, body: str) -> Path:
    path.write_text("version: 1\n" + body)
    return path


def snapshot(root: Path) -> dict[str, bytes]:
    """Every regular file under ``root`` and its bytes (FIFOs are kept by name)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_fifo():
            out[str(p)] = b"<fifo>"
        elif p.is_file():
            out[str(p)] = p.read_bytes()
    return out


class Case:
    """A directory of sources and rules; ``check`` runs a command and asserts the one line."""

    def __init__(self, tmp_path: Path, run_cli: Any) -> None:
        self.root = tmp_path
        self.run_cli = run_cli
        self.out = tmp_path / "out"

    def fails(self, *args: str | os.PathLike[str], code: int, line: str) -> None:
        before = snapshot(self.root)
        # paths relative to the case's directory, so that messages are the same on every machine
        args = tuple(os.path.relpath(a, self.root) if isinstance(a, Path) else a for a in args)
        proc = self.run_cli(*args, cwd=self.root, timeout=60)
        assert (proc.returncode, proc.stderr.splitlines()) == (code, [line]), proc.stderr
        assert "Traceback" not in proc.stdout + proc.stderr
        assert not self.out.exists()
        assert not [p.name for p in self.root.iterdir() if p.name.startswith(".out.")]
        assert snapshot(self.root) == before  # no source (or rule file) changed


@pytest.fixture
def case(tmp_path: Path, run_cli: Any) -> Case:
    return Case(tmp_path, run_cli)


def simple_rule(case: Case, tensors: str = "  - match: 'w'\n", extra: str = "") -> Path:
    return write_rule(case.root / "r.yaml", f"sources:\n  m: {{path: m}}\ntensors:\n{tensors}{extra}")


# ---------------------------------------------------------------- 4: require.loaded


def two_vocabularies(case: Case) -> None:
    """Drafter ``d`` drafts target tokens 0-3, ``t`` drafts 4-7: no token is shared."""
    make_source(case.root / "d", {"lm_head.weight": torch.ones(4, 2), "w": torch.ones(2),
                                  "d2t": torch.zeros(4, dtype=torch.int64),
                                  "t2d": torch.tensor([1, 1, 1, 1, 0, 0, 0, 0], dtype=torch.bool)})
    make_source(case.root / "t", {"d2t": torch.full((4,), 4, dtype=torch.int64),
                                  "t2d": torch.tensor([0, 0, 0, 0, 1, 1, 1, 1], dtype=torch.bool)})


def permute_rule(root: Path, init: str, rest: str) -> Path:
    """``d``'s lm_head re-indexed to ``t``'s vocabulary, missing rows by ``init``; then ``rest``."""
    return write_rule(root / "r.yaml", f"""sources: {{d: {{path: d}}, t: {{path: t}}}}
convert: d
vocab:
  a: {{source: d, encoding: offset}}
  b: {{source: t, encoding: offset}}
tensors:
  - match: 'lm_head\\.weight'
    permute_rows: {{from: a, to: b}}
    missing_rows: {{init: {init}}}
{rest}""")


def test_permutation_with_no_source_row_is_not_loaded(case: Case) -> None:
    two_vocabularies(case)
    rule = permute_rule(case.root, "zeros", "  - match: 'w|d2t|t2d'\nrequire:\n  loaded: ['lm_head\\.weight']\n")
    case.fails("apply", rule, "--out", case.out, code=1, line=(
        "error: require.loaded (r.yaml:13): 'lm_head.weight' was not loaded from source 'd': tensors[0] "
        "(r.yaml:8) (from d:lm_head.weight) takes none of its 4 rows from the source (all are filled); "
        "the vocabulary maps are probably not the drafters' own"))


def test_add_copied_from_the_converted_source_is_not_loaded(case: Case) -> None:
    make_source(case.root / "m", {"w": torch.ones(2)})
    rule = simple_rule(case, extra="add:\n  extra: {source: m, tensor: w}\nrequire:\n  loaded: ['extra']\n")
    case.fails("plan", rule, code=1, line=(
        "error: require.loaded (r.yaml:9): 'extra' was not loaded from source 'm': it is produced by "
        "add.extra (r.yaml:7), not loaded from the source"))


# ---------------------------------------------------------------- 5: casts and dtypes


def test_integer_cast_to_bfloat16_is_refused_at_plan_time(case: Case) -> None:
    make_source(case.root / "m", {"d2t": torch.arange(4, dtype=torch.int64)})
    rule = simple_rule(case, "  - match: 'd2t'\n    cast: bfloat16\n")
    case.fails("apply", rule, "--out", case.out, code=1, line=(
        "error: tensors[0] (r.yaml:5) (from m:d2t): cast I64 -> BF16 of 'd2t' cannot be exact: I64 holds "
        "integers up to 9,223,372,036,854,775,807, BF16 holds them exactly only up to 256 (ids and offsets "
        "would change); drop the cast and keep I64"))


def test_dtype_without_a_torch_mapping_is_refused_when_it_must_be_decoded(case: Case) -> None:
    make_source(case.root / "m", {"w": torch.ones(2, dtype=torch.uint16)})
    rule = simple_rule(case, "  - match: 'w'\n    cast: float32\n")
    case.fails("plan", rule, code=1, line=(
        "error: tensors[0] (r.yaml:5) (from m:w): cast U16 -> F32 of 'w' cannot be exact: U16 values cannot "
        "be decoded (ckptxform has no torch dtype for it); drop the cast and keep U16"))


def test_mean_fill_of_a_float8_tensor_is_the_mean_of_its_rows(tmp_path: Path, run_cli: Any) -> None:
    rows = torch.tensor([[1.0, 2.0], [3.0, 4.0], [0.5, 0.25], [2.0, 8.0]]).to(torch.float8_e4m3fn)
    make_source(tmp_path / "d", {"lm_head.weight": rows, "d2t": torch.zeros(4, dtype=torch.int64),
                                 "t2d": torch.tensor([1, 1, 1, 1, 0, 0], dtype=torch.bool)})
    # t drafts tokens 2, 3, 4, 5: rows 2 and 3 are the source's, 4 and 5 are filled with the mean
    make_source(tmp_path / "t", {"d2t": torch.full((4,), 2, dtype=torch.int64),
                                 "t2d": torch.tensor([0, 0, 1, 1, 1, 1], dtype=torch.bool)})
    rule = permute_rule(tmp_path, "mean", "  - match: 'd2t|t2d'\n    skip: replaced\n")
    proc = run_cli("apply", rule, "--out", tmp_path / "out", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    from safetensors.torch import load_file

    written = load_file(str(tmp_path / "out" / "model.safetensors"))["lm_head.weight"]
    # the mean of the rows carried over (2 and 3), as init: mean is defined
    mean = rows[2:].to(torch.float64).mean(dim=0).to(torch.float8_e4m3fn)
    expected = torch.stack([rows[2], rows[3], mean, mean])
    assert torch.equal(written.view(torch.uint8), expected.view(torch.uint8))


# ---------------------------------------------------------------- 6: what was not written


def test_plan_and_apply_name_every_tensor_left_out(case: Case) -> None:
    make_source(case.root / "m", {"w": torch.ones(2), **{f"extra.{i:02}": torch.ones(1) for i in range(10)}})
    rule = simple_rule(case, "  - match: 'w'\n", "require: {strict: false}\n")
    listing = ("  skipped (10) from m: no rule matches (require.strict: false)",
               "    'extra.00', 'extra.01', 'extra.02', 'extra.03', 'extra.04', 'extra.05', 'extra.06', "
               "'extra.07' and 2 more")
    for command in (("plan", rule), ("apply", rule, "--out", case.out)):
        proc = case.run_cli(*command, cwd=case.root)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        at = lines.index("not written out as tensors: 10 source tensors (each with its reason)")
        assert tuple(lines[at + 1:at + 3]) == listing
    proc = case.run_cli("-v", "plan", rule, cwd=case.root)
    assert "    " + ", ".join(f"'extra.{i:02}'" for i in range(10)) in proc.stdout.splitlines()


# ---------------------------------------------------------------- 7: validate agrees with plan


def test_validate_refuses_what_plan_refuses(case: Case) -> None:
    rule = write_rule(case.root / "r.yaml", "name: x\n")
    line = ("r.yaml:1:1: (top level): no 'sources': declare the checkpoints the rules read under 'sources', "
            "and name the one whose tensors they convert in 'convert'")
    case.fails("validate", rule, code=2, line=line)
    case.fails("plan", rule, code=2, line=line)


# ---------------------------------------------------------------- 8: bounded waits


def test_fifo_config_is_refused_not_waited_on(case: Case) -> None:
    src = make_source(case.root / "m", {"w": torch.ones(2)}, config=None)
    os.mkfifo(src / "config.json")
    rule = simple_rule(case, extra="config: {from: m}\n")
    line = "error: 'm/config.json': is a FIFO (named pipe), not a regular file; give the path of the file itself"
    case.fails("plan", rule, code=1, line=line)
    case.fails("apply", rule, "--out", case.out, code=1, line=line)


def test_fifo_index_is_refused_not_waited_on(case: Case) -> None:
    src = make_source(case.root / "m", {"w": torch.ones(2)})
    os.mkfifo(src / "model.safetensors.index.json")
    line = ("error: 'm/model.safetensors.index.json': is a FIFO (named pipe), not a regular file; give the "
            "path of the file itself")
    case.fails("plan", simple_rule(case), code=1, line=line)
    case.fails("inspect", "m", code=1, line=line)


@pytest.mark.parametrize(("name", "line"), [
    ("config.json", "error: out/config.json: 'out/config.json': is a FIFO (named pipe), not a regular file; give "
                    "the path of the file itself"),
    ("model.safetensors", "error: out/model.safetensors: 'out/model.safetensors': is a FIFO (named pipe), not a "
                          "regular file; give the path of the file itself; the output is incomplete: the audit puts "
                          "1 tensor(s) there ('w')"),
])
def test_verify_does_not_wait_on_a_fifo_in_the_output(tmp_path: Path, run_cli: Any, name: str, line: str) -> None:
    make_source(tmp_path / "m", {"w": torch.ones(2)})
    rule = write_rule(tmp_path / "r.yaml", "sources:\n  m: {path: m}\ntensors:\n  - match: 'w'\n"
                      "config: {from: m}\n")
    assert run_cli("apply", rule, "--out", tmp_path / "out", cwd=tmp_path).returncode == 0
    (tmp_path / "out" / name).unlink()
    os.mkfifo(tmp_path / "out" / name)
    proc = run_cli("verify", "out", cwd=tmp_path, timeout=60)
    assert (proc.returncode, proc.stderr.splitlines()) == (1, [line])

def test_catastrophic_match_regex_is_stopped(case: Case) -> None:
    make_source(case.root / "m", {"a" * 200 + "b": torch.ones(1)})
    rule = simple_rule(case, "  - match: '(a|aa)+'\n")
    case.fails("plan", rule, code=2, line=(
        "r.yaml:5:12: tensors[0].match: '(a|aa)+' was stopped after 1 s on the 201-character key "
        "'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa...': it backtracks catastrophically; "
        "rewrite it without nested or overlapping repetition such as '(a+)+' or '(a|aa)*'"))


# ---------------------------------------------------------------- 9: odd paths and streams


def test_non_utf8_source_path(case: Case) -> None:
    make_source(case.root / "m", {"w": torch.ones(2)})
    bad = os.fsdecode(b"m\xff")
    os.symlink("m", case.root / bad)
    case.fails("plan", simple_rule(case), "--source", f"m={bad}", code=1, line=(
        "error: source 'm': path 'm\\udcff' is not valid UTF-8; the audit log records every source's "
        "location as text: rename it (or link it under a UTF-8 name)"))


def test_rule_file_that_never_ends(case: Case) -> None:
    case.fails("validate", "/dev/zero", code=2, line=(
        "/dev/zero: is a character device, not a rule file; give the path of a YAML file"))


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "ckptxform", *args]


def test_stdout_closed_full_or_broken(case: Case) -> None:
    make_source(case.root / "m", {"w": torch.ones(2)})
    rule = str(simple_rule(case))
    env = {k: v for k, v in os.environ.items() if k != "CKPTXFORM_DEBUG"}
    with open("/dev/full", "w") as full:
        proc = subprocess.run(_cli("plan", rule), stdout=full, stderr=subprocess.PIPE, text=True, env=env)
    assert (proc.returncode, proc.stderr.splitlines()) == (1, [
        "error: cannot write to standard output: No space left on device; redirect it to a file where "
        "there is room"])
    proc = subprocess.run(["sh", "-c", 'exec "$@" >&-', "sh", *_cli("plan", rule)], stderr=subprocess.PIPE,
                          text=True, env=env)
    assert (proc.returncode, proc.stderr.splitlines()) == (1, [
        "error: standard output is closed; give the command a stdout (redirect it to /dev/null to discard "
        "what it prints)"])
    child = subprocess.Popen(_cli("plan", rule), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env)
    child.stdout.close()  # type: ignore[union-attr]  # the reader is gone before the first write
    stderr = child.stderr.read()  # type: ignore[union-attr]
    assert (child.wait(timeout=60), stderr.splitlines()) == (1, [
        "error: standard output was closed before all output was written (broken pipe); read all of it, "
        "or redirect it to a file"])


# ---------------------------------------------------------------- 10: hostile names


def test_hostile_tensor_name_is_quoted_on_one_line(case: Case) -> None:
    make_source(case.root / "m", {"w": torch.ones(2), "evil\x1b[31m\nline\x00": torch.ones(1)})
    case.fails("plan", simple_rule(case), code=1, line=(
        "error: r.yaml: 1 tensor of source 'm' match no rule: 'evil\\x1b[31m\\nline\\x00'; add a rule for "
        "each (or a 'skip' with its reason), or set require.strict: false; no shipped rule plans on it "
        "(ckptxform rules --for m)"))
    proc = case.run_cli("inspect", "m", cwd=case.root)
    assert proc.returncode == 0 and "\x1b" not in proc.stdout and "\x00" not in proc.stdout
    assert "  'evil\\x1b[31m\\nline\\x00'  F32   [1]              model.safetensors" in proc.stdout.splitlines()


# ---------------------------------------------------------------- 12: strict configs


@pytest.mark.parametrize(("config", "problem"), [
    ('{"hidden_size": 64, "hidden_size": 4096}',
     "config has key 'hidden_size' twice in one JSON object; each name must appear once (the file is "
     "corrupt or crafted)"),
    ('{"hidden_size": NaN}', "config is not valid JSON (NaN is not JSON); fix or remove the file"),
    ('{"rope_theta": Infinity}', "config is not valid JSON (Infinity is not JSON); fix or remove the file"),
    ('{"name": "\\ud800"}', "config holds a lone surrogate escape (such as \\ud800), which is not valid "
     "Unicode; fix or remove the file"),
])
def test_source_config_is_read_strictly(case: Case, config: str, problem: str) -> None:
    make_source(case.root / "m", {"w": torch.ones(2)}, config=config)
    rule = simple_rule(case, extra="config: {from: m}\n")
    case.fails("apply", rule, "--out", case.out, code=1, line=f"error: m/config.json: {problem}")
