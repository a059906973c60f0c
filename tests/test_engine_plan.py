"""plan: decided from headers, the rule file and the vocab maps; no weight byte is read.

Covers the Plan of the headline rule (vocabulary statistics computed independently here,
output entries, one record per source tensor), ``ckptxform plan`` text and ``--json``,
and that planning imports no torch and reads nothing but d2t/t2d.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import read_audit, source_args

from ckptxform import api
from ckptxform.engine.plan.recipes import CopyTensor, VocabField
from ckptxform.errors import RequirementError, SourceNotFoundError, UnmatchedRuleError
from ckptxform.sources.local import LocalCheckpoint
from ckptxform.standins import HeadlineStandins, build_eagle3_drafter


def vocab_statistics(k2: tuple[int, ...], k25: tuple[int, ...]) -> dict[str, int]:
    shared = set(k2) & set(k25)
    return {"positional": sum(1 for a, b in zip(k2, k25, strict=True) if a == b), "shared": len(shared),
            "only_k2": len(set(k2) - shared), "only_k25": len(set(k25) - shared)}


@pytest.fixture
def read_log(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, int, int]]:
    """Every LocalCheckpoint.read call: (location, key, start, length)."""
    calls: list[tuple[str, str, int, int]] = []
    real = LocalCheckpoint.read

    def recording(self: LocalCheckpoint, info: Any, start: int = 0, length: int | None = None) -> bytes:
        data = real(self, info, start, length)
        calls.append((self.location, info.key, start, len(data)))
        return data

    monkeypatch.setattr(LocalCheckpoint, "read", recording)
    return calls


def test_plan_of_the_headline_rule(headline: HeadlineStandins, headline_rule: Path) -> None:
    plan = api.plan(headline_rule, sources=headline.sources)
    try:
        stats = vocab_statistics(headline.k2_ids, headline.k25_ids)
        alignment = plan.alignments["k2->k25"]
        assert (alignment.positional_matches, alignment.shared, alignment.only_in_source,
                alignment.only_in_target) == (stats["positional"], stats["shared"], stats["only_k2"],
                                              stats["only_k25"])
        outputs = {o.key: o for o in plan.outputs}
        expected_keys = {"layers.0." + k.removeprefix("midlayer.") for k in headline.drafter.keys
                         if k.startswith("midlayer.")} | {"fc.weight", "norm.weight", "lm_head.weight",
                                                          "d2t", "t2d"}
        assert set(outputs) == expected_keys
        lm = outputs["lm_head.weight"]
        rows = lm.recipe.row_account()  # a vocabulary row permutation
        assert rows is not None
        assert rows.from_source == stats["shared"]
        assert rows.filled == stats["only_k25"]
        assert lm.shape == (len(headline.k25_ids), headline.drafter.dims.hidden)
        assert isinstance(outputs["d2t"].recipe, VocabField) and outputs["d2t"].recipe.vocab == "k25"
        rename = outputs["layers.0.self_attn.q_proj.weight"].recipe
        assert rename == CopyTensor("drafter", "midlayer.self_attn.q_proj.weight")
        assert outputs["fc.weight"].loaded and not outputs["d2t"].loaded
        # one record per tensor of each opened file; the verifier's other shards are not opened
        keys = [(r.source, r.key) for r in plan.records]
        assert len(keys) == len(set(keys))
        verifier_sources = {r.key for r in plan.records if r.source == "verifier"}
        weight_map = json.loads((headline.verifier.path / "model.safetensors.index.json").read_text())["weight_map"]
        lm_shard = weight_map["language_model.lm_head.weight"]
        assert verifier_sources == {k for k, shard in weight_map.items() if shard == lm_shard}
        assert plan.warnings == ()
    finally:
        plan.close()


def test_plan_reads_only_the_vocabulary_maps(headline: HeadlineStandins, headline_rule: Path,
                                             read_log: list[tuple[str, str, int, int]]) -> None:
    plan = api.plan(headline_rule, sources=headline.sources)
    plan.close()
    assert {key for _, key, _, _ in read_log} == {"d2t", "t2d"}
    assert {loc for loc, _, _, _ in read_log} == {headline.sources["drafter"], headline.sources["target_vocab"]}


def test_a_failing_apply_reads_no_weight_and_writes_nothing(
        headline: HeadlineStandins, headline_rule: Path, tmp_path: Path,
        read_log: list[tuple[str, str, int, int]]) -> None:
    drafter = build_eagle3_drafter(tmp_path / "k2", headline.drafter.dims, headline.k2_ids,
                                   omit_keys=["midlayer.post_attention_layernorm.weight"])
    sources = {**headline.sources, "drafter": str(drafter.path)}
    with pytest.raises(RequirementError, match=re.escape("'layers.0.post_attention_layernorm.weight' was not loaded")):
        api.apply(headline_rule, out=tmp_path / "out", sources=sources)
    assert {key for _, key, _, _ in read_log} <= {"d2t", "t2d"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k2"]


def test_plan_command_shows_the_vocabulary_statistics(headline: HeadlineStandins, headline_rule: Path,
                                                      run_cli: Any) -> None:
    proc = run_cli("plan", headline_rule, *source_args(headline.sources))
    assert proc.returncode == 0, proc.stderr
    s = vocab_statistics(headline.k2_ids, headline.k25_ids)
    n = len(headline.k25_ids)
    assert (f"vocabulary k2->k25: {s['positional']:,}/{n:,} positions agree; {s['shared']:,} tokens "
            f"shared; {s['only_k2']:,} only in k2; {s['only_k25']:,} only in k25") in proc.stdout
    assert (f"lm_head.weight: {s['shared']:,} of {n:,} rows from drafter ({s['shared'] / n:.1%}), "
            f"{s['only_k25']:,} filled from verifier:language_model.lm_head.weight") in proc.stdout
    assert "layers.0.post_attention_layernorm.weight" in proc.stdout


def test_plan_json_lists_the_records_the_audit_writes(headline: HeadlineStandins, headline_rule: Path,
                                                      headline_out: Path, run_cli: Any) -> None:
    proc = run_cli("plan", headline_rule, *source_args(headline.sources), "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    audit = read_audit(headline_out)
    assert data["tensors"] == [e for e in audit if e["event"] == "tensor"]
    assert data["rules_sha256"] == audit[0]["rules_sha256"]
    assert data["sources"] == audit[0]["sources"]
    vocab = data["vocab"]["k2->k25"]
    s = vocab_statistics(headline.k2_ids, headline.k25_ids)
    assert (vocab["positional_matches"], vocab["shared"]) == (s["positional"], s["shared"])
    assert {o["key"] for o in data["outputs"]} == {e["key"] for e in audit if e["event"] == "written"}


def test_plan_command_does_not_import_torch(headline: HeadlineStandins, headline_rule: Path) -> None:
    script = textwrap.dedent("""
        import sys
        from ckptxform.cli import main
        try:
            main(sys.argv[1:], standalone_mode=False)
        except SystemExit as stop:
            assert not stop.code, stop.code
        print("torch imported:", "torch" in sys.modules, file=sys.stderr)
    """)
    proc = subprocess.run([sys.executable, "-c", script, "plan", str(headline_rule),
                           *source_args(headline.sources)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "vocabulary k2->k25" in proc.stdout
    assert "torch imported: False" in proc.stderr


def test_a_missing_permuted_tensor_is_reported_once(headline: HeadlineStandins, headline_rule: Path,
                                                    tmp_path: Path) -> None:
    """The rule that reads it matching nothing says so, once, at its line; require.loaded
    and min_rows_from_source must not add second, wrong fixes ("name the output key of a
    permute_rows rule") for the same missing source tensor."""
    drafter = build_eagle3_drafter(tmp_path / "k2", headline.drafter.dims, headline.k2_ids,
                                   omit_keys=["lm_head.weight"])
    with pytest.raises(UnmatchedRuleError) as err:
        api.plan(headline_rule, sources={**headline.sources, "drafter": str(drafter.path)})
    [line] = str(err.value).splitlines()
    assert re.search(r"1 tensor rule matches no tensor of source 'drafter' \(.*\): tensors\[\d+\] "
                     rf"\({re.escape(str(headline_rule))}:\d+\) match 'lm_head\\.weight'", line), line
    assert "min_rows_from_source" not in line and "permute_rows" not in line


@pytest.mark.parametrize(("omit", "fix"), [
    ("d2t", "pass --source drafter=LOCATION of a checkpoint that has it"),
    ("t2d", "set vocab.k2.t2d to its key, or t2d_optional: true (it is then derived from d2t)"),
])
def test_a_missing_vocabulary_tensor_says_how_to_fix_it(omit: str, fix: str, headline: HeadlineStandins,
                                                        headline_rule: Path, tmp_path: Path) -> None:
    drafter = build_eagle3_drafter(tmp_path / "k2", headline.drafter.dims, headline.k2_ids, omit_keys=[omit])
    with pytest.raises(SourceNotFoundError) as err:
        api.plan(headline_rule, sources={**headline.sources, "drafter": str(drafter.path)})
    message = str(err.value)
    assert message.startswith("vocab.k2 (") and f"has no tensor {omit!r}" in message
    assert message.endswith(fix)
    assert (err.value.source, err.value.key) == ("drafter", omit)


def test_a_tensor_used_twice_is_recorded_once_with_both_uses(headline: HeadlineStandins,
                                                             rule_variant: Any) -> None:
    """The verifier's lm_head lends missing rows and is also copied whole by `add`."""
    rule = rule_variant({"add:\n": "add:\n  verifier_lm_head.weight: "
                                   "{source: verifier, tensor: language_model.lm_head.weight}\n"})
    with api.plan(rule, sources=headline.sources) as plan:  # its records are read before it is closed
        [record] = [r for r in plan.records if (r.source, r.key) == ("verifier", "language_model.lm_head.weight")]
    assert (record.action, record.target) == ("copied", "verifier_lm_head.weight")
    assert "added as 'verifier_lm_head.weight'" in record.reason and "rows read for tokens" in record.reason


def test_plan_shows_the_files_apply_writes_with_their_sizes(
        headline: HeadlineStandins, rule_variant: Any, run_cli: Any, tmp_path: Path) -> None:
    """Issue 35 item 8: the output files and their sizes, from headers, before a byte is written."""
    rules = rule_variant({"  max_shard_size: 5GB": "  max_shard_size: 64KB"})
    planned = api.plan(rules, sources=headline.sources)
    out = api.apply(rules, out=tmp_path / "out", sources=headline.sources, progress=False).out
    written = [(p.name, p.stat().st_size) for p in sorted(out.glob("*.safetensors"))]
    assert len(written) > 1 and list(planned.output_files) == written
    shown = run_cli("plan", rules, *source_args(headline.sources))
    assert shown.returncode == 0, shown.stderr
    [line] = [ln for ln in shown.stdout.splitlines() if ln.startswith(f"  {len(written)} files + its index: ")]
    assert line.startswith(f"  {len(written)} files + its index: {written[0][0]} (")
