"""megatron_gpt_to_hf on a checkpoint megatron-core writes itself (issue 27 items 2, 3):
GPTModel (Llama-style, GQA) at tensor parallel size 2 on 2 gloo ranks, saved by
``dist_checkpointing.save`` in Megatron-LM's save layout with its args in common.pt
(tests/megatron_fixture.py). transformers loads the output strictly and its logits equal
megatron-core's own TP=2 forward of the source; the mapping is Megatron-Bridge's
LlamaBridge registry (embedding, output_layer, final_layernorm, the TE-named layer norms,
linear_proj, linear_fc2 renamed; linear_qkv split by query group; linear_fc1 into gate/up).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.reference
REFERENCE = "needs megatron-core 0.16.1 (pip install --no-deps megatron-core==0.16.1) and transformers"


@pytest.fixture(scope="module")
def megatron(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for module in ("megatron.core", "transformers"):
        pytest.importorskip(module, reason=REFERENCE)
    out = tmp_path_factory.mktemp("megatron")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    done = subprocess.run([sys.executable, str(REPO / "tests" / "megatron_fixture.py"), str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_transformers_gives_megatrons_logits_on_the_converted_tp2_checkpoint(megatron: Path, run_cli: Any,
                                                                          tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    out = tmp_path / "hf"
    done = run_cli("apply", REPO / "rules" / "megatron_gpt_to_hf.yaml", "--source", f"model={megatron}", "--out", out)
    assert done.returncode == 0, done.stderr
    config = json.loads((out / "config.json").read_text())
    assert (config["num_key_value_heads"], config["head_dim"], config["vocab_size"]) == (2, 16, 160)
    model, info = LlamaForCausalLM.from_pretrained(str(out), output_loading_info=True, dtype=torch.float32)
    assert not any(info.values()), info
    with torch.no_grad():
        got = model(torch.load(megatron / "tokens.pt")).logits
    torch.testing.assert_close(got, torch.load(megatron / "logits.pt"), rtol=1e-5, atol=1e-5)
    events = [json.loads(line) for line in (out / "ckptxform_audit.jsonl").read_text().splitlines()]
    extra = [e for e in events if e.get("event") == "tensor" and "_extra_state" in e["key"]]
    assert extra and all(e["action"] == "skipped" and "never read" in e["reason"] for e in extra)


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
