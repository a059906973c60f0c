"""``ckptxform preflight``: a correct converted drafter passes against its verifier (exit 0),
and each fault the consumers load silently wrong is named (exit 1), with the finding's
wording checked; ``--json`` gives a list per consumer; usage errors exit 2.

The drafters are stand-ins converted by shipped rules, then broken one fault at a time
by rewriting their config.json or a vocabulary tensor (never the source they came from).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO
from safetensors.torch import load_file, save_file

from ckptxform import api
from ckptxform.standins.dflash import build_dflash_drafter, build_qwen3_verifier
from ckptxform.standins.drafters import build_llama_eagle3
from ckptxform.standins.verifiers import build_llama_verifier
from ckptxform.vocab.preflight import preflight

RULES = REPO / "rules"


@pytest.fixture(scope="module")
def eagle3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A native EAGLE-3 drafter converted to the speculators layout, and its verifier."""
    root = tmp_path_factory.mktemp("eagle3")
    drafter = build_llama_eagle3(root / "EAGLE3-LLaMA3.1-Instruct-8B").path
    verifier = build_llama_verifier(root / "Llama-3.1-8B-Instruct").path
    out = api.apply(RULES / "eagle3_to_speculators.yaml", out=root / "out", sources={"drafter": str(drafter)},
                    progress=False).out
    return out, verifier


@pytest.fixture(scope="module")
def dflash(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("dflash")
    model = build_dflash_drafter(root / "Qwen3-8B-DFlash-b16").path
    verifier = build_qwen3_verifier(root / "Qwen3-8B").path
    out = api.apply(RULES / "dflash_to_speculators.yaml", out=root / "out",
                    sources={"model": str(model), "verifier": str(verifier)}, progress=False).out
    return out, verifier


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, change: Any) -> None:
    config = json.loads((path / "config.json").read_text())
    change(config)
    (path / "config.json").write_text(json.dumps(config))


def _edit_tensor(path: Path, key: str, change: Any) -> None:
    [file] = [f for f in path.glob("*.safetensors")]
    tensors = load_file(file)
    tensors[key] = change(tensors[key].clone())
    save_file(tensors, file)


def _only(report: Any, check: str) -> list[Any]:
    found = [f for f in report.findings if f.check == check]
    assert found and all(f.check == check for f in report.findings), report.text()
    return found


def test_converted_drafter_passes_against_its_verifier(eagle3: tuple[Path, Path]) -> None:
    out, verifier = eagle3
    report = preflight(str(out), verifier=str(verifier))
    assert (report.family, report.layout, report.consumers) == ("eagle3", "speculators", ("speculators", "vllm"))
    assert report.exit_code == 0, report.text()
    assert report.unchecked == ()
    every = preflight(str(out), verifier=str(verifier), consumers="speculators,vllm,sglang,llama.cpp,transformers")
    # SGLang reads the verifier layers from eagle_config only: this speculators config has them at the top
    assert {f.consumer for f in every.findings} == {"sglang"}
    assert [f.check for f in every.findings] == ["aux-ids-missing"]


def test_t2d_not_the_mask_of_d2t(eagle3: tuple[Path, Path], tmp_path: Path) -> None:
    out = _copy(eagle3[0], tmp_path / "d")
    d2t = load_file(out / "model.safetensors")["d2t"]
    first = int(d2t[0])  # target of draft index 0

    def unmark_first_and_mark_other(t2d: torch.Tensor) -> torch.Tensor:
        t2d[first] = False
        t2d[-1] = True
        return t2d
    _edit_tensor(out, "t2d", unmark_first_and_mark_other)
    last_id = load_file(out / "model.safetensors")["t2d"].shape[0] - 1
    report = preflight(str(out), verifier=str(eagle3[1]))
    [finding] = _only(report, "t2d-mask")
    assert finding.consumer == "speculators"  # vLLM and SGLang read d2t only
    assert finding.text() == (
        f"t2d: t2d is not the mask of d2t's targets: it marks 1 token ids d2t does not map to (first: "
        f"{last_id}) and it leaves 1 of d2t's "
        f"targets unmarked (first: {first}); speculators trains and scores with the wrong draft tokens; fix: "
        "rebuild t2d from d2t (True at index + d2t[index])")
    assert report.exit_code == 1


