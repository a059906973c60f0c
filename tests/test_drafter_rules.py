"""The MTP and DFlash rules' plan-time guarantees, without the speculators package: what
each reads of its sources, and the one-line refusals their consumers need.

What they write is compared with speculators' own converters in
tests/test_drafter_consumers.py (marked ``consumer``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

from ckptxform import api
from ckptxform.rules.expr import ExpressionError, parse_expression
from ckptxform.standins.dflash import QWEN3_DFLASH_TINY, build_dflash_drafter, build_qwen3_verifier
from ckptxform.standins.mtp import build_qwen3_next_verifier

RULES = REPO / "rules"
DFLASH = RULES / "dflash_to_speculators.yaml"


def _dflash_sources(root: Path, **drafter: Any) -> dict[str, str]:
    dims = drafter.pop("dims", QWEN3_DFLASH_TINY)
    return {"model": str(build_dflash_drafter(root / "drafter", dims, **drafter).path),
            "verifier": str(build_qwen3_verifier(root / "verifier", dims).path)}


def _plan_error(run_cli: Any, rules: Path, sources: dict[str, str]) -> str:
    args = [a for name, loc in sources.items() for a in ("--source", f"{name}={loc}")]
    proc = run_cli("plan", rules, *args)
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout
    return proc.stderr


def test_dflash_aux_ids_are_zlab_target_ids_plus_one(tmp_path: Path) -> None:
    plan = api.plan(DFLASH, sources=_dflash_sources(tmp_path))
    assert QWEN3_DFLASH_TINY.target_layer_ids == (1, 4, 6)
    assert plan.config is not None and plan.config["aux_hidden_state_layer_ids"] == [2, 5, 7]
    assert plan.config["block_size"] == 16
    assert plan.config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 15


def test_dflash_block_size_is_read_from_dflash_config_in_newer_drafters(tmp_path: Path) -> None:
    import dataclasses

    dims = dataclasses.replace(QWEN3_DFLASH_TINY, block_size=8, block_size_in_dflash_config=True)
    plan = api.plan(DFLASH, sources=_dflash_sources(tmp_path, dims=dims))
    assert plan.config is not None and plan.config["block_size"] == 8
    assert plan.config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 7


def test_dflash_drafter_without_target_layer_ids_fails_the_plan_in_one_line(run_cli: Any, tmp_path: Path) -> None:
    err = _plan_error(run_cli, DFLASH, _dflash_sources(tmp_path, omit_config=("dflash_config.target_layer_ids",)))
    assert err.count("\n") == 1
    assert err.startswith(f"error: require.config.dflash_config.target_layer_ids ({DFLASH}:")
    assert "the config.json of source 'model' (" in err
    assert "has no field 'dflash_config.target_layer_ids'" in err
    assert "without them speculators and vLLM guess" in err


def test_dflash_drafter_naming_a_layer_beyond_the_verifier_fails_the_plan_in_one_line(
        run_cli: Any, tmp_path: Path) -> None:
    import dataclasses

    dims = dataclasses.replace(QWEN3_DFLASH_TINY, target_layer_ids=(1, 4, QWEN3_DFLASH_TINY.verifier_layers))
    err = _plan_error(run_cli, DFLASH, _dflash_sources(tmp_path, dims=dims))
    assert err.count("\n") == 1
    assert err.startswith(f"error: require.config.dflash_config.target_layer_ids ({DFLASH}:")
    assert f"is {QWEN3_DFLASH_TINY.verifier_layers}, not below {QWEN3_DFLASH_TINY.verifier_layers}" in err


def test_dflash_id_of_the_verifiers_last_layer_is_dropped_and_fc_then_refused(run_cli: Any, tmp_path: Path) -> None:
    """z-lab id N-1 reads the last layer, which speculators drops: fc is then one verifier
    hidden state wider than speculators builds it (its converter fails at load)."""
    import dataclasses

    last = QWEN3_DFLASH_TINY.verifier_layers - 1
    dims = dataclasses.replace(QWEN3_DFLASH_TINY, target_layer_ids=(1, 4, last))
    err = _plan_error(run_cli, DFLASH, _dflash_sources(tmp_path, dims=dims))
    assert err.count("\n") == 1
    assert err.startswith(f"error: require.config.aux_hidden_state_layer_ids ({DFLASH}:")
    assert "'aux_hidden_state_layer_ids' of the written config.json has 2 elements, not 3" in err
    assert "a target_layer_id of the verifier's last layer is dropped" in err


def test_mtp_extract_reads_only_the_mtp_layer_and_skips_the_main_stack(tmp_path: Path) -> None:
    verifier = build_qwen3_next_verifier(tmp_path / "Qwen3-Next", seed=3)
    result = api.apply(RULES / "mtp_extract.yaml", out=tmp_path / "out", sources={"verifier": str(verifier.path)},
                       progress=False)
    records = [json.loads(line) for line in (result.out / "ckptxform_audit.jsonl").read_text().splitlines()]
    tensors = {r["key"]: r for r in records if r["event"] == "tensor"}
    assert sorted(tensors) == sorted(verifier.keys)
    for key, record in tensors.items():
        assert (record["action"] == "skipped") == (not key.startswith("mtp.")), record
    written = {r["key"] for r in records if r["event"] == "written"}
    assert written and all(k.startswith("mtp_layers.0.") for k in written)
    fused = next(r for r in records if r["event"] == "written" and r["key"].endswith("experts.gate_up_proj"))
    assert fused["shape"] == [3, 48, 40]


@pytest.mark.parametrize(("text", "value"), [
    ("${config.ids + 1}", [2, 5, 7]),
    ("${without(config.ids + 1, config.n)}", [2, 5]),
    ("${config.ids * 2 - 1}", [1, 7, 11]),
    ("${config.absent ?? config.n - 1}", 6),
    ("${source.v.config}", {"n": 7}),
])
def test_expressions_on_lists_and_expression_defaults(text: str, value: Any) -> None:
    from ckptxform.engine.plan.references import _AbsentField

    values = {"config.ids": [1, 4, 6], "config.n": 7, "source.v.config": {"n": 7}}

    def resolve(ref: Any) -> Any:
        if ref.text() not in values:
            raise _AbsentField(ref.text())
        return values[ref.text()]

    expression = parse_expression(text)
    try:
        got = expression.evaluate(resolve)
    except _AbsentField:
        got = expression.evaluate_default(resolve)
    assert got == value


@pytest.mark.parametrize(("text", "message"), [
    ("${without(config.ids)}", "without() takes 2 arguments, not 1, in '${without(config.ids)}'"),
    ("${config.ids + config.ids}", "${config.ids + config.ids}: '+' between two lists; one side must be a number"),
    ("${without(config.n, 1)}", "${without(config.n, 1)}: without() takes a list first, not 7"),
])
def test_list_expression_errors_say_what_is_wrong(text: str, message: str) -> None:
    values = {"config.ids": [1, 4, 6], "config.n": 7}
    with pytest.raises(ExpressionError) as err:
        parse_expression(text).evaluate(lambda ref: values[ref.text()])
    assert str(err.value) == message


def _graft(tmp_path: Path, drafter: Path, verifier: Path) -> Path:
    return api.apply(RULES / "mtp_graft.yaml", out=tmp_path / "grafted",
                     sources={"drafter": str(drafter), "verifier": str(verifier)}, progress=False).out


@pytest.mark.parametrize("seed", [5, 6])
def test_mtp_graft_of_the_extracted_drafter_gives_the_verifier_back_byte_for_byte(tmp_path: Path, seed: int) -> None:
    from conftest import read_output, same_bits

    verifier = build_qwen3_next_verifier(tmp_path / "Qwen3-Next", seed=seed).path
    drafter = api.apply(RULES / "mtp_extract.yaml", out=tmp_path / "drafter", sources={"verifier": str(verifier)},
                        progress=False).out
    grafted = read_output(_graft(tmp_path, drafter, verifier))
    original = read_output(verifier)
    assert sorted(grafted) == sorted(original)
    assert not [k for k in original if not same_bits(grafted[k], original[k])]


def test_mtp_graft_of_a_changed_drafter_changes_exactly_the_mtp_tensors(tmp_path: Path) -> None:
    from conftest import read_audit, read_output, same_bits

    verifier = build_qwen3_next_verifier(tmp_path / "Qwen3-Next", seed=7).path
    # a fine-tuned head: the same verifier with other MTP values, extracted
    tuned = build_qwen3_next_verifier(tmp_path / "tuned", seed=7, mtp_seed=70).path
    drafter = api.apply(RULES / "mtp_extract.yaml", out=tmp_path / "drafter", sources={"verifier": str(tuned)},
                        progress=False).out
    out = _graft(tmp_path, drafter, verifier)
    grafted, original, expected = read_output(out), read_output(verifier), read_output(tuned)
    changed = {k for k in original if not same_bits(grafted[k], original[k])}
    assert changed == {k for k in original if k.startswith("mtp.")}
    assert all(same_bits(grafted[k], expected[k]) for k in changed)
    events = read_audit(out)
    from_drafter = {e["key"] for e in events if e["event"] == "written"
                    and "drafter" in json.dumps(e.get("from"))}
    assert from_drafter == changed
    skipped = {e["key"] for e in events if e["event"] == "tensor" and e["source"] == "verifier"
               and e["action"] == "skipped"}
    assert skipped == changed


def test_mtp_graft_of_a_drafter_missing_a_tensor_fails_the_plan(run_cli: Any, tmp_path: Path) -> None:
    from conftest import read_output
    from safetensors.torch import save_file

    verifier = build_qwen3_next_verifier(tmp_path / "Qwen3-Next", seed=8).path
    drafter = api.apply(RULES / "mtp_extract.yaml", out=tmp_path / "drafter", sources={"verifier": str(verifier)},
                        progress=False).out
    broken = tmp_path / "broken"
    broken.mkdir()
    tensors = read_output(drafter)
    del tensors["mtp_layers.0.self_attn.k_proj.weight"]
    save_file(tensors, broken / "model.safetensors")
    (broken / "config.json").write_text((drafter / "config.json").read_text())
    err = _plan_error(run_cli, RULES / "mtp_graft.yaml", {"drafter": str(broken), "verifier": str(verifier)})
    assert err.count("\n") == 1
    assert err.startswith(f"error: require.loaded ({RULES / 'mtp_graft.yaml'}:")
    assert "'mtp.layers.0.self_attn.k_proj.weight' was not loaded from source 'drafter'" in err


# -- DeepSeek-V3 NextN ------------------------------------------------------------------------

NEXTN = RULES / "deepseek_nextn_extract.yaml"


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ckptxform.standins.quantized import DEEPSEEK_V3_61_TINY, build_kimi_k2

    return build_kimi_k2(tmp_path_factory.mktemp("ds") / "DeepSeek-V3", DEEPSEEK_V3_61_TINY, num_shards=8,
                         seed=9, nextn=True).path


def test_deepseek_nextn_extract_writes_what_sglangs_export_script_writes(deepseek_v3: Path, tmp_path: Path) -> None:
    """scripts/export_deepseek_nextn.py: every tensor of model.layers.{num_hidden_layers}
    but embed_tokens and shared_head.head, renamed to model.layers.0, as it is (FP8 and its
    scales too); the config with num_hidden_layers 1 and the NextN architecture."""
    from conftest import read_output, same_bits

    out = api.apply(NEXTN, out=tmp_path / "nextn", sources={"verifier": str(deepseek_v3)}, progress=False).out
    source = read_output(deepseek_v3)
    config = json.loads((deepseek_v3 / "config.json").read_text())
    prefix = f"model.layers.{config['num_hidden_layers']}."
    expected = {"model.layers.0." + k.removeprefix(prefix): v for k, v in source.items()
                if k.startswith(prefix) and "embed_tokens" not in k and "shared_head.head" not in k}
    assert (out / "nextn_layer_parameters.safetensors").is_file()
    written = read_output(out)
    assert sorted(written) == sorted(expected)
    assert not [k for k in expected if not same_bits(written[k], expected[k])]
    assert any(str(v.dtype) == "torch.float8_e4m3fn" for v in written.values())
    assert json.loads((out / "config.json").read_text()) == {
        **config, "num_hidden_layers": 1, "architectures": ["DeepseekV3ForCausalLMNextN"]}


def test_deepseek_nextn_extract_of_a_verifier_whose_mtp_layer_was_dropped_fails_the_plan(
        deepseek_v3: Path, run_cli: Any, tmp_path: Path) -> None:
    """A conversion tool that dropped layer 61 but kept num_nextn_predict_layers: 1 (vLLM
    would serve a random head): the rules that read layer 61 match nothing, and say so."""
    import shutil

    from ckptxform.standins.quantized import DEEPSEEK_V3_61_TINY, build_kimi_k2

    dropped = build_kimi_k2(tmp_path / "dropped", DEEPSEEK_V3_61_TINY, num_shards=8, seed=9).path
    shutil.copy(deepseek_v3 / "config.json", dropped / "config.json")
    err = _plan_error(run_cli, NEXTN, {"verifier": str(dropped)})
    assert err.startswith(f"error: {NEXTN}: 2 tensor rules match no tensor of source 'verifier' ")
    assert r"match 'model\.layers\.61\.(.+)'" in err
