"""The ``plan``/``apply``/``inspect`` commands as a user runs them: exit codes, one clear
error line, no traceback, no output left behind when a run fails.

Every case runs the real command in a subprocess (``python -m ckptxform``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_clean_failure, error_lines, file_keys, read_output, source_args
from safetensors.torch import load_file, save_file

from ckptxform.standins import HeadlineStandins, build_eagle3_drafter, make_draft_vocab


def apply_args(rule: Path, sources: dict[str, str], out: Path, *extra: str) -> list[str]:
    return ["apply", str(rule), *source_args(sources), "--out", str(out), *extra]


def assert_nothing_written(directory: Path, expected: list[str]) -> None:
    """Only what the test made is in ``directory``: no OUT, no temporary sibling, no lock."""
    assert sorted(p.name for p in directory.iterdir()) == sorted(expected)


def copy_drafter_with(headline: HeadlineStandins, dest: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of the headline K2 drafter whose tensors ``edit`` changed in place."""
    dest.mkdir()
    tensors = load_file(str(headline.drafter.path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(headline.drafter.path / "config.json", dest / "config.json")
    return dest


# ----------------------------------------------------------------------------- failures


def test_drafter_without_post_attention_layernorm(headline: HeadlineStandins, headline_rule: Path,
                                                  run_cli: Any, tmp_path: Path) -> None:
    drafter = build_eagle3_drafter(tmp_path / "k2", headline.drafter.dims, headline.k2_ids,
                                   omit_keys=["midlayer.post_attention_layernorm.weight"])
    proc = run_cli(*apply_args(headline_rule, {**headline.sources, "drafter": str(drafter.path)},
                               tmp_path / "out"))
    assert_clean_failure(proc)
    [line] = error_lines(proc.stderr)
    assert "'layers.0.post_attention_layernorm.weight' was not loaded from source 'drafter'" in line
    assert "'midlayer.post_attention_layernorm.weight'" in line  # the key it looked for
    assert_nothing_written(tmp_path, ["k2"])


def test_misnamed_key_is_shown_among_the_closest(headline: HeadlineStandins, headline_rule: Path,
                                                 run_cli: Any, tmp_path: Path) -> None:
    """The founding story: the key exists under another spelling, and the message says so."""
    def misname(t: dict[str, Any]) -> None:
        t["midlayer.post_attention_layer_norm.weight"] = t.pop("midlayer.post_attention_layernorm.weight")

    drafter = copy_drafter_with(headline, tmp_path / "k2", misname)
    proc = run_cli(*apply_args(headline_rule, {**headline.sources, "drafter": str(drafter)}, tmp_path / "out"))
    assert_clean_failure(proc)
    [line] = error_lines(proc.stderr)
    assert "'layers.0.post_attention_layernorm.weight' was not loaded" in line
    closest = line.split("closest keys there:")[1]
    assert "'midlayer.post_attention_layer_norm.weight'" in closest
    assert_nothing_written(tmp_path, ["k2"])


def test_vocab_map_with_the_wrong_declared_encoding(headline: HeadlineStandins, rule_variant: Any,
                                                    run_cli: Any, tmp_path: Path) -> None:
    rule = rule_variant({"k2: {source: drafter, encoding: offset}": "k2: {source: drafter, encoding: absolute}"})
    proc = run_cli(*apply_args(rule, headline.sources, tmp_path / "out"))
    assert_clean_failure(proc)
    [line] = error_lines(proc.stderr)
    assert "vocab map 'k2'" in line and "declared 'absolute'" in line and "encoding: offset" in line
    assert_nothing_written(tmp_path, ["variant.yaml"])


def test_unmatched_tensor_in_strict_mode(headline: HeadlineStandins, headline_rule: Path,
                                         run_cli: Any, tmp_path: Path) -> None:
    def add_extra(t: dict[str, Any]) -> None:
        t["extra_head.weight"] = torch.zeros(2, 3, dtype=torch.bfloat16)

    drafter = copy_drafter_with(headline, tmp_path / "k2", add_extra)
    proc = run_cli(*apply_args(headline_rule, {**headline.sources, "drafter": str(drafter)}, tmp_path / "out"))
    assert_clean_failure(proc)
    [line] = error_lines(proc.stderr)
    assert "match no rule: 'extra_head.weight'" in line and "strict: false" in line
    assert_nothing_written(tmp_path, ["k2"])


def test_min_rows_from_source_when_the_vocabularies_share_few_tokens(
        headline: HeadlineStandins, headline_rule: Path, run_cli: Any, tmp_path: Path) -> None:
    dims = headline.drafter.dims
    k2 = set(headline.k2_ids)
    shared = sorted(k2)[: dims.draft_vocab // 5]
    others = [t for t in make_draft_vocab(dims.vocab, dims.vocab // 2, seed=1) if t not in k2]
    ids = sorted(shared + others[: dims.draft_vocab - len(shared)])
    target = build_eagle3_drafter(tmp_path / "k25", dims, ids)
    proc = run_cli(*apply_args(headline_rule, {**headline.sources, "target_vocab": str(target.path)},
                               tmp_path / "out"))
    assert_clean_failure(proc)
    [line] = error_lines(proc.stderr)
    n = dims.draft_vocab
    assert (f"only {len(shared):,} of {n:,} rows of 'lm_head.weight' ({len(shared) / n:.1%}) come from the "
            "source, below 75%") in line
    assert_nothing_written(tmp_path, ["k25"])


def test_rows_missing_without_missing_rows(headline: HeadlineStandins, rule_variant: Any,
                                           run_cli: Any, tmp_path: Path) -> None:
    rule = rule_variant({"    missing_rows: {rows_of: verifier, tensor: language_model.lm_head.weight}\n": ""})
    proc = run_cli(*apply_args(rule, headline.sources, tmp_path / "out"))
    assert_clean_failure(proc)
    [line] = error_lines(proc.stderr)
    missing = sum(1 for t in headline.k25_ids if t not in set(headline.k2_ids))
    assert f"{missing} of {len(headline.k25_ids)} rows of 'lm_head.weight' are tokens of 'k25' absent" in line
    assert "add missing_rows" in line
    assert_nothing_written(tmp_path, ["variant.yaml"])


def test_existing_output_needs_force(headline: HeadlineStandins, headline_rule: Path, run_cli: Any,
                                     tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    proc = run_cli(*apply_args(headline_rule, headline.sources, out))
    assert_clean_failure(proc)
    [line] = error_lines(proc.stderr)
    assert "already exists" in line and "--force" in line
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    assert (out / "mine.txt").read_text() == "keep me"
    assert_nothing_written(tmp_path, ["out"])

    # --force replaces only an earlier output of ckptxform (tests/test_trust_output.py)
    assert_clean_failure(run_cli(*apply_args(headline_rule, headline.sources, out, "--force")))
    assert (out / "mine.txt").read_text() == "keep me"
    (out / "mine.txt").unlink()
    out.rmdir()
    assert run_cli(*apply_args(headline_rule, headline.sources, out)).returncode == 0
    proc = run_cli(*apply_args(headline_rule, headline.sources, out, "--force"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-2].startswith(f"wrote {out}: ")
    assert sorted(p.name for p in out.iterdir()) == ["ckptxform_audit.jsonl", "config.json", "model.safetensors"]
    assert "lm_head.weight" in read_output(out)
    assert_nothing_written(tmp_path, ["out"])


def test_unknown_source_name_is_a_usage_error(headline: HeadlineStandins, headline_rule: Path, run_cli: Any,
                                              tmp_path: Path) -> None:
    proc = run_cli(*apply_args(headline_rule, {"unknown": str(headline.drafter.path)}, tmp_path / "out"))
    assert_clean_failure(proc, code=2)
    [line] = error_lines(proc.stderr)
    assert "no source 'unknown'" in line and "drafter, target_vocab, verifier" in line
    assert_nothing_written(tmp_path, [])


# ------------------------------------------------------------------------------ inspect


def expected_tensors(directory: Path, files: list[str]) -> dict[str, dict[str, Any]]:
    """key -> what inspect must say about it, from the headers and safetensors' own reading."""
    out = {}
    for name in files:
        values = load_file(str(directory / name))
        for key, (shape, dtype) in file_keys(directory / name).items():
            size = values[key].numel() * values[key].element_size()
            out[key] = {"key": key, "shape": shape, "dtype": dtype, "file": name, "bytes": size}
    return out


def inspect_cases(headline: HeadlineStandins) -> dict[str, tuple[str, Path, list[str]]]:
    drafter, verifier = headline.drafter.path, headline.verifier.path
    shards = sorted(p.name for p in verifier.glob("model-*.safetensors"))
    return {
        "file": (str(drafter / "model.safetensors"), drafter, ["model.safetensors"]),
        "dir": (str(drafter), drafter, ["model.safetensors"]),
        "sharded": (str(verifier), verifier, shards),
    }


@pytest.mark.parametrize("case", ["file", "dir", "sharded"])
def test_inspect_json(case: str, headline: HeadlineStandins, run_cli: Any) -> None:
    location, directory, files = inspect_cases(headline)[case]
    proc = run_cli("inspect", location, "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    want = expected_tensors(directory, files)
    assert data["location"] == location
    assert data["files"] == files
    assert {t["key"]: t for t in data["tensors"]} == want
    assert data["total_bytes"] == sum(t["bytes"] for t in want.values())


@pytest.mark.parametrize("case", ["file", "dir", "sharded"])
def test_inspect_text(case: str, headline: HeadlineStandins, run_cli: Any) -> None:
    location, directory, files = inspect_cases(headline)[case]
    proc = run_cli("inspect", location)
    assert proc.returncode == 0, proc.stderr
    want = expected_tensors(directory, files)
    lines = proc.stdout.splitlines()
    assert lines[0] == f"{location}: safetensors"  # which kind of checkpoint it is, first
    rows = {line.split()[0]: line.split() for line in lines[1:-1]}
    assert set(rows) == set(want)
    for key, t in want.items():
        assert rows[key][1] == t["dtype"] and rows[key][-1] == t["file"], rows[key]
        assert "".join(rows[key][2:-1]) == str(t["shape"]).replace(" ", "")
    total = sum(t["bytes"] for t in want.values())
    assert lines[-1].startswith(f"{len(want)} tensors in {len(files)} file(s), {total:,} bytes")


def test_inspect_missing_location(run_cli: Any, tmp_path: Path) -> None:
    proc = run_cli("inspect", tmp_path / "nowhere")
    assert_clean_failure(proc)
    [line] = error_lines(proc.stderr)
    assert "does not exist" in line and str(tmp_path / "nowhere") in line
