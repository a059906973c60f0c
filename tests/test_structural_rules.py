"""The structural rule language: templates, ops and expressions, each error as a golden line.

Also: the ops registry and the schema file agree (editors complete what the loader takes),
and the one expression grammar computes what Python computes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptxform.errors import RuleError
from ckptxform.ops import OPS, ops_schema
from ckptxform.rules.expr import ExpressionError, parse_expression
from ckptxform.rules.loader import load_rules
from ckptxform.rules.templates import TemplateError, expand_from, parse_template

REPO = Path(__file__).resolve().parents[1]
HEAD = "version: 1\nsources:\n  model: {path: .}\ntensors:\n"  # the first rule is on line 5


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


def problems_of(body: str) -> list[str]:
    Path("rules.yaml").write_text(HEAD + body)
    with pytest.raises(RuleError) as info:
        load_rules("rules.yaml")
    return info.value.problems


GOLDEN = [
    pytest.param(
        "  - key: 'a.{L}.w'\n    to: 'b.w'\n",
        ["rules.yaml:6:9: tensors[0].to: {L} of 'key' is not in 'to' and no op reduces it; add stack/concat "
         "over it, or put it in 'to'"],
        id="unreduced-variable"),
    pytest.param(
        "  - key: 'a.w'\n    to: 'b.{P:q,k}'\n",
        ["rules.yaml:6:9: tensors[0].to: {P} of 'to' is neither in 'key' nor made by an op; add split/unstack "
         "into it, or put it in 'key'"],
        id="unmade-variable"),
    pytest.param(
        "  - key: 'a.{E}.w'\n    to: 'b'\n    ops: [{stack: {over: F}}]\n",
        ["rules.yaml:6:9: tensors[0].to: {E} of 'key' is not in 'to' and no op reduces it; add stack/concat "
         "over it, or put it in 'to'",
         "rules.yaml:7:19: tensors[0].ops[0].stack: stack over 'F': 'key' has no variable {F} left to reduce "
         "(variables: E)"],
        id="reduce-unknown-variable"),
    pytest.param(
        "  - key: 'a.{L'\n",
        ["rules.yaml:5:10: tensors[0].key: unbalanced '{' in 'a.{L'"],
        id="unbalanced-template"),
    pytest.param(
        "  - key: 'a.{L}{E}'\n",
        ["rules.yaml:5:10: tensors[0].key: '{E}' follows another variable directly in 'a.{L}{E}'; put literal "
         "text between them so that a key splits one way only"],
        id="adjacent-variables"),
    pytest.param(
        "  - key: 'a.w'\n    ops: [{concatt: {over: P, dim: 0}}]\n",
        ["rules.yaml:6:12: tensors[0].ops[0].concatt: unknown key 'concatt'; did you mean 'concat'?"],
        id="unknown-op"),
    pytest.param(
        "  - key: 'a.{E}.w'\n    to: a\n    ops: [{stack: {over: E, count: '${config.n +}'}}]\n",
        ["rules.yaml:7:36: tensors[0].ops[0].stack.count: '${config.n +}' ends where a number or a reference "
         "is expected"],
        id="bad-expression"),
    pytest.param(
        "  - key: 'a.{E}.w'\n    to: a\n    ops: [{stack: {over: E, count: '${vocab.k9.draft_size}'}}]\n",
        ["rules.yaml:7:36: tensors[0].ops[0].stack.count: unknown vocabulary 'k9' (defined: none)"],
        id="expression-unknown-vocab"),
    pytest.param(
        "  - key: 'a.w'\n    match: 'a'\n",
        ["rules.yaml:6:5: tensors[0].match: 'match' cannot be combined with 'key'"],
        id="key-and-match"),
    pytest.param(
        "  - match: 'a'\n    ops: [{transpose: [0, 1]}]\n",
        ["rules.yaml:6:5: tensors[0].ops: 'ops' needs 'key'"],
        id="ops-need-a-key"),
    pytest.param(
        "  - key: 'x.{q,k}'\n    to: 'y.{a,b,c}'\n",
        ["rules.yaml:6:9: tensors[0].to: {a,b,c} pairs with {q,k} of 'key': enumerate as many names on both "
         "sides"],
        id="enumerations-differ-in-length"),
]


@pytest.mark.parametrize(("body", "expected"), GOLDEN)
def test_golden_message(body: str, expected: list[str]) -> None:
    assert problems_of(body) == expected


def test_a_source_names_its_config_file() -> None:
    Path("rules.yaml").write_text("version: 1\nsources:\n  model: {path: ., config: params.json}\n")
    assert load_rules("rules.yaml").sources["model"].config_file == "params.json"


def test_schema_file_holds_the_registry_ops() -> None:
    schema = json.loads((REPO / "schemas" / "rules.schema.json").read_text())
    assert schema["$defs"]["op"] == ops_schema(), (
        "schemas/rules.schema.json's $defs.op differs from ckptxform.ops: run python -m ckptxform.ops")
    assert sorted(schema["$defs"]["op"]["properties"]) == sorted(OPS)


@pytest.mark.parametrize("text", ["2 + 3 * 4", "(2 + 3) * 4", "17 // 5 - 17 % 5", "-3 * -(2 - 7)", "7 - 2 - 1"])
def test_expressions_compute_what_python_computes(text: str) -> None:
    assert parse_expression("${" + text + "}").evaluate(lambda ref: 0) == eval(text)  # noqa: S307


def test_expression_references_are_resolved_by_the_caller() -> None:
    expr = parse_expression("${config.num_key_value_heads * shape.model.layers.{L}.w[1] // 2}")
    values = {"config.num_key_value_heads": 4, "shape.model.layers.{L}.w[1]": 6}
    assert expr.evaluate(lambda ref: values[ref.text()]) == 12


@pytest.mark.parametrize(("text", "message"), [
    ("${1 / 2}", "unexpected '/' in '${1 / 2}'"),
    ("${(1 + 2}", "'(' at column 1 of '${(1 + 2}' is never closed"),
    ("${foo.bar}", "unknown reference 'foo.bar'; use ${config.PATH}, ${shape.KEY[I]}, ${vocab.NAME.draft_size}, "
                   "${vocab.NAME.vocab_size}, ${source.NAME.repo}, ${source.NAME.config.PATH} or ${output.dtype}"),
    ("${__import__}", "unknown reference '__import__'; use ${config.PATH}, ${shape.KEY[I]}, "
                      "${vocab.NAME.draft_size}, ${vocab.NAME.vocab_size}, ${source.NAME.repo}, "
                      "${source.NAME.config.PATH} or ${output.dtype}"),
])
def test_expression_errors(text: str, message: str) -> None:
    with pytest.raises(ExpressionError) as err:
        parse_expression(text)
    assert str(err.value) == message


def test_arithmetic_takes_numbers_only() -> None:
    with pytest.raises(ExpressionError) as err:
        parse_expression("${config.x + 1}").evaluate(lambda ref: "12")
    assert str(err.value) == "${config.x + 1}: config.x is '12', not a number"


def test_templates_match_enumerate_and_pair_by_position() -> None:
    key = parse_template("model.layers.{L}.experts.{E}.{P:w1,w3}.weight")
    assert key.match("model.layers.3.experts.10.w3.weight") == {"L": "3", "E": "10", "P": "w3"}
    assert key.match("model.layers.3.experts.10.w2.weight") is None
    assert key.match("model.layers.3.4.experts.1.w1.weight") is None  # {L} is one segment
    assert parse_template("{X*}.weight").match("a.b.c.weight") == {"X": "a.b.c"}
    to = parse_template("out.{L}.{P:gate,up}")
    assert expand_from(to, key, {"L": "3", "P": "w3"}) == "out.3.up"
    anon_key, anon_to = parse_template("x.{q,k}_proj"), parse_template("y.{wq,wk}")
    assert expand_from(anon_to, anon_key, anon_key.match("x.k_proj") or {}) == "y.wk"


def test_template_errors() -> None:
    with pytest.raises(TemplateError) as err:
        parse_template("a.{L}.{L}")
    assert str(err.value) == "variable {L} appears twice in 'a.{L}.{L}'; name each part once"
