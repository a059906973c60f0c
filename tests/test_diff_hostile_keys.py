"""``diff --emit-rules`` writes keys from the checkpoints' headers into YAML (issue 37 item 11):
every key is a double-quoted YAML string of printable ASCII, every comment one line, so a key
holding a newline and an indented line cannot become a rule, a regex built from a key still
matches it, no control byte reaches the file, and the file loads to exactly the rules diff
meant. The terminal report quotes keys too."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import yaml
from conftest import read_output
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_structural_engine import assert_same, rand, write_model

from ckptxform import api
from ckptxform.diff.checkpoint import CheckpointDiff
from ckptxform.diff.emit import emitted_rules, rules_yaml
from ckptxform.diff.values import ValueComparison
from ckptxform.diff.yaml_text import yaml_comment, yaml_string
from ckptxform.rules.key_pattern import KeyPattern
from ckptxform.rules.yaml_source import read_yaml

RunCli = Callable[..., subprocess.CompletedProcess[str]]

# every code point, lone surrogates and control characters included
ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
PRINTABLE_ASCII_LINES = re.compile(r"[\x20-\x7e\n]*")
INJECTION = "w\n  - {match: '.+', skip: injected}"
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def assert_printable_ascii(text: str) -> None:
    assert PRINTABLE_ASCII_LINES.fullmatch(text), [ch for ch in text if not ("\x20" <= ch <= "\x7e" or ch == "\n")]


@FUZZ
@given(ANY_TEXT)
def test_a_string_loads_back_as_the_text_and_a_comment_stays_one(text: str) -> None:
    quoted, comment = yaml_string(text), yaml_comment(text)
    for written in (quoted, comment):
        assert_printable_ascii(written)
        assert "\n" not in written
    assert yaml.safe_load(f"key: {quoted}\n# {comment}\nb: 2\n") == {"key": text, "b": 2}


def _diff(same: list[str], only_a: list[str], only_b: list[str], renamed: list[tuple[str, str]],
          other_bytes: list[str]) -> CheckpointDiff:
    values = ValueComparison("blake3", len(same), tuple((k, k) for k in other_bytes), tuple(renamed),
                             ("hashed", "hashed"), 0)
    return CheckpointDiff("a\nb: x", "b\x1b[2J", tuple(only_a), tuple(only_b), (), tuple(same), values=values)


@FUZZ
@given(st.lists(ANY_TEXT.filter(bool), min_size=1, max_size=12, unique=True), st.data())
def test_the_emitted_file_loads_to_exactly_the_rules_diff_meant(keys: list[str], data: st.DataObject) -> None:
    """Arbitrary keys, each kept, renamed (same bytes), skipped (only in A) or only in B: the
    file is printable ASCII, loads (PyYAML and the rule reader) to the rules diff built, and
    every regex and rename in it does to its keys what diff meant."""
    roles = [data.draw(st.sampled_from(["same", "renamed", "only_a", "only_b"])) for _ in keys]
    same = sorted(k for k, r in zip(keys, roles) if r == "same")
    renamed = [(k, k[::-1] + "\n  - {match: x}") for k, r in zip(keys, roles) if r == "renamed"]
    only_a = sorted([k for k, r in zip(keys, roles) if r == "only_a"] + [a for a, _ in renamed])
    only_b = sorted([k for k, r in zip(keys, roles) if r == "only_b"] + [b for _, b in renamed])
    other = [k for k in same if data.draw(st.booleans())]
    diff = _diff(same, only_a, only_b, renamed, other)
    text = rules_yaml(diff, "/tmp/r.yaml")
    assert_printable_ascii(text)
    loaded = yaml.safe_load(text)
    assert loaded["tensors"] == emitted_rules(diff)
    assert loaded["sources"] == {"source": {"path": "a\nb: x"}} and set(loaded) == {
        "version", "name", "sources", "convert", "tensors", "config"}
    rules = loaded["tensors"]
    got_renames = [r for r in rules if "rename" in r]
    assert len(got_renames) == len(renamed)
    for a, b in renamed:  # one rename rule matches a, of all the keys, and writes b
        [rule] = [r for r in got_renames if KeyPattern.compile(r["match"], label="test").fullmatch(a)]
        assert [k for k in keys if KeyPattern.compile(rule["match"], label="test").fullmatch(k)] == [a]
        assert re.fullmatch(rule["match"], a).expand(rule["rename"]) == b  # type: ignore[union-attr]
    kept = [r for r in rules if set(r) == {"match"}]
    if same:
        assert len(kept) == 1
        pattern = KeyPattern.compile(kept[0]["match"], label="test")
        assert [k for k in keys if pattern.fullmatch(k)] == [k for k in keys if k in same]
    else:
        assert kept == []
    skipped = sorted(r["match"] for r in rules if "skip" in r)
    assert skipped == sorted(re.escape(k) for k, r in zip(keys, roles) if r == "only_a")
    assert all(r.get("skip") in (None, "only in A, no counterpart in B") for r in rules)
    path = Path("/tmp") / f"hostile-{abs(hash(text))}.yaml"
    path.write_text(text, "utf-8")
    try:
        assert read_yaml(path, "test").data == loaded
    finally:
        path.unlink()


def test_a_key_breaking_out_of_a_comment_or_folding_a_regex(tmp_path: Path, run_cli: RunCli) -> None:
    """The issue's keys in real files: a newline and an indented rule (only in B: a comment;
    in both: the keep regex), a terminal escape, a line separator. No key becomes a rule."""
    a = {INJECTION: rand(3, 4, seed=1), "x\x1b[31m.weight": rand(5, seed=2), "y\u2028z: 1": rand(2, 2, seed=3),
         "only\n- a": rand(1, seed=4)}
    b = {INJECTION: a[INJECTION], "x\x1b[31m.weight": a["x\x1b[31m.weight"], "y\u2028z: 1": a["y\u2028z: 1"],
         "b\n  - {match: '.+', skip: injected}": rand(2, seed=5)}
    write_model(tmp_path / "a", a, {})
    write_model(tmp_path / "b", b)
    rules = tmp_path / "emitted.yaml"
    proc = run_cli("diff", tmp_path / "a", tmp_path / "b", "--emit-rules", "--out", rules)
    assert proc.returncode == 1  # the engine refuses to write a key with a control character
    assert "\x1b" not in proc.stderr
    text = rules.read_text("utf-8")
    assert_printable_ascii(text)
    loaded = yaml.safe_load(text)
    assert all(rule.get("skip") != "injected" and rule.get("match") != ".+" for rule in loaded["tensors"])
    assert loaded["tensors"] == [
        {"match": "|".join(re.escape(k) for k in sorted([INJECTION, "x\x1b[31m.weight", "y\u2028z: 1"]))},
        {"match": re.escape("only\n- a"), "skip": "only in A, no counterpart in B"}]
    keep = re.compile(loaded["tensors"][0]["match"])
    assert all(keep.fullmatch(k) for k in (INJECTION, "x\x1b[31m.weight", "y\u2028z: 1"))
    assert '# not produced, only in B: "b\\n  - {match: \'.+\', skip: injected}" (add it with add: or a rename)' \
        in text.splitlines()
    report = run_cli("diff", tmp_path / "a", tmp_path / "b")
    assert report.returncode == 1
    assert "\x1b" not in report.stdout and "\u2028" not in report.stdout
    assert "1 only in A:\n  'only\\n- a'\n" in report.stdout
    assert "1 only in B:\n  \"b\\n  - {match: '.+', skip: injected}\"\n" in report.stdout


def test_yaml_hostile_printable_keys_convert_exactly(tmp_path: Path, run_cli: RunCli) -> None:
    """Quotes, a backslash group reference, '#', ': ', flow brackets, '$1', non-ASCII: the
    emitted rule keeps, renames (found by digest) and skips them, and applied to A gives B."""
    keys = ["q'u\"o\\1te # c", "a: {b: [c]}", "x.$1.\\g<0>", "\u00e9t\u00e9.\u4e2d.weight"]
    a = {k: rand(3, 2 + i, seed=i) for i, k in enumerate(keys)}
    a["lm_head 'x' #.weight"] = rand(4, 4, seed=9)
    a["dropped\\.\"x"] = rand(2, seed=10)
    b = {k: a[k] for k in keys}
    b["head \"y\" #2: {z}.weight"] = a["lm_head 'x' #.weight"]
    write_model(tmp_path / "a", a, {"hidden_size": 4})
    write_model(tmp_path / "b", b)
    rules = tmp_path / "emitted.yaml"
    proc = run_cli("diff", tmp_path / "a", tmp_path / "b", "--emit-rules", "--out", rules)
    assert proc.returncode == 0, proc.stderr
    loaded = yaml.safe_load(rules.read_text("utf-8"))
    assert loaded["tensors"] == [
        {"match": re.escape("lm_head 'x' #.weight"), "rename": "head \"y\" #2: {z}.weight"},
        {"match": "|".join(re.escape(k) for k in sorted(keys))},
        {"match": re.escape("dropped\\.\"x"), "skip": "only in A, no counterpart in B"}]
    api.apply(rules, out=tmp_path / "out", progress=False)
    assert_same(read_output(tmp_path / "out"), b)


def test_a_prefix_rename_matches_keys_holding_a_newline(tmp_path: Path, run_cli: RunCli) -> None:
    """The prefix rename diff finds from names (``model\\.(.+)``) takes keys with a newline
    after the prefix too, and the rule file reproduces B."""
    a = {"model.x\n  - {match: y}": rand(2, 3, seed=1), "model.z": rand(4, seed=2), "model.w\n": rand(3, seed=3)}
    b = {k.removeprefix("model."): v for k, v in a.items()}
    write_model(tmp_path / "a", a, {})
    write_model(tmp_path / "b", b)
    rules = tmp_path / "emitted.yaml"
    proc = run_cli("diff", tmp_path / "a", tmp_path / "b", "--emit-rules", "--out", rules)
    loaded = yaml.safe_load(rules.read_text("utf-8"))
    assert loaded["tensors"] == [{"match": "model\\.((?s:.+))", "rename": "\\1"}]
    assert all(re.fullmatch(loaded["tensors"][0]["match"], k) for k in a)
    assert proc.returncode == 1  # the engine writes no key holding a control character
    assert "is not a valid tensor name: it contains a control character" in proc.stderr
