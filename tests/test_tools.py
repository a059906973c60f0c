"""vocab-diff, diff and demo: golden outputs on stand-ins built from fixed seeds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ckptxform.diff.checkpoint import checkpoint_diff
from ckptxform.standins import KIMI_K2_TINY, build_eagle3_drafter, make_draft_vocab
from ckptxform.vocab.diff import vocab_diff


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptxform", *args], capture_output=True, text=True, cwd=cwd)


@pytest.fixture(scope="module")
def two_drafters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("drafters")
    dims = KIMI_K2_TINY
    a = make_draft_vocab(dims.vocab, dims.draft_vocab, seed=1)
    b = make_draft_vocab(dims.vocab, dims.draft_vocab, seed=2)
    build_eagle3_drafter(root / "a", dims, a, seed=1)
    build_eagle3_drafter(root / "b", dims, b, seed=2)
    build_eagle3_drafter(root / "a_spec", dims, a, seed=1, layout="speculators")
    return root / "a", root / "b", root / "a_spec"


def _expected_stats(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, int]:
    positional = sum(1 for x, y in zip(a, b) if x == y)
    return positional, len(set(a) & set(b))


def test_vocab_diff_golden(two_drafters: tuple[Path, Path, Path]) -> None:
    a, b, _ = two_drafters
    dims = KIMI_K2_TINY
    ids_a = make_draft_vocab(dims.vocab, dims.draft_vocab, seed=1)
    ids_b = make_draft_vocab(dims.vocab, dims.draft_vocab, seed=2)
    positional, shared = _expected_stats(ids_a, ids_b)
    n = dims.draft_vocab
    run = _cli("vocab-diff", str(a), str(b))
    assert run.returncode == 0, run.stderr
    assert run.stdout == (
        f"A: {a} (draft vocabulary {n} of {dims.vocab:,})\n"
        f"B: {b} (draft vocabulary {n} of {dims.vocab:,})\n"
        f"{positional}/{n} positions agree; {shared} tokens shared; {n - shared} only in A; {n - shared} only in B\n"
        f"lm_head rows of B that a permutation carries over from A: {shared}/{n} ({shared / n:.1%})\n"
        f"verdict: different draft vocabularies: permute lm_head rows (permute_rows) and fill {n - shared} rows "
        f"(missing_rows); loading them as they are misaligns {n - positional} of {n} rows\n"
    )
    data = json.loads(_cli("vocab-diff", str(a), str(b), "--json").stdout)
    assert (data["positional_matches"], data["shared"], data["only_in_source"]) == (positional, shared, n - shared)


def test_vocab_diff_identical_and_wrong_encoding(two_drafters: tuple[Path, Path, Path]) -> None:
    a, _, _ = two_drafters
    assert vocab_diff(str(a), str(a)).verdict == "identical draft vocabularies: lm_head rows load as they are"
    run = _cli("vocab-diff", str(a), str(a), "--encoding", "absolute")
    assert run.returncode == 1
    assert "Traceback" not in run.stderr
    assert "set encoding: offset" in run.stderr or "'offset'" in run.stderr


def test_vocab_diff_on_a_checkpoint_without_d2t(tmp_path: Path, two_drafters: tuple[Path, Path, Path]) -> None:
    a, _, _ = two_drafters
    from safetensors.torch import save_file
    import torch

    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    run = _cli("vocab-diff", str(a), str(tmp_path))
    assert run.returncode == 1
    assert run.stderr.strip() == (
        f"error: {tmp_path}: no 'd2t' tensor; give a drafter with a draft vocabulary (d2t/t2d) "
        "or a vocab-map file (.json, .pt, .safetensors)")


def test_diff_finds_the_layout_rename_and_emits_a_working_rule(tmp_path: Path,
                                                               two_drafters: tuple[Path, Path, Path]) -> None:
    a, _, a_spec = two_drafters
    result = checkpoint_diff(str(a), str(a_spec))
    assert [(r.match, r.rename, len(r.keys)) for r in result.renames] == [(r"midlayer\.(.+)", r"layers.0.\1", 10)]
    assert result.only_a == tuple(sorted(k for k in result.only_a if k.startswith("midlayer.")))
    assert result.unexplained_a == [] and result.unexplained_b == []
    run = _cli("diff", str(a), str(a_spec))
    assert run.returncode == 1, run.stderr  # the keys differ
    text = run.stdout
    assert "rename 'midlayer\\\\.(.+)' -> 'layers.0.\\\\1' maps 10 keys of A onto B" in text
    assert "10 only in A:\n  'midlayer.hidden_norm.weight'\n" in text
    # The emitted rule file validates and, applied to A, reproduces B's tensors exactly.
    rules = tmp_path / "generated.yaml"
    rules.write_text(_cli("diff", str(a), str(a_spec), "--emit-rules").stdout)
    assert _cli("validate", str(rules)).returncode == 0
    run = _cli("apply", str(rules), "--out", str(tmp_path / "out"))
    assert run.returncode == 0, run.stderr
    from safetensors.torch import load_file

    got, want = load_file(str(tmp_path / "out" / "model.safetensors")), load_file(str(a_spec / "model.safetensors"))
    assert sorted(got) == sorted(want)
    assert all(torch_equal(got[k], want[k]) for k in want)


def torch_equal(x, y) -> bool:  # type: ignore[no-untyped-def]
    return x.dtype == y.dtype and x.shape == y.shape and bool((x.view(-1).view_as(x) == y).all()) \
        or (x.dtype == y.dtype and x.shape == y.shape and x.numel() == 0)


def test_diff_reports_shape_and_dtype_changes(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2, 3), "y": torch.zeros(4), "only_a": torch.zeros(1)}, str(tmp_path / "a.safetensors"))
    save_file({"x": torch.zeros(3, 2), "y": torch.zeros(4, dtype=torch.bfloat16)}, str(tmp_path / "b.safetensors"))
    run = _cli("diff", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"), "--structure-only")
    assert run.returncode == 1, run.stderr
    assert run.stdout.endswith(
        "0 keys in both with the same shape and dtype\n"
        "1 only in A:\n  'only_a'\n"
        "0 only in B\n"
        "2 in both with another shape or dtype:\n"
        "  'x': A F32 [2, 3], B F32 [3, 2]\n"
        "  'y': A F32 [4], B BF16 [4]\n"
        "{transpose: [0, 1]}: 'x' -> 'x' explains 1 keys of A, 1 of B\n"
        "headers differ\n")


def test_demo_runs_offline_and_says_where_things_are(tmp_path: Path) -> None:
    run = _cli("demo", "--out", str(tmp_path / "demo"), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    out = tmp_path / "demo" / "converted"
    assert (out / "model.safetensors").is_file() and (out / "ckptxform_audit.jsonl").is_file()
    assert "positions agree" in run.stdout and "tokens shared" in run.stdout
    assert f"audit: {out / 'ckptxform_audit.jsonl'}" in run.stdout
    again = _cli("demo", "--out", str(tmp_path / "demo"), cwd=tmp_path)
    assert again.returncode == 1
    assert "already exists from an earlier demo; pass --force" in again.stderr
    assert _cli("demo", "--out", str(tmp_path / "demo"), "--force", cwd=tmp_path).returncode == 0
