"""megatron_gpt_to_hf and megatron_moe_to_hf on checkpoints megatron-core writes itself
(issue 27 items 2, 3): GPTModel (Llama-style, GQA; and the same with every MLP a Mixtral-style
mixture of experts) at tensor parallel size 2 on 2 gloo ranks, saved by
``dist_checkpointing.save`` in Megatron-LM's save layout with its args in common.pt
(tests/megatron_fixture.py). Every output tensor equals, bit for bit, what Megatron-Bridge's
``stream_weights_megatron_to_hf`` exports from the same TP=2 model on both ranks
(tests/megatron_bridge.py: LlamaBridge's registry; for the experts and router, Qwen3MoEBridge's,
Megatron-Bridge having no Mixtral bridge: its HF names are translated to Mixtral's), with the
same key set; transformers loads the output strictly and its logits equal megatron-core's own
TP=2 forward of the source.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.reference
REFERENCE = "needs megatron-core 0.16.1 (pip install --no-deps megatron-core==0.16.1) and transformers"


def _save(tmp_path_factory: pytest.TempPathFactory, name: str, *flags: str) -> Path:
    for module in ("megatron.core", "transformers"):
        pytest.importorskip(module, reason=REFERENCE)
    out = tmp_path_factory.mktemp(name)
    path = os.pathsep.join([str(REPO), str(REPO / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, str(REPO / "tests" / "megatron_fixture.py"), str(out), *flags],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _apply(run_cli: Any, rule: str, source: Path) -> Path:
    out = source.parent / f"{source.name}-hf"
    done = run_cli("apply", REPO / "rules" / f"{rule}.yaml", "--source", f"model={source}", "--out", out,
                   "--strict", timeout=300)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def megatron(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory, "megatron")


@pytest.fixture(scope="module")
def megatron_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory, "megatron-moe", "--moe")


@pytest.fixture(scope="module")
def dense_hf(megatron: Path, run_cli: Any) -> Path:
    return _apply(run_cli, "megatron_gpt_to_hf", megatron)


@pytest.fixture(scope="module")
def moe_hf(megatron_moe: Path, run_cli: Any) -> Path:
    return _apply(run_cli, "megatron_moe_to_hf", megatron_moe)


def _tensors(out: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    found: dict[str, Any] = {}
    for file in sorted(out.glob("*.safetensors")):
        found.update(load_file(file))
    return found


def _bridge(saved: Path) -> dict[str, Any]:
    """Megatron-Bridge's export the fixture wrote, or a skip saying why there is none."""
    absent = saved / "bridge_absent.txt"
    if absent.exists():
        pytest.skip(f"{absent.read_text()}: the bit-for-bit reference is Megatron-Bridge's export")
    from safetensors.torch import load_file

    return load_file(saved / "bridge_hf.safetensors")


def _assert_bits_equal(ours: dict[str, Any], reference: dict[str, Any]) -> None:
    assert sorted(ours) == sorted(reference)
    for key, want in reference.items():
        got = ours[key]
        assert got.dtype == want.dtype and got.shape == want.shape, (key, got.dtype, got.shape, want.dtype, want.shape)
        assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)), key


def _logits_match(model_class: Any, out: Path, saved: Path) -> None:
    model, info = model_class.from_pretrained(str(out), output_loading_info=True, dtype=torch.float32)
    assert not any(info.values()), info
    with torch.no_grad():
        got = model(torch.load(saved / "tokens.pt")).logits
    torch.testing.assert_close(got, torch.load(saved / "logits.pt"), rtol=1e-5, atol=1e-5)