def test_d2t_offset_past_the_verifier_vocabulary(eagle3: tuple[Path, Path], tmp_path: Path) -> None:
    out = _copy(eagle3[0], tmp_path / "d")

    def push_last(d2t: torch.Tensor) -> torch.Tensor:
        d2t[-1] += 4096
        return d2t
    _edit_tensor(out, "d2t", push_last)
    d2t = load_file(out / "model.safetensors")["d2t"]
    last = d2t.shape[0] - 1
    report = preflight(str(out), verifier=str(eagle3[1]))
    found = [f for f in report.findings if f.check == "d2t-range"]
    assert [f.consumer for f in found] == ["speculators", "vllm"]
    assert found[0].text() == (
        f"d2t: draft index {last} maps to token id {last + int(d2t[-1])} (d2t[{last}] = {int(d2t[-1])}, "
        "target = index + d2t[index]), outside [0, 4096) of the verifier's vocabulary: the drafter proposes a token "
        "the verifier does not have; fix: take d2t from the drafter trained for this verifier, or give the "
        "verifier whose vocabulary it indexes (--verifier)")
    # t2d no longer marks that target: the same fault, seen by the one consumer reading t2d
    assert {f.check for f in report.findings} == {"d2t-range", "t2d-mask"}


def test_d2t_stored_as_absolute_ids_is_named(eagle3: tuple[Path, Path], tmp_path: Path) -> None:
    out = _copy(eagle3[0], tmp_path / "d")
    _edit_tensor(out, "d2t", lambda d2t: d2t + torch.arange(d2t.shape[0]))
    report = preflight(str(out), verifier=str(eagle3[1]), consumers="vllm")
    [finding] = _only(report, "d2t-range")
    assert finding.fix == "d2t holds absolute token ids: store offsets, d2t[i] = target id - i"


def test_draft_vocab_size_disagrees_with_lm_head(eagle3: tuple[Path, Path], tmp_path: Path) -> None:
    out = _copy(eagle3[0], tmp_path / "d")
    _edit_config(out, lambda c: c.update(draft_vocab_size=511))
    report = preflight(str(out), verifier=str(eagle3[1]), consumers="vllm")
    [finding] = [f for f in report.findings if f.check == "draft-vocab-size"]
    assert finding.text() == (
        "draft_vocab_size: the config says 511 draft tokens but lm_head.weight has 512 rows: the model is built "
        "with the config's size and the checkpoint's lm_head does not fit it; fix: set draft_vocab_size to "
        "lm_head.weight's rows (and check d2t has as many entries)")
    # the plan-time config-vs-tensors check says the same of the whole config
    assert {f.check for f in report.findings} == {"draft-vocab-size", "config-tensors"}
    assert report.exit_code == 1


def test_aux_ids_out_of_range_for_the_verifier(eagle3: tuple[Path, Path], tmp_path: Path) -> None:
    out = _copy(eagle3[0], tmp_path / "d")
    _edit_config(out, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 4, 8]))
    report = preflight(str(out), verifier=str(eagle3[1]))
    found = _only(report, "aux-ids-range")
    assert [f.consumer for f in found] == ["speculators", "vllm"]
    assert found[0].text() == (
        "eagle_aux_hidden_state_layer_ids: layer id 8 of [2, 4, 8] is outside [0, 8) for this verifier's 8 "
        "layers: speculators fails to capture it or feeds another layer's state; fix: write the ids of the "
        "verifier the drafter was trained for, or check --verifier")
    # without the verifier the range is not known: said, never guessed
    alone = preflight(str(out))
    assert alone.exit_code == 0 and alone.unchecked


def test_aux_ids_absent_names_each_consumers_default(eagle3: tuple[Path, Path], tmp_path: Path) -> None:
    out = _copy(eagle3[0], tmp_path / "d")
    _edit_config(out, lambda c: c.pop("eagle_aux_hidden_state_layer_ids"))
    report = preflight(str(out), verifier=str(eagle3[1]), consumers="vllm")
    [finding] = _only(report, "aux-ids-missing")
    assert finding.text() == (
        "eagle_aux_hidden_state_layer_ids: vllm reads no verifier layer ids (eagle_aux_hidden_state_layer_ids or "
        "eagle_config.eagle_aux_hidden_state_layer_ids) and uses EAGLE's default verifier layers 2, N/2 and N-3 "
        "(= [2, 4, 5] for this verifier's 8 layers): a drafter trained on other layers drafts from the wrong hidden "
        "states (acceptance collapses, no error); fix: write the layer ids the drafter was trained on at "
        "eagle_aux_hidden_state_layer_ids")


def test_absent_norm_flag_names_who_reads_it_how(eagle3: tuple[Path, Path], tmp_path: Path) -> None:
    """vLLM reads a speculators config's missing norm_before_residual as true
    (vllm/transformers_utils/configs/speculators/algos.py, update_eagle3:
    ``config_dict.get("norm_before_residual", True)``), speculators as false
    (speculators/models/eagle3/config.py L43)."""
    out = _copy(eagle3[0], tmp_path / "d")
    _edit_config(out, lambda c: c.pop("norm_before_residual"))
    report = preflight(str(out), verifier=str(eagle3[1]), consumers="speculators,vllm")
    found = [f for f in report.findings if f.check == "flag-missing"]
    assert [f.text() for f in found] == [
        "norm_before_residual: absent, and consumers disagree on its default in a speculators config (speculators, "
        f"sglang read false; vllm reads true): {c} reads {v}; a drafter trained with the other value drafts from "
        "wrongly normalised states; fix: write norm_before_residual explicitly, as the drafter was trained"
        for c, v in (("speculators", "false"), ("vllm", "true"))]
    assert report.exit_code == 1


