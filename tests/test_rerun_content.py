"""Reruns keyed on content (issue 35 item 6): a ``touch`` changes no byte, so a rerun of an
unchanged conversion is up to date and an interrupted job keeps its shards
(test_resume.py); a changed file is named with how it changed.

Small files are keyed by the hash of all their bytes. A large file (the threshold is
lowered here so that stand-ins count as large) is keyed by its size and header, and when
its pin moved with that key unchanged, by the whole digest the earlier run recorded when
asked to (``--hash-inputs``: one more read of every large input, so not by default).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from conftest import read_audit

from ckptxform import api
from ckptxform.errors import OutputError
from ckptxform.sources import file_content
from ckptxform.standins.for_rules import STANDINS

RULE = "untie_embeddings"


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return Path(STANDINS[RULE].build(tmp_path / "sources")["model"])


def apply(model: Path, out: Path, **options: bool) -> api.ApplyResult:
    return api.apply(RULE, out=out, sources={"model": str(model)}, progress=False, **options)


def touch(folder: Path) -> None:
    """Move every file's mtime and ctime, changing no byte."""
    for path in folder.iterdir():
        stat = path.stat()
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))


def flip_last_byte(path: Path) -> None:
    with path.open("r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))


def refusal(model: Path, out: Path) -> str:
    with pytest.raises(OutputError) as err:
        apply(model, out)
    return str(err.value)


def test_a_touched_source_is_up_to_date_from_the_command_line(model: Path, tmp_path: Path, run_cli) -> None:
    out = tmp_path / "out"
    assert run_cli("apply", RULE, "--source", f"model={model}", "--out", out).returncode == 0
    before = (out / "model.safetensors").stat().st_ino
    touch(model)
    again = run_cli("apply", RULE, "--source", f"model={model}", "--out", out)
    assert again.returncode == 0, again.stderr
    assert f"{out} is up to date" in again.stdout
    assert (out / "model.safetensors").stat().st_ino == before


def test_a_changed_small_file_is_named_with_how_it_changed(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    apply(model, out)
    weights = model / "model.safetensors"
    flip_last_byte(weights)
    assert refusal(model, out) == (f"{str(out)!r} already exists and was made from an earlier "
                                   f"{str(weights.resolve())!r} (its bytes changed); pass --force to replace it")


@pytest.fixture
def large(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file counts as large: keyed by size and header, settled by its whole digest."""
    monkeypatch.setattr(file_content, "SMALL_FILE", 0)


def test_a_touched_large_file_is_settled_by_the_digest_the_run_recorded(
        large: None, model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    apply(model, out, hash_inputs=True)
    run = read_audit(out)[0]
    weights = str((model / "model.safetensors").resolve())
    assert re.fullmatch(r"size=\d+ head-sha256=[0-9a-f]{64}", run["contents"][weights])
    assert re.fullmatch(r"blake3:[0-9a-f]{64}", run["file_digests"][weights])
    touch(model)
    assert apply(model, out).up_to_date


def test_a_large_file_with_new_values_in_the_same_layout_is_a_change(large: None, model: Path,
                                                                      tmp_path: Path) -> None:
    out = tmp_path / "out"
    apply(model, out, hash_inputs=True)
    weights = model / "model.safetensors"
    flip_last_byte(weights)  # a tensor's value: size and header stay
    assert refusal(model, out) == (f"{str(out)!r} already exists and was made from an earlier "
                                   f"{str(weights.resolve())!r} (its bytes changed; its size and header are the "
                                   "same); pass --force to replace it")


def test_a_large_file_with_another_header_says_so(large: None, model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    apply(model, out)
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    header["__metadata__"] = {"format": "pt"} if header.get("__metadata__") != {"format": "pt"} else {}
    text = json.dumps(header, separators=(",", ":")).encode()  # the same tensors, other metadata
    assert len(text) <= length
    weights.write_bytes(bytes(data[:8]) + text.ljust(length) + bytes(data[8 + length:]))
    assert refusal(model, out) == (f"{str(out)!r} already exists and was made from an earlier "
                                   f"{str(weights.resolve())!r} (its header changed: a key, dtype, shape or offset); "
                                   "pass --force to replace it")


def test_without_hash_inputs_a_touched_large_file_is_not_read_again_and_the_rerun_says_why(
        large: None, model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    apply(model, out)
    assert "file_digests" not in read_audit(out)[0]  # no whole read of a large input by default
    weights = model / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert refusal(model, out) == (f"{str(out)!r} already exists and was made from an earlier "
                                   f"{str(weights.resolve())!r} (written to since; its size and header are the "
                                   "same, and the run that read it recorded no digest of its bytes to compare "
                                   "(apply --hash-inputs records one)); pass --force to replace it")