def test_transformers_gives_megatrons_logits_on_the_converted_tp2_checkpoint(megatron: Path, dense_hf: Path) -> None:
    from transformers import LlamaForCausalLM

    config = json.loads((dense_hf / "config.json").read_text())
    assert (config["num_key_value_heads"], config["head_dim"], config["vocab_size"]) == (2, 16, 160)
    _logits_match(LlamaForCausalLM, dense_hf, megatron)
    events = [json.loads(line) for line in (dense_hf / "ckptxform_audit.jsonl").read_text().splitlines()]
    extra = [e for e in events if e.get("event") == "tensor" and "_extra_state" in e["key"]]
    assert extra and all(e["action"] == "skipped" and "never read" in e["reason"] for e in extra)


def test_every_tensor_is_megatron_bridges_llama_export_bit_for_bit(megatron: Path, dense_hf: Path) -> None:
    _assert_bits_equal(_tensors(dense_hf), _bridge(megatron))


#: Qwen3-MoE's HF names (Megatron-Bridge's MoE mapping) -> Mixtral's Hub names, for the MoE block
_QWEN3_MOE_TO_MIXTRAL = ((r"\.mlp\.gate\.weight$", ".block_sparse_moe.gate.weight"),
                         (r"\.mlp\.experts\.(\d+)\.gate_proj\.", r".block_sparse_moe.experts.\1.w1."),
                         (r"\.mlp\.experts\.(\d+)\.up_proj\.", r".block_sparse_moe.experts.\1.w3."),
                         (r"\.mlp\.experts\.(\d+)\.down_proj\.", r".block_sparse_moe.experts.\1.w2."))


def _as_mixtral(name: str) -> str:
    for pattern, replacement in _QWEN3_MOE_TO_MIXTRAL:
        name = re.sub(pattern, replacement, name)
    return name


def test_transformers_gives_megatrons_logits_on_the_converted_moe_checkpoint(megatron_moe: Path,
                                                                            moe_hf: Path) -> None:
    from transformers import MixtralForCausalLM

    config = json.loads((moe_hf / "config.json").read_text())
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"]) == (4, 2, 48)
    _logits_match(MixtralForCausalLM, moe_hf, megatron_moe)


def test_every_moe_tensor_is_megatron_bridges_export_bit_for_bit(megatron_moe: Path, moe_hf: Path) -> None:
    reference = {_as_mixtral(k): v for k, v in _bridge(megatron_moe).items()}
    assert any(".block_sparse_moe.experts.3.w2." in k for k in reference)  # the translation took
    _assert_bits_equal(_tensors(moe_hf), reference)


def test_each_rule_refuses_the_others_checkpoint(megatron: Path, megatron_moe: Path, run_cli: Any,
                                                 tmp_path: Path) -> None:
    from conftest import assert_clean_failure

    for rule, source, fix in (("megatron_gpt_to_hf", megatron_moe, "megatron_moe_to_hf"),
                              ("megatron_moe_to_hf", megatron, "megatron_gpt_to_hf")):
        done = run_cli("apply", REPO / "rules" / f"{rule}.yaml", "--source", f"model={source}",
                       "--out", tmp_path / rule)
        assert fix in assert_clean_failure(done) and not (tmp_path / rule).exists()


def test_every_tp_sharded_tensor_is_joined_from_both_ranks(megatron: Path, run_cli: Any) -> None:
    from ckptxform.sources.resolve import open_location

    with open_location(str(megatron)) as ckpt:
        assert type(ckpt).__name__ == "TorchDistCheckpoint"
        qkv = ckpt.tensors["decoder.layers.self_attention.linear_qkv.weight"]
        assert qkv.shape == (2, 128, 64) and qkv.offset == -1  # stacked layers, column-parallel halves
        assert ckpt.config("common.pt")["num_query_groups"] == 2
    shown = run_cli("inspect", megatron)
    assert shown.returncode == 0 and shown.stdout.startswith(
        f"{megatron / 'iter_0000001'}: Megatron-Core torch_dist (DCP + metadata.json, common.pt) "
        f"(latest iteration '1': {megatron / 'iter_0000001'}, 4 .distcp file(s), common.pt)"), shown.stdout
