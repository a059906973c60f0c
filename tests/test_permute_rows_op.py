"""permute_rows is a verb of ``ops:`` like every other (issue 21 item 1): in a ``key:`` rule's
chain, after another op, and spelled at rule level (``permute_rows:`` + ``missing_rows:``)
it is the same op. The expected rows are computed here from the d2t maps (offset encoding:
draft index i drafts target token i + d2t[i]), not by ckptxform.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckptxform import api
from ckptxform.errors import RequirementError, RuleError
from ckptxform.rules.invert import inverse_yaml
from ckptxform.rules.loader import load_rules

VOCAB = 12
A = [0, 2, 3, 5, 7, 9]  # the drafter's draft tokens (target ids)
B = [2, 4, 5, 9, 11, 0, 7]  # the target vocabulary's: 4 and 11 are not in A


def _d2t(ids: list[int]) -> torch.Tensor:
    return torch.tensor([t - i for i, t in enumerate(ids)], dtype=torch.int64)


def _t2d(ids: list[int]) -> torch.Tensor:
    mask = torch.zeros(VOCAB, dtype=torch.bool)
    mask[ids] = True
    return mask


def _sources(root: Path, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    drafter = {f"layers.{i}.head.weight": torch.randn(len(A), 5, generator=gen).to(dtype) for i in range(2)}
    drafter.update(d2t=_d2t(A), t2d=_t2d(A), extra=torch.randn(5, len(A), generator=gen).to(dtype))
    verifier = {"lm_head.weight": torch.randn(VOCAB, 5, generator=gen).to(dtype)}
    for name, tensors in (("d", drafter), ("t", {"d2t": _d2t(B), "t2d": _t2d(B)}), ("v", verifier)):
        (root / name).mkdir()
        save_file(tensors, str(root / name / "model.safetensors"))
        (root / name / "config.json").write_text("{}")
    return {**{f"d:{k}": v for k, v in drafter.items()}, **{f"v:{k}": v for k, v in verifier.items()}}


def _expected(rows: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """Row j: the source row of B's token j where A has it, else ``fill``'s row of that token."""
    return torch.stack([rows[A.index(t)] if t in A else fill[t] for t in B])


def _rule(root: Path, tensors: str, extra: str = "") -> Path:
    path = root / "r.yaml"
    path.write_text(textwrap.dedent("""\
        version: 1
        sources: {d: {path: d}, t: {path: t}, v: {path: v}}
        convert: d
        vocab:
          a: {source: d, encoding: offset}
          b: {source: t, encoding: offset}
        tensors:
        """) + textwrap.indent(textwrap.dedent(tensors), "  ") + "  - match: 'd2t|t2d'\n    skip: maps\n" + extra)
    return path


FILL = "{rows_of: v, tensor: lm_head.weight}"


def _apply(root: Path, rule: Path) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    result = api.apply(rule, out=root / "out", progress=False)
    records = [json.loads(line) for line in result.audit_path.read_text().splitlines()]
    return load_file(str(root / "out" / "model.safetensors")), records


def test_permute_rows_in_a_key_rule_permutes_every_member(tmp_path: Path) -> None:
    src = _sources(tmp_path)
    rule = _rule(tmp_path, f"""\
        - key: 'layers.{{L}}.head.weight'
          ops:
            - permute_rows: {{from: a, to: b, missing_rows: {FILL}}}
        - match: extra
        """, "require:\n  min_rows_from_source: {layers.1.head.weight: 0.7}\n")
    out, records = _apply(tmp_path, rule)
    for layer in (0, 1):
        key = f"layers.{layer}.head.weight"
        assert torch.equal(out[key], _expected(src[f"d:{key}"], src["v:lm_head.weight"]))
    tensor = {(r["source"], r["key"]): r for r in records if r["event"] == "tensor"}
    head = tensor[("d", "layers.0.head.weight")]
    assert (head["action"], head["reason"]) == ("permuted", "rows permuted a -> b: 5 from the source, 2 filled "
                                                            "(v:lm_head.weight)")
    lent = tensor[("v", "lm_head.weight")]
    assert lent["action"] == "rows" and lent["rule"] == f"{rule}:10"  # the line of missing_rows, inside ops
    written = {r["key"]: r for r in records if r["event"] == "written"}
    assert written["layers.1.head.weight"]["from"] == {"source": "d", "key": "layers.1.head.weight",
                                                       "rows_from_source": 5, "rows_filled": 2,
                                                       "fill": "v:lm_head.weight"}


def test_permute_rows_at_rule_level_is_the_same_op(tmp_path: Path) -> None:
    _sources(tmp_path)
    in_ops = _rule(tmp_path, """\
        - key: 'layers.{L}.head.weight'
          ops: [{permute_rows: {from: a, to: b, missing_rows: {init: mean}}}]
        - match: extra
        """)
    first, _ = _apply(tmp_path, in_ops)
    rule_level = _rule(tmp_path, """\
        - match: 'layers\\.\\d+\\.head\\.weight'
          permute_rows: {from: a, to: b}
          missing_rows: {init: mean}
        - match: extra
        """)
    (tmp_path / "out").rename(tmp_path / "first")
    second, _ = _apply(tmp_path, rule_level)
    assert sorted(first) == sorted(second)
    for key in first:
        assert first[key].view(torch.uint8).numpy().tobytes() == second[key].view(torch.uint8).numpy().tobytes()


def test_permute_rows_after_a_transpose_reads_the_transposed_rows(tmp_path: Path) -> None:
    src = _sources(tmp_path)
    rule = _rule(tmp_path, f"""\
        - match: 'layers\\..*'
        - key: extra
          ops:
            - transpose: [0, 1]
            - permute_rows: {{from: a, to: b, missing_rows: {FILL}}}
        """)
    out, _ = _apply(tmp_path, rule)
    assert torch.equal(out["extra"], _expected(src["d:extra"].T, src["v:lm_head.weight"]))


def test_a_permutation_in_ops_is_checked_like_one_at_rule_level(tmp_path: Path, run_cli: Any) -> None:
    _sources(tmp_path)
    rule = _rule(tmp_path, """\
        - key: 'layers.{L}.head.weight'
          ops: [{permute_rows: {from: a, to: c, missing_rows: {rows_of: w, tensor: lm_head.weight}}}]
        - match: extra
        """)
    proc = run_cli("validate", rule)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"{rule}:9:40: tensors[0].ops[0].permute_rows.to: unknown vocabulary 'c' (defined: a, b)",
        f"{rule}:9:67: tensors[0].ops[0].permute_rows.missing_rows.rows_of: unknown source 'w' "
        "(defined: d, t, v)"]


def test_rows_missing_without_missing_rows_is_a_plan_error_naming_the_op(tmp_path: Path) -> None:
    _sources(tmp_path)
    rule = _rule(tmp_path, """\
        - key: 'layers.{L}.head.weight'
          ops: [{permute_rows: {from: a, to: b}}]
        - match: extra
        """)
    with pytest.raises(Exception) as err:
        api.plan(rule).close()
    assert str(err.value) == (
        f"tensors[0].ops[0] permute_rows ({rule}:9): 2 of 7 rows of 'layers.0.head.weight' are tokens of 'b' "
        "absent from 'a'; add missing_rows (rows_of a full-vocabulary tensor such as the verifier's lm_head, or "
        "init: zeros|mean|normal)")


def test_min_rows_reads_the_permutation_in_ops(tmp_path: Path) -> None:
    _sources(tmp_path)
    rule = _rule(tmp_path, f"""\
        - key: 'layers.{{L}}.head.weight'
          ops: [{{permute_rows: {{from: a, to: b, missing_rows: {FILL}}}}}]
        - match: extra
        """, "require:\n  min_rows_from_source: {layers.0.head.weight: 0.9}\n")
    with pytest.raises(RequirementError) as err:
        api.plan(rule).close()
    assert "only 5 of 7 rows of 'layers.0.head.weight' (71.4%) come from the source, below 90%" in str(err.value)


def test_a_permutation_has_no_inverse_in_either_spelling(tmp_path: Path) -> None:
    _sources(tmp_path)
    rule = _rule(tmp_path, f"""\
        - key: 'layers.{{L}}.head.weight'
          ops: [{{permute_rows: {{from: a, to: b, missing_rows: {FILL}}}}}]
        - match: extra
          permute_rows: {{from: a, to: b}}
          missing_rows: {{init: zeros}}
        """)
    with pytest.raises(RuleError) as err:
        inverse_yaml(load_rules(rule))
    assert err.value.problems == [
        f"{rule}:8: tensors[0] has no inverse: ops[0] permute_rows: a vocabulary permutation (with filled rows) "
        "has no inverse",
        f"{rule}:10: tensors[1] has no inverse: permute_rows: a vocabulary permutation (with filled rows) has "
        "no inverse"]
