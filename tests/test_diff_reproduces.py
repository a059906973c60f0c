"""``diff --emit-rules`` never claims a rule that does not give B (issue 22 item 7): the
rule is applied to A and compared with B; what it does not reproduce is listed at the end
of the rule file with the reason, and diff exits 1 with one line naming the tensors.
Cases of the issue: Mixtral legacy -> fused, Meta -> HF, the EAGLE-3 pair with different
vocabularies (d2t, t2d, lm_head)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from conftest import assert_clean_failure, error_lines
from reference_models import build_meta
from test_structural_engine import MIXTRAL_RULE, mixtral_legacy, write_model

from ckptxform import api
from ckptxform.standins import HeadlineStandins

TAIL = "; the rule file lists why at its end: edit it, then check it with ckptxform apply"


def _tree(*dirs: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for d in dirs for p in sorted(d.rglob("*")) if p.is_file()}


def _diff(tmp_path: Path, a: Path, b: Path) -> tuple[subprocess.CompletedProcess[str], str]:
    """``diff A B --emit-rules --out RULES`` with its own TMPDIR (which must stay empty)."""
    (tmp_path / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "CKPTXFORM_DEBUG"} | {"NO_COLOR": "1",
                                                                             "TMPDIR": str(tmp_path / "tmp")}
    before = _tree(a, b)
    rules = tmp_path / "emitted.yaml"
    proc = subprocess.run([sys.executable, "-m", "ckptxform", "diff", str(a), str(b), "--emit-rules", "--out",
                           str(rules)], capture_output=True, text=True, env=env, timeout=300, check=False)
    assert _tree(a, b) == before
    assert list((tmp_path / "tmp").iterdir()) == []  # the trial apply leaves nothing
    return proc, rules.read_text()


def _not_reproduced(text: str) -> list[str]:
    tail = text.split("# NOT REPRODUCED: applied to A, this rule file does not give B:\n")[1]
    return [line.removeprefix("#   ") for line in tail.splitlines()]


NOT_WRITTEN = "not written (B has it; no rule makes it from A's tensors)"


def test_mixtral_legacy_to_fused(tmp_path: Path) -> None:
    write_model(tmp_path / "a", mixtral_legacy(3, layers=1), {"num_local_experts": 3})
    rules = tmp_path / "fuse.yaml"
    rules.write_text("version: 1\nsources:\n  model: {path: a}\nconvert: model\n" + MIXTRAL_RULE
                     + "config: {from: model}\n")
    api.apply(rules, out=tmp_path / "b", progress=False)
    proc, text = _diff(tmp_path, tmp_path / "a", tmp_path / "b")
    assert_clean_failure(proc, 1)
    assert error_lines(proc.stderr) == [
        "error: the emitted rule does not reproduce B: 1 tensor(s) differ ('model.layers.0.mlp.experts.gate_up_proj')"
        + TAIL]
    # the router moved from block_sparse_moe.gate to mlp.gate with its bytes: a rename found by digest
    assert '  - match: "model\\\\.layers\\\\.0\\\\.block_sparse_moe\\\\.gate\\\\.weight"\n' \
           '    rename: "model.layers.0.mlp.gate.weight"\n' in text
    assert _not_reproduced(text) == [f'"model.layers.0.mlp.experts.gate_up_proj": {NOT_WRITTEN}']


def test_meta_to_hf(tmp_path: Path) -> None:
    """A Meta checkpoint has params.json, no config.json: the rule has no config section to
    fail on, and names every HF tensor it does not write. Ten tensors keep their bytes under
    HF's names (renames found by digest); q and k are permuted for HF's rotary layout."""
    build_meta(tmp_path / "a", dim=16, n_heads=4, n_kv_heads=2, n_layers=1, vocab=32, seed=1)
    api.apply("meta_llama_to_hf", out=tmp_path / "b", sources={"model": str(tmp_path / "a")}, progress=False)
    proc, text = _diff(tmp_path, tmp_path / "a", tmp_path / "b")
    assert_clean_failure(proc, 1)
    assert error_lines(proc.stderr) == [
        "error: the emitted rule does not reproduce B: 2 tensor(s) differ ('model.layers.0.self_attn.k_proj.weight', "
        "'model.layers.0.self_attn.q_proj.weight')" + TAIL]
    assert "# A has no config.json: write the config section B's config.json needs by hand" in text
    assert _not_reproduced(text) == [f'"model.layers.0.self_attn.k_proj.weight": {NOT_WRITTEN}',
                                     f'"model.layers.0.self_attn.q_proj.weight": {NOT_WRITTEN}']
    assert '  - match: "output\\\\.weight"\n    rename: "lm_head.weight"\n' in text


def test_eagle3_pair_with_different_vocabularies(tmp_path: Path, headline: HeadlineStandins,
                                                headline_out: Path) -> None:
    """The K2 drafter and the K2.5 drafter made from it: the keys match, but d2t, t2d and
    lm_head hold another vocabulary's values, which no structural rule moves."""
    proc, text = _diff(tmp_path, Path(headline.sources["drafter"]), headline_out)
    assert_clean_failure(proc, 1)
    assert error_lines(proc.stderr) == [
        "error: the emitted rule does not reproduce B: 3 tensor(s) differ ('d2t', 'lm_head.weight', 't2d')" + TAIL]
    reasons = _not_reproduced(text)
    assert [line.split(":")[0] for line in reasons] == ['"d2t"', '"lm_head.weight"', '"t2d"']
    assert all("its bytes differ from B's (from byte " in line and line.endswith(
        "B's values are not A's moved (a vocabulary map, a cast or new values); write that part of the rule by hand")
        for line in reasons)


def test_a_rule_that_reproduces_b_exits_0(tmp_path: Path) -> None:
    a = {k: v for k, v in mixtral_legacy(1, layers=1).items() if "experts" not in k}
    write_model(tmp_path / "a", a, {"hidden_size": 5})
    write_model(tmp_path / "b", {k.removeprefix("model."): v for k, v in a.items()})
    proc, text = _diff(tmp_path, tmp_path / "a", tmp_path / "b")
    assert proc.returncode == 0, proc.stderr
    assert "NOT REPRODUCED" not in text

