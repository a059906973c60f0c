"""Rule documents found valid are remembered, so later runs skip importing jsonschema;
nothing invalid may ever slip through that memory."""

from __future__ import annotations

import datetime
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ckptxform import load_rules
from ckptxform.errors import RuleError
from ckptxform.rules import schema_check
from ckptxform.rules.validity_cache import document_key

REPO = Path(__file__).resolve().parents[1]
HEADLINE = REPO / "rules" / "aqmedai_k2_to_k25.yaml"


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "cache"
    monkeypatch.setenv("CKPTXFORM_CACHE_DIR", str(directory))
    monkeypatch.delenv("CKPTXFORM_NO_CACHE", raising=False)
    return directory


def entries(cache: Path) -> list[str]:
    folder = cache / "valid-rules"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def no_validator(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse() -> None:
        raise AssertionError("jsonschema was consulted")
    monkeypatch.setattr(schema_check, "_validator", refuse)


def test_a_valid_file_is_remembered_and_then_loads_without_jsonschema(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = load_rules(HEADLINE)
    assert len(entries(cache)) == 1
    no_validator(monkeypatch)
    again = load_rules(HEADLINE)
    assert again == first


def test_an_edited_file_is_checked_again(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rule = tmp_path / "rule.yaml"
    shutil.copy(HEADLINE, rule)
    load_rules(rule)
    rule.write_text(rule.read_text().replace("convert: drafter", "convert: drafter\nconvertt: drafter"))
    with pytest.raises(RuleError) as caught:
        load_rules(rule)
    assert "convertt" in str(caught.value) and "did you mean 'convert'" in str(caught.value)
    assert len(entries(cache)) == 1  # the failure was not remembered


def test_invalid_documents_are_never_remembered(cache: Path, tmp_path: Path) -> None:
    rule = tmp_path / "rule.yaml"
    rule.write_text("version: 1\nname: x\nsources: {a: {path: p}}\nconvert: a\ntensors: [{match: 3}]\n")
    for _ in range(2):
        with pytest.raises(RuleError, match=r"rule.yaml:5:.*tensors\[0\]\.match"):
            load_rules(rule)
    assert entries(cache) == []


def test_semantic_checks_run_even_when_the_schema_pass_is_remembered(cache: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    rule = tmp_path / "rule.yaml"
    rule.write_text("version: 1\nname: x\nsources: {a: {path: p}}\nconvert: b\ntensors: [{match: '.*'}]\n")
    for _ in range(2):
        with pytest.raises(RuleError, match="convert"):
            load_rules(rule)
        no_validator(monkeypatch)  # the second load must not need it
    assert len(entries(cache)) == 1


def test_no_cache_turns_it_off(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTXFORM_NO_CACHE", "1")
    load_rules(HEADLINE)
    assert not cache.exists()


def test_an_unusable_cache_directory_is_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setenv("CKPTXFORM_CACHE_DIR", str(not_a_dir))
    assert sorted(load_rules(HEADLINE).sources) == ["drafter", "target_vocab", "verifier"]


def test_the_default_location_follows_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKPTXFORM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    load_rules(HEADLINE)
    assert len(entries(tmp_path / "xdg" / "ckptxform")) == 1


def test_keys_tell_apart_what_json_would_blur() -> None:
    schema = "{}"
    assert len({document_key(schema, {"a": v}) for v in (1, 1.0, True, "1", None, [1])}) == 6
    assert document_key(schema, {"a": 1}) != document_key("{ }", {"a": 1})
    assert document_key(schema, {1: "a"}) is None  # JSON would make the key "1"
    assert document_key(schema, {"a": datetime.date(2024, 1, 1)}) is None


def test_a_warm_cli_run_does_not_import_jsonschema(cache: Path) -> None:
    def imported() -> str:
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "ckptxform", "validate", str(HEADLINE)],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stderr

    assert "jsonschema" in imported()  # the first run checks the file...
    assert "jsonschema" not in imported()  # ...the next one knows it passed


def test_no_home_directory_means_no_cache_not_a_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKPTXFORM_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    assert sorted(load_rules(HEADLINE).sources) == ["drafter", "target_vocab", "verifier"]
