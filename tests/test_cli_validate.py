"""``ckptxform validate`` through the real command line (a subprocess), per the CLI contract:
exit 0 when valid, 2 with one ``FILE:LINE:COL`` line per problem when not, no traceback
unless ``CKPTXFORM_DEBUG=1``, and no torch import on the way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parent.parent
HEADLINE = REPO / "rules" / "aqmedai_k2_to_k25.yaml"


def ckptxform(*args: str | Path, debug: bool = False) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CKPTXFORM_DEBUG"}
    if debug:
        env["CKPTXFORM_DEBUG"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "ckptxform", *map(str, args)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False,
    )


def headline_lines() -> list[str]:
    return HEADLINE.read_text("utf-8").splitlines(keepends=True)


def line_number(lines: list[str], text: str) -> int:
    """1-based number of the only line containing ``text``."""
    found = [i for i, line in enumerate(lines, 1) if text in line]
    assert len(found) == 1, (text, found)
    return found[0]


def replace_line(lines: list[str], text: str, new: str) -> tuple[list[str], int]:
    """``lines`` with the line containing ``text`` replaced by ``new``; and its number."""
    number = line_number(lines, text)
    return lines[: number - 1] + [new] + lines[number:], number


def test_shipped_rules_validate() -> None:
    files = sorted((REPO / "rules").glob("*.yaml"))
    assert HEADLINE in files
    result = ckptxform("validate", *(f.relative_to(REPO) for f in files))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"{f.relative_to(REPO)}: ok" for f in files]
    assert result.stderr == ""


def test_unknown_top_level_key_at_line_n(tmp_path: Path) -> None:
    lines = headline_lines()
    n = line_number(lines, "convert: drafter")  # insert a line there, pushing convert down
    lines.insert(n - 1, "frobnicate: true\n")
    bad = tmp_path / "unknown_key.yaml"
    bad.write_text("".join(lines))
    result = ckptxform("validate", bad)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        (f"{bad}:{n}:1: frobnicate: unknown key 'frobnicate' (allowed: $schema, add, config, "
        "convert, description, extends, files, inverse, name, output, require, sources, tensors, version, vocab)")
    ]
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("find", "replacement", "expected"),
    [
        pytest.param(
            "optional: true",
            "    optional: sometimes\n",
            ":15: tensors[4].optional: expected a boolean, got a string 'sometimes'",
            id="wrong-type-deep-in-tensor-rule",
        ),
        pytest.param(
            "match: 'fc\\.weight|norm\\.weight'",
            "  - match: 'fc\\.weight|(norm\\.weight'\n",
            ":12: tensors[1].match: invalid regular expression 'fc\\\\.weight|(norm\\\\.weight': "
            "missing ), unterminated subpattern at position 11",
            id="invalid-regex",
        ),
        pytest.param(
            "permute_rows: {from: k2, to: k25}",
            "    permute_rows: {from: k2, to: k3}\n",
            ":34: tensors[2].permute_rows.to: unknown vocabulary 'k3' (defined: k2, k25)",
            id="undefined-vocab",
        ),
    ],
)
def test_each_problem_is_reported_at_its_line(tmp_path: Path, find: str, replacement: str, expected: str) -> None:
    lines, n = replace_line(headline_lines(), find, replacement)
    bad = tmp_path / "bad.yaml"
    bad.write_text("".join(lines))
    result = ckptxform("validate", bad)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    [message] = result.stderr.splitlines()
    assert message == f"{bad}:{n}{expected}"


def test_bad_inverse_config_is_reported_at_its_line(tmp_path: Path) -> None:
    """``inverse.config`` is checked like ``config``, by validate and by invert alike."""
    lines = headline_lines()
    n = len(lines)
    bad = tmp_path / "bad.yaml"
    bad.write_text("".join(lines) + "inverse:\n  config:\n    from: drafer\n    sett: {x: 1}\n"
                   "    set: {y: '${vocab.k3.draft_size}'}\n")
    expected = [
        f"{bad}:{n + 3}:11: inverse.config.from: unknown source 'drafer' (defined: drafter, target_vocab, "
        "verifier); did you mean 'drafter'?",
        f"{bad}:{n + 4}:5: inverse.config.sett: unknown key 'sett'; did you mean 'set'?",
        f"{bad}:{n + 5}:14: inverse.config.set.y: unknown vocabulary 'k3' (defined: k2, k25)",
    ]
    for command in ("validate", "invert"):
        result = ckptxform(command, bad)
        assert result.returncode == 2
        assert "Traceback" not in result.stderr
        assert result.stderr.splitlines() == expected
        assert result.stdout == ""


def test_all_problems_of_a_file_in_one_run_in_line_order(tmp_path: Path) -> None:
    lines = headline_lines()
    lines, regex_line = replace_line(lines, "match: 'fc\\.weight|norm", "  - match: 'fc\\.weight|(norm'\n")
    lines, vocab_line = replace_line(lines, "permute_rows: {from: k2", "    permute_rows: {from: k2, to: k3}\n")
    lines, type_line = replace_line(lines, "optional: true", "    optional: sometimes\n")
    key_line = line_number(lines, "convert: drafter")
    lines.insert(key_line - 1, "frobnicate: true\n")
    regex_line, vocab_line, type_line = regex_line + 1, vocab_line + 1, type_line + 1  # below the insert
    bad = tmp_path / "many.yaml"
    bad.write_text("".join(lines))
    result = ckptxform("validate", bad)
    assert result.returncode == 2
    messages = result.stderr.splitlines()
    assert [m.split(":")[1] for m in messages] == [str(n) for n in (key_line, regex_line, vocab_line, type_line)]
    assert all(m.startswith(f"{bad}:") for m in messages)
    assert "frobnicate" in messages[0] and "invalid regular expression" in messages[1]
    assert "unknown vocabulary 'k3'" in messages[2] and "tensors[4].optional" in messages[3]


def test_several_files_good_and_bad(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nfrobnicate: 1\n")
    missing = tmp_path / "missing.yaml"
    result = ckptxform("validate", HEADLINE.relative_to(REPO), bad, missing)
    assert result.returncode == 2
    assert result.stdout.splitlines() == [f"{HEADLINE.relative_to(REPO)}: ok"]
    messages = result.stderr.splitlines()
    assert len(messages) == 2
    assert messages[0].startswith(f"{bad}:2:1: frobnicate: unknown key 'frobnicate'")
    assert messages[1] == f"{missing}: file not found; check the path"


def test_python_tag_is_refused_through_the_cli(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    bad = tmp_path / "tag.yaml"
    bad.write_text(f"version: 1\nname: !!python/object/apply:os.system ['touch {marker}']\n")
    result = ckptxform("validate", bad)
    assert result.returncode == 2
    assert f"{bad}:2:7: YAML tag" in result.stderr
    assert not marker.exists()


def test_usage_error_without_arguments() -> None:
    result = ckptxform("validate")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nfrobnicate: 1\n")
    result = ckptxform("validate", bad, debug=True)
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "RuleError" in result.stderr


def test_validate_does_not_import_torch(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nfrobnicate: 1\n")
    code = (
        "import sys\n"
        "from ckptxform.cli import main\n"
        "for path in sys.argv[1:]:\n"
        "    try:\n"
        "        main(['validate', path], standalone_mode=False)\n"
        "    except SystemExit as exit:\n"
        "        print('exit', exit.code)\n"
        "from ckptxform import load_rules\n"
        "load_rules(sys.argv[1])\n"
        "print('torch' in sys.modules, 'safetensors' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(HEADLINE.relative_to(REPO)), str(bad)],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"{HEADLINE.relative_to(REPO)}: ok", "exit 2", "False False"]
