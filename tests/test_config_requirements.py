"""``require.config``: assertions about config fields, decided at plan time.

Through the CLI on the stand-ins: a drafter whose config lacks its verifier layers, or
names a layer the verifier does not have, stops the shipped rules' plan with one line.
Then each check's exact message, on a small rule file over a Llama-shaped drafter and
verifier, and the rule-file errors ``validate`` reports at their FILE:LINE:COL.
"""

from __future__ import annotations

import json
import shutil
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, assert_clean_failure, error_lines, source_args

from ckptxform import api
from ckptxform.errors import RequirementError, RuleError
from ckptxform.rules.loader import load_rules
from ckptxform.standins import (
    LLAMA31_8B_TINY,
    HeadlineStandins,
    build_eagle3_drafter,
    build_llama_eagle3,
    build_llama_verifier,
    make_draft_vocab,
)

RULES = REPO / "rules"


def copy_with_config(checkpoint: Path, dest: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of ``checkpoint`` whose config.json ``edit`` changed in place."""
    shutil.copytree(checkpoint, dest)
    config = json.loads((dest / "config.json").read_text())
    edit(config)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def _without_aux_layers(config: dict[str, Any]) -> None:
    del config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]


def _beyond_the_verifier(config: dict[str, Any]) -> None:
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 40]


# ------------------------------------------------------------------- the shipped rules, CLI


@pytest.mark.parametrize("rule", ["aqmedai_k2_to_k25.yaml", "aqmedai_k2_to_k25_sglang.yaml"])
def test_headline_drafter_without_its_verifier_layers(rule: str, headline: HeadlineStandins, run_cli: Any,
                                                      tmp_path: Path) -> None:
    drafter = copy_with_config(headline.drafter.path, tmp_path / "k2", _without_aux_layers)
    proc = run_cli("plan", RULES / rule, *source_args({**headline.sources, "drafter": str(drafter)}))
    assert_clean_failure(proc)
    [line] = error_lines(proc.stderr)
    path = "'eagle_config.eagle_aux_hidden_state_layer_ids'"
    assert line.startswith(f"error: require.config.eagle_config.eagle_aux_hidden_state_layer_ids ({RULES / rule}:")
    expected = (f"the config.json of source 'drafter' ({drafter}) has no field {path}" if rule.startswith("aqmedai_k2_to_k25.")
                else f"the written config.json has no field {path}")
    assert expected in line, line
    assert "silently" in line or "2, N/2 and N-3" in line  # the rule's reason: what a consumer would do


@pytest.mark.parametrize("rule", ["aqmedai_k2_to_k25.yaml", "aqmedai_k2_to_k25_sglang.yaml"])
def test_headline_drafter_naming_a_layer_beyond_the_verifier(rule: str, headline: HeadlineStandins, run_cli: Any,
                                                             tmp_path: Path) -> None:
    assert headline.verifier.dims.verifier_layers == 8
    drafter = copy_with_config(headline.drafter.path, tmp_path / "k2", _beyond_the_verifier)
    proc = run_cli("plan", RULES / rule, *source_args({**headline.sources, "drafter": str(drafter)}))
    assert_clean_failure(proc)
    [line] = error_lines(proc.stderr)
    config = f"the config.json of source 'drafter' ({drafter})" if rule.startswith("aqmedai_k2_to_k25.") \
        else "the written config.json"
    assert (f"eagle_config.eagle_aux_hidden_state_layer_ids[2] of {config} is 40, not below 8 "
            "(${source.verifier.config.text_config.num_hidden_layers})") in line, line


def test_headline_drafter_trained_on_other_layers_than_the_default(headline: HeadlineStandins, run_cli: Any,
                                                                   tmp_path: Path) -> None:
    """The speculators-layout output names no layers, so its consumers use 2, N/2, N-3."""
    def other_layers(config: dict[str, Any]) -> None:
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 4, 5]

    drafter = copy_with_config(headline.drafter.path, tmp_path / "k2", other_layers)
    proc = run_cli("plan", RULES / "aqmedai_k2_to_k25.yaml",
                   *source_args({**headline.sources, "drafter": str(drafter)}))
    assert_clean_failure(proc)
    [line] = error_lines(proc.stderr)
    assert f"of the config.json of source 'drafter' ({drafter}) is [1, 4, 5], not [2, 4, 5]" in line, line
    # The SGLang variant writes the drafter's own layers, which SGLang reads: no default needed.
    ok = run_cli("plan", RULES / "aqmedai_k2_to_k25_sglang.yaml",
                 *source_args({**headline.sources, "drafter": str(drafter)}))
    assert ok.returncode == 0, ok.stderr


def test_headline_verifier_wider_than_the_drafter(headline: HeadlineStandins, run_cli: Any, tmp_path: Path) -> None:
    """Without target_hidden_size in the written config, fc is sized by the drafter's width."""
    def wider(config: dict[str, Any]) -> None:
        config["text_config"]["hidden_size"] *= 2

    verifier = copy_with_config(headline.verifier.path, tmp_path / "k25", wider)
    proc = run_cli("plan", RULES / "aqmedai_k2_to_k25.yaml",
                   *source_args({**headline.sources, "verifier": str(verifier)}))
    assert_clean_failure(proc)
    lines = error_lines(proc.stderr)
    assert any(f"'hidden_size' of the config.json of source 'drafter' ({headline.drafter.path}) is 112, not 224 "
               "(${source.verifier.config.text_config.hidden_size})" in line for line in lines), lines


def test_eagle3_to_speculators_drafter_without_its_verifier_layers(run_cli: Any, tmp_path: Path) -> None:
    drafter = build_llama_eagle3(tmp_path / "built", seed=2)
    copy = copy_with_config(drafter.path, tmp_path / "drafter", lambda c: c.pop("eagle_config"))
    proc = run_cli("plan", RULES / "eagle3_to_speculators.yaml", "--source", f"drafter={copy}")
    assert_clean_failure(proc)
    [line] = error_lines(proc.stderr)
    assert line.startswith("error: require.config.eagle_aux_hidden_state_layer_ids (")
    assert "the written config.json has no field 'eagle_aux_hidden_state_layer_ids'" in line
    assert "(eagle_config.eagle_aux_hidden_state_layer_ids)" in line  # where the drafter must say it


def test_speculators_to_eagle3_refuses_another_speculator_type(run_cli: Any, tmp_path: Path) -> None:
    dims = LLAMA31_8B_TINY
    built = build_eagle3_drafter(tmp_path / "built", dims, make_draft_vocab(dims.vocab, dims.draft_vocab, seed=1),
                                 layout="speculators")
    copy = copy_with_config(built.path, tmp_path / "drafter",
                            lambda c: c.update(speculators_model_type="dflash"))
    proc = run_cli("plan", RULES / "speculators_to_eagle3.yaml", "--source", f"drafter={copy}")
    assert_clean_failure(proc)
    [line] = error_lines(proc.stderr)
    assert f"'speculators_model_type' of the config.json of source 'drafter' ({copy}) is \"dflash\", not \"eagle3\"" \
        in line, line


# ------------------------------------------------------------------ each check's message


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A native Llama-shaped drafter (safetensors) and its verifier (8 layers, hidden 64)."""
    root = tmp_path_factory.mktemp("llama")
    dims = LLAMA31_8B_TINY
    drafter = build_eagle3_drafter(root / "drafter", dims, make_draft_vocab(dims.vocab, dims.draft_vocab, seed=3),
                                   seed=3)
    verifier = build_llama_verifier(root / "verifier", dims, seed=4)
    return {"drafter": str(drafter.path), "verifier": str(verifier.path)}


def write_rule(tmp_path: Path, require_config: str, *, config: str = "config: {from: drafter}\n") -> Path:
    """A rule copying the drafter's tensors, with ``require.config`` (YAML, 4-space indented)."""
    text = textwrap.dedent("""\
        version: 1
        sources:
          drafter: {path: drafter}
          verifier: {path: verifier}
        convert: drafter
        tensors:
          - match: '.+'
        require:
          config:
        """) + textwrap.indent(textwrap.dedent(require_config), "    ") + config
    path = tmp_path / "rules.yaml"
    path.write_text(text)
    return path


def plan_problems(rule: Path, sources: dict[str, str]) -> list[str]:
    with pytest.raises(RequirementError) as err:
        api.plan(rule, sources=sources)
    return str(err.value).splitlines()


HEAD = "require.config.{path} ({rule}:10)"


def fill(template: str, **values: Any) -> str:
    """``template`` with ``{name}`` replaced (str.format would read the ``${...}`` in it)."""
    for name, value in values.items():
        template = template.replace("{" + name + "}", str(value))
    return template
WRITTEN = "the written config.json"


@pytest.mark.parametrize(("assertion", "message"), [
    ("missing_field: {}\n",
     ("{head}: {written} has no field 'missing_field'; write it in the rule's config section (config.set), or "
     "give the config it starts from the field")),
    ("hidden_act: {equals: gelu}\n", "{head}: 'hidden_act' of {written} is \"silu\", not \"gelu\""),
    # a boolean is not a number: false does not equal 0
    ("tie_word_embeddings: {equals: 0}\n", "{head}: 'tie_word_embeddings' of {written} is false, not 0"),
    ("hidden_act: {one_of: [gelu, relu]}\n", ("{head}: 'hidden_act' of {written} is \"silu\", not one of \"gelu\", "
     "\"relu\"")),
    ("num_attention_heads: {min: 8}\n", "{head}: 'num_attention_heads' of {written} is 4, below the least allowed 8"),
    ("num_attention_heads: {max: 2}\n", ("{head}: 'num_attention_heads' of {written} is 4, above the greatest "
     "allowed 2")),
    ("num_attention_heads: {above: '${config.num_key_value_heads * 2}'}\n",
     "{head}: 'num_attention_heads' of {written} is 4, not above 4 (${config.num_key_value_heads * 2})"),
    ("hidden_size: {below: '${source.verifier.config.hidden_size}'}\n",
     "{head}: 'hidden_size' of {written} is 64, not below 64 (${source.verifier.config.hidden_size})"),
    ("hidden_act: {min: 0}\n", "{head}: 'hidden_act' of {written} is \"silu\", not a number"),
    ("draft_vocab_size: {equals: '${shape.lm_head.weight[0] + 1}'}\n",
     "{head}: 'draft_vocab_size' of {written} is 512, not 513 (${shape.lm_head.weight[0] + 1})"),
    ("eagle_config.eagle_aux_hidden_state_layer_ids: {length: 4}\n",
     "{head}: 'eagle_config.eagle_aux_hidden_state_layer_ids' of {written} has 3 elements, not 4"),
    ("eagle_config.eagle_aux_hidden_state_layer_ids: {each: {below: 5}}\n",
     "{head}: eagle_config.eagle_aux_hidden_state_layer_ids[2] of {written} is 5, not below 5"),
    ("hidden_size: {each: {min: 0}}\n", "{head}: 'hidden_size' of {written} is 64, not a list"),
    ("num_hidden_layers: {of: verifier, equals: '${config.num_attention_heads}'}\n",
     ("{head}: 'num_hidden_layers' of the config.json of source 'verifier' ({verifier}) is 8, not 4 "
     "(${config.num_attention_heads})")),
    ("hidden_act: {equals: gelu, reason: vLLM builds the MLP from it}\n",
     "{head}: 'hidden_act' of {written} is \"silu\", not \"gelu\"; vLLM builds the MLP from it"),
    ("num_hidden_layers: {below: '${source.verifier.config.n_layers}'}\n",
     ("{head}: ${source.verifier.config.n_layers}: the config.json of source "
     "'verifier' ({verifier}) has no field 'n_layers'; add it there, or write the value in the rule file")),
], ids=["present", "equals", "bool-not-number", "one_of", "min", "max", "above", "below-other-source",
        "not-a-number", "equals-shape", "length", "each", "each-not-a-list", "of-source", "reason",
        "bound-unresolved"])
def test_failed_assertion_message(assertion: str, message: str, llama: dict[str, str], tmp_path: Path) -> None:
    rule = write_rule(tmp_path, assertion)
    path = assertion.split(":")[0]
    head = fill(HEAD, path=path, rule=rule)
    assert plan_problems(rule, llama) == [fill(message, head=head, written=WRITTEN, rule=rule,
                                               verifier=llama["verifier"])]


def test_passing_assertions_plan(llama: dict[str, str], tmp_path: Path) -> None:
    rule = write_rule(tmp_path, """\
        eagle_config.eagle_aux_hidden_state_layer_ids:
          each: {min: 0, below: '${source.verifier.config.num_hidden_layers}'}
          length: '${shape.fc.weight[1] // source.verifier.config.hidden_size}'
          equals: [2, '${source.verifier.config.num_hidden_layers // 2}', 5]
        draft_vocab_size: {equals: '${shape.lm_head.weight[0]}', min: 1}
        hidden_act: {one_of: [silu, gelu]}
        target_hidden_size: {optional: true, equals: '${source.verifier.config.hidden_size}'}
        tie_word_embeddings: {equals: false}
        rope_scaling: {optional: true, equals: linear}
        """)
    with api.plan(rule, sources=llama) as plan:
        assert plan.config is not None and plan.config["draft_vocab_size"] == LLAMA31_8B_TINY.draft_vocab
        # the verifier is opened for its config alone, and recorded as a source read
        assert "verifier" in plan.sources


def test_every_failed_assertion_is_reported_in_file_order(llama: dict[str, str], tmp_path: Path) -> None:
    rule = write_rule(tmp_path, """\
        hidden_act: {equals: gelu}
        draft_vocab_size: {equals: '${shape.lm_head.weight[0]}'}
        missing_field: {}
        null_field: {}
        """, config="config:\n  from: drafter\n  set: {null_field: null}\n")
    problems = plan_problems(rule, llama)
    assert [p.split(" ")[0] for p in problems] == ["require.config.hidden_act", "require.config.missing_field",
                                                   "require.config.null_field"]
    assert problems[2].endswith(f"{WRITTEN} has null for 'null_field'; write it in the rule's config section "
                                "(config.set), or give the config it starts from the field")


def test_a_source_config_that_is_absent(llama: dict[str, str], tmp_path: Path) -> None:
    verifier = Path(llama["verifier"])
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(verifier / "model.safetensors", bare / "model.safetensors")
    rule = write_rule(tmp_path, "num_hidden_layers: {of: verifier, min: 1}\n")
    [line] = plan_problems(rule, {**llama, "verifier": str(bare)})
    assert line == (f"require.config.num_hidden_layers ({rule}:10): source 'verifier' ({bare}) has no config.json; "
                    "add one, or point the source at the checkpoint it belongs to")


# ------------------------------------------------------------------ rule-file errors


@pytest.mark.parametrize(("assertion", "config", "message"), [
    ("hidden_size: {of: verifer, min: 1}\n", "config: {from: drafter}\n",
     ("{rule}:10:23: require.config.hidden_size.of: unknown source 'verifer' (defined: drafter, verifier); "
     "did you mean 'verifier'?")),
    ("hidden_size: {below: '${source.verifer.config.hidden_size}'}\n", "config: {from: drafter}\n",
     ("{rule}:10:26: require.config.hidden_size.below: unknown source 'verifer' (defined: drafter, verifier); "
     "did you mean 'verifier'?")),
    ("hidden_size: {min: 1}\n", "",
     ("{rule}:10:5: require.config.hidden_size: asserts a field of the written config.json, but this rule writes "
     "none (no 'config' section); add 'of: SOURCE' to check a source's config, or a 'config' section")),
], ids=["unknown-of", "unknown-source-in-bound", "no-written-config"])
def test_rule_file_error(assertion: str, config: str, message: str, tmp_path: Path) -> None:
    rule = write_rule(tmp_path, assertion, config=config)
    with pytest.raises(RuleError) as err:
        load_rules(rule)
    assert err.value.problems == [fill(message, rule=rule)]


def test_schema_names_an_unknown_check(tmp_path: Path, run_cli: Any) -> None:
    rule = write_rule(tmp_path, "hidden_size: {bellow: 3}\n")
    proc = run_cli("validate", rule)
    assert_clean_failure(proc, code=2)
    assert proc.stderr.splitlines() == [(f"{rule}:10:19: require.config.hidden_size.bellow: unknown key 'bellow'; "
                                        "did you mean 'below'?")]


def test_invert_says_the_config_assertions_are_not_carried(tmp_path: Path) -> None:
    from ckptxform.rules.invert import inverse_yaml

    text = inverse_yaml(load_rules(RULES / "eagle3_to_speculators.yaml"), str(tmp_path / "inverse.yaml"))
    assert "# require.config of the forward rules checks their configs; state the inverse's by hand" in text
    assert "of: drafter" not in text and "eagle_aux_hidden_state_layer_ids:\n      each" not in text
