"""The audit's per-tensor digest: BLAKE3 by default, sha256 by option, and ``verify`` on
audits of either kind and on audits written before records named their algorithm."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import error_lines, read_audit, read_output, reference_digest, source_args, tensor_bytes
from hub_fixtures import tensor_span

from ckptxform import api
from ckptxform.standins import HeadlineStandins

AUDIT = "ckptxform_audit.jsonl"
#: a ``written`` record as ckptxform wrote it before the digest became a choice
LEGACY_FIELDS = ["event", "key", "file", "shape", "dtype", "sha256", "from"]


@pytest.fixture(scope="module")
def sha256_out(tmp_path_factory: pytest.TempPathFactory, headline: HeadlineStandins, headline_rule: Path) -> Path:
    out = tmp_path_factory.mktemp("sha256-out") / "out"
    api.apply(headline_rule, out=out, sources=headline.sources, progress=False, digest="sha256")
    return out


def written(out: Path) -> list[dict[str, Any]]:
    return [e for e in read_audit(out) if e["event"] == "written"]


def rewrite_written(out: Path, change: Any) -> None:
    """Pass every ``written`` record of ``out``'s audit through ``change``."""
    audit = out / AUDIT
    events = [json.loads(line) for line in audit.read_text().splitlines()]
    audit.write_text("".join(json.dumps(change(e) if e["event"] == "written" else e) + "\n" for e in events))


def flip_first_byte_of(out: Path, key: str) -> None:
    offset, _ = tensor_span(out / "model.safetensors", key)
    with (out / "model.safetensors").open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 1]))


def test_sha256_on_request_records_hashlib_digests_under_their_name(sha256_out: Path) -> None:
    output = read_output(sha256_out)
    for event in written(sha256_out):
        assert (event["digest"], set(event) & {"blake3", "sha256"}) == ("sha256", {"sha256"})
        assert event["sha256"] == reference_digest("sha256", tensor_bytes(output[event["key"]])), event["key"]


def test_the_two_digests_record_the_same_tensors_and_differ_only_in_the_digest(
        headline_out: Path, sha256_out: Path) -> None:
    def without_digest(e: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in e.items() if k not in ("digest", e["digest"])}

    assert [without_digest(e) for e in written(headline_out)] == [without_digest(e) for e in written(sha256_out)]
    assert {e["digest"] for e in written(headline_out)} == {"blake3"}


@pytest.mark.parametrize("kind", ["blake3", "sha256", "legacy sha256"])
def test_verify_checks_every_kind_of_audit_and_names_the_algorithm_of_a_mismatch(
        kind: str, headline_out: Path, sha256_out: Path, run_cli: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(headline_out if kind == "blake3" else sha256_out, out)
    if kind == "legacy sha256":
        rewrite_written(out, lambda e: {k: e[k] for k in LEGACY_FIELDS})
    ok = run_cli("verify", out)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith(f"{out}: {len(written(out))} tensors verified")

    flip_first_byte_of(out, "norm.weight")
    bad = run_cli("verify", out)
    algorithm = kind.split()[-1]
    [line] = error_lines(bad.stderr)
    assert bad.returncode == 1
    assert line.startswith(f"error: {out / 'model.safetensors'}: tensor 'norm.weight': {algorithm} ")
    assert line.endswith("differs from the audit's "
                         f"{next(e[algorithm] for e in written(out) if e['key'] == 'norm.weight')[:12]}...; "
                         "its bytes were changed after apply")


def test_a_rerun_over_a_legacy_audit_is_up_to_date(headline: HeadlineStandins, headline_rule: Path, sha256_out: Path,
                                                   run_cli: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(sha256_out, out)
    rewrite_written(out, lambda e: {k: e[k] for k in LEGACY_FIELDS})
    proc = run_cli("apply", headline_rule, *source_args(headline.sources), "--out", out, "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["status"] == "up_to_date"
    assert [(w["digest"], w["sha256"]) for w in result["written"]] == [("sha256", e["sha256"]) for e in written(out)]


def test_an_audit_naming_an_unknown_digest_is_one_clear_error(headline_out: Path, run_cli: Any,
                                                               tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(headline_out, out)
    rewrite_written(out, lambda e: {**e, "digest": "md5\n"})
    proc = run_cli("verify", out)
    assert proc.returncode == 1
    assert error_lines(proc.stderr) == [
        f"error: {out / AUDIT}:{len(read_audit(out)) - len(written(out))}: the 'written' event's digest is 'md5\\n', "
        "which this ckptxform cannot check (it knows 'blake3', 'sha256', 'none'); upgrade ckptxform"]


def test_no_digest_writes_the_same_bytes_and_records_where_each_tensor_is(
        headline: HeadlineStandins, headline_rule: Path, headline_out: Path, run_cli: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_cli("apply", headline_rule, *source_args(headline.sources), "--out", out, "--digest", "none")
    assert proc.returncode == 0, proc.stderr
    assert (out / "model.safetensors").read_bytes() == (headline_out / "model.safetensors").read_bytes()
    hashed = {e["key"]: e for e in written(headline_out)}
    for event in written(out):
        assert event["digest"] == "none" and not {"blake3", "sha256"} & set(event)
        assert event["from"] == hashed[event["key"]]["from"]
        start, length = tensor_span(out / "model.safetensors", event["key"])
        assert event["bytes"] == [start, start + length]
    assert set(hashed) == {e["key"] for e in written(out)}

    ok = run_cli("verify", out)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip().endswith("bytes NOT checked: written with --digest none, their structure and sizes "
                                      "were checked, not their contents")
    # what it cannot see: a changed byte; what it still sees: a tensor moved in the file
    flip_first_byte_of(out, "norm.weight")
    assert run_cli("verify", out).returncode == 0
    rewrite_written(out, lambda e: {**e, "bytes": [e["bytes"][0] + 2, e["bytes"][1] + 2]}
                    if e["key"] == "norm.weight" else e)
    bad = run_cli("verify", out)
    assert bad.returncode == 1
    start, length = tensor_span(out / "model.safetensors", "norm.weight")
    assert [line.split(": tensor ")[1] for line in error_lines(bad.stderr)] == [
        f"'norm.weight' is at bytes {start}-{start + length}, the audit says {start + 2}-{start + length + 2}"]


def test_a_rerun_with_no_digest_is_up_to_date(headline: HeadlineStandins, headline_rule: Path, run_cli: Any,
                                              tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ("apply", headline_rule, *source_args(headline.sources), "--out", out, "--digest", "none", "--json")
    assert run_cli(*args).returncode == 0
    again = run_cli(*args)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["status"] == "up_to_date"
