"""``ckptxform invert`` refuses an inverse that would rename more than the forward did, and
an inverse has no default source (issue 22 item 5, issue 24 item 6)."""

from __future__ import annotations

import hashlib
import textwrap
from pathlib import Path

import torch
from conftest import assert_clean_failure, error_lines, read_output
from test_structural_engine import rand, write_model

HEAD = "version: 1\nsources:\n  model: {path: src}\nconvert: model\n"


def _rules(path: Path, body: str) -> Path:
    path.write_text(HEAD + textwrap.dedent(body))
    return path


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


REGEX = """\
tensors:
  - match: 'a\\.(w.*)'
    rename: 'x.\\1'
  - match: '.+'
"""
TEMPLATE = """\
tensors:
  - key: 'a.{X*}'
    to: 'x.{X}'
  - match: '.+'
"""


def test_inverse_that_renames_a_kept_key_is_refused(tmp_path: Path, run_cli) -> None:  # type: ignore[no-untyped-def]
    """The catch-all keeps a source's ``x.wide``; the inverse ``x\\.(w.*)`` -> ``a.\\1``
    would rename it: refused, naming the key, exit 2, no file written."""
    forward = _rules(tmp_path / "forward.yaml", REGEX)
    done = run_cli("invert", forward, "--out", tmp_path / "inverse.yaml", cwd=tmp_path)
    assert_clean_failure(done, 2)
    assert done.stderr.splitlines() == [(
        f"{forward}:8: tensors[1] writes 'x.w' from the source key 'x.w', but the "
        "inverse's tensors[0] would turn 'x.w' into 'a.w': the forward's renames are not one-to-one (its output "
        "does not say which rule wrote 'x.w'); make the rules' patterns disjoint (rename or skip keys like 'x.w' "
        "explicitly), or give the forward's output (invert --over OUT) to check the keys it holds")]
    assert not (tmp_path / "inverse.yaml").exists()


def test_the_same_with_a_template_rename(tmp_path: Path, run_cli) -> None:  # type: ignore[no-untyped-def]
    forward = _rules(tmp_path / "forward.yaml", TEMPLATE)
    done = run_cli("invert", forward, cwd=tmp_path)
    assert_clean_failure(done, 2)
    assert "forward.yaml:8: tensors[1] writes 'x.w' from the source key 'x.w', but the inverse's tensors[0] " \
           "would turn 'x.w' into 'a.w'" in done.stderr
    assert done.stdout == ""


def test_over_the_forward_output_the_proof_uses_the_keys_it_wrote(tmp_path: Path, run_cli) -> None:  # type: ignore[no-untyped-def]
    """Given OUT, the check reads which source key each output came from: OUT holding the
    kept ``x.wide`` is refused naming it; OUT without such a key inverts, and the inverse
    (run with --source) gives the source back."""
    forward = _rules(tmp_path / "forward.yaml", REGEX)
    write_model(tmp_path / "src", {"a.wide": rand(3, seed=1), "x.wide": rand(2, seed=2)})
    sources = _tree(tmp_path / "src")
    assert run_cli("apply", forward, "--out", tmp_path / "out", cwd=tmp_path).returncode == 1  # both give x.wide
    write_model(tmp_path / "src2", {"a.wide": rand(3, seed=1), "x.wide2": rand(2, seed=2)})
    assert run_cli("apply", forward, "--source", "model=src2", "--out", tmp_path / "out", cwd=tmp_path).returncode == 0
    done = run_cli("invert", forward, "--over", tmp_path / "out", cwd=tmp_path)
    assert_clean_failure(done, 2)
    assert "forward.yaml:8: tensors[1] writes 'x.wide2' from the source key 'x.wide2', but the inverse's " \
           "tensors[0] would turn 'x.wide2' into 'a.wide2'" in done.stderr

    write_model(tmp_path / "src3", {"a.wide": rand(3, seed=1), "y.other": rand(2, seed=2)})
    assert run_cli("apply", forward, "--source", "model=src3", "--out", tmp_path / "out3", cwd=tmp_path).returncode == 0
    done = run_cli("invert", forward, "--over", tmp_path / "out3", "--out", tmp_path / "inverse.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    back = run_cli("apply", tmp_path / "inverse.yaml", "--source", f"model={tmp_path / 'out3'}",
                   "--out", tmp_path / "back", cwd=tmp_path)
    assert back.returncode == 0, back.stderr
    got = read_output(tmp_path / "back")
    assert sorted(got) == ["a.wide", "y.other"] and torch.equal(got["a.wide"], rand(3, seed=1))
    assert _tree(tmp_path / "src") == sources


def test_over_a_directory_without_an_audit_is_one_line(tmp_path: Path, run_cli) -> None:  # type: ignore[no-untyped-def]
    forward = _rules(tmp_path / "forward.yaml", REGEX)
    (tmp_path / "empty").mkdir()
    done = run_cli("invert", forward, "--over", tmp_path / "empty", cwd=tmp_path)
    assert_clean_failure(done, 2)
    assert error_lines(done.stderr) == [(
        f"error: invert --over '{tmp_path / 'empty'}': cannot read '{tmp_path / 'empty' / 'ckptxform_audit.jsonl'}' "
        "(No such file or directory); give the OUT an apply of these rules wrote")]


def test_an_inverse_has_no_default_source(tmp_path: Path, run_cli) -> None:  # type: ignore[no-untyped-def]
    """The inverse of a rule reading ``path: src`` (or a Hub repo) must not read that model:
    without --source it asks for the forward's output, one line, exit 2, nothing written."""
    write_model(tmp_path / "src", {"a.wide": rand(3, seed=1)})
    sources = _tree(tmp_path / "src")
    forward = _rules(tmp_path / "forward.yaml", "tensors:\n  - match: 'a\\.(w.*)'\n    rename: 'x.\\1'\n")
    assert run_cli("invert", forward, "--out", tmp_path / "inverse.yaml", cwd=tmp_path).returncode == 0
    done = run_cli("apply", tmp_path / "inverse.yaml", "--out", tmp_path / "back", cwd=tmp_path)
    assert_clean_failure(done, 2)
    assert error_lines(done.stderr) == [(
        f"error: source 'model' ({tmp_path / 'inverse.yaml'}:6) has no default location: pass --source model=LOCATION, e.g. "
        "the OUT of `ckptxform apply forward.yaml`")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["forward.yaml", "inverse.yaml", "src"]
    assert _tree(tmp_path / "src") == sources

    shipped = run_cli("invert", "phi3_to_llama", "--over", tmp_path / "missing", cwd=tmp_path)
    assert_clean_failure(shipped, 2)
    printed = run_cli("invert", "meta_llama_to_hf", cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr
    assert "sources:\n  model: {example: the OUT of `ckptxform apply meta_llama_to_hf`}\n" in printed.stdout