def test_absent_norm_output_is_read_alike(eagle3: tuple[Path, Path], tmp_path: Path) -> None:
    """Absent, norm_output is classic EAGLE-3 for speculators, vLLM and SGLang alike (false);
    a native config that says true gets a note (SpecForge wrote true for classic drafters
    before its pull request #879)."""
    out = _copy(eagle3[0], tmp_path / "d")
    _edit_config(out, lambda c: c.pop("norm_output"))
    assert preflight(str(out), verifier=str(eagle3[1]), consumers="speculators,vllm").exit_code == 0
    native = api.apply(RULES / "speculators_to_eagle3.yaml", out=tmp_path / "native", sources={"drafter": str(out)},
                       progress=False).out
    # a native config's missing norm_before_residual is false to vLLM (getattr(config, ..., False) in
    # llama_eagle3.py) and SGLang alike: no finding
    _edit_config(native, lambda c: (c.update(norm_output=True), c.pop("norm_before_residual")))
    report = preflight(str(native), verifier=str(eagle3[1]))
    assert report.exit_code == 0 and any("pull request #879" in n for n in report.notes), report.text()
    assert not any("only in eagle_config" in n for n in report.notes), report.text()
    _edit_config(native, lambda c: c.pop("eagle_aux_hidden_state_layer_ids"))
    report = preflight(str(native), verifier=str(eagle3[1]))
    assert report.exit_code == 0 and any("only in eagle_config" in n for n in report.notes), report.text()


def test_dflash_with_unshifted_ids_for_speculators(dflash: tuple[Path, Path], tmp_path: Path) -> None:
    out, verifier = dflash
    assert preflight(str(out), verifier=str(verifier)).exit_code == 0
    broken = _copy(out, tmp_path / "d")
    zlab = [1, 4, 6]  # the stand-in's dflash_config.target_layer_ids; the rule wrote [2, 5, 7]

    def unshift(config: dict[str, Any]) -> None:
        config["aux_hidden_state_layer_ids"] = zlab
        config["transformer_layer_config"]["dflash_config"] = {"target_layer_ids": zlab}
    _edit_config(broken, unshift)
    report = preflight(str(broken), verifier=str(verifier))
    found = _only(report, "aux-ids-unshifted")
    assert [f.consumer for f in found] == ["speculators", "vllm"]
    assert found[0].text() == (
        "aux_hidden_state_layer_ids: [1, 4, 6]: they equal the z-lab target_layer_ids [1, 4, 6] beside them, which "
        "read hidden_states[i + 1]: speculators feeds the state one layer earlier than the drafter was trained on; "
        "fix: write target_layer_ids + 1 ([2, 5, 7]), dropping an id past the verifier's last layer "
        "(rule: dflash_to_speculators)")


def test_zlab_dflash_for_speculators_points_at_the_rule(dflash: tuple[Path, Path], tmp_path: Path) -> None:
    model = build_dflash_drafter(tmp_path / "Qwen3-8B-DFlash-b16").path
    report = preflight(str(model), consumers="speculators")
    [finding] = _only(report, "layout")
    assert finding.rule == "dflash_to_speculators"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptxform", "preflight", *args], capture_output=True, text=True,
                          cwd=REPO, check=False)


def test_cli_exit_codes_and_json(eagle3: tuple[Path, Path], tmp_path: Path) -> None:
    out, verifier = eagle3
    ok = _cli(str(out), "--verifier", str(verifier))
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[1:3] == ["speculators: ok", "vllm: ok"]
    broken = _copy(out, tmp_path / "d")
    _edit_config(broken, lambda c: c.update(draft_vocab_size=511))
    failed = _cli(str(broken), "--verifier", str(verifier), "--for", "vllm,sglang", "--json")
    assert failed.returncode == 1, failed.stderr
    data = json.loads(failed.stdout)
    assert data["status"] == "at_risk" and list(data["consumers"]) == ["vllm", "sglang"]
    first = data["consumers"]["vllm"][0]
    assert set(first) == {"consumer", "check", "subject", "effect", "fix", "rule"}
    assert (first["check"], first["subject"]) == ("draft-vocab-size", "draft_vocab_size")
    usage = _cli(str(out), "--for", "tgi")
    assert usage.returncode == 2
    assert usage.stderr.strip() == ("error: --for tgi: unknown consumer tgi; fix: name one or more of "
                                    "speculators,vllm,sglang,llama.cpp,transformers")
    missing = _cli(str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
