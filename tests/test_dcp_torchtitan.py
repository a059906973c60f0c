"""torchtitan_llama_to_hf on checkpoints torchtitan and torch write themselves (issue 27):
a Llama3Model under FSDP2 on 2 gloo ranks saved by ``dcp.save`` (every tensor chunked
across the two rank files, the vocabulary split unevenly), and a checkpoint after one real
training step with the optimizer, scheduler, dataloader and train state beside the model
(tests/titan_fixture.py). The reference is torchtitan's own
``Llama3StateDictAdapter.to_hf`` on what ``dcp.load`` reads, bit for bit; transformers'
LlamaForCausalLM loads the output strictly and its logits are torchtitan's model's.
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
REFERENCE = ("needs torchtitan 0.3.0 and its small deps (pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 "
             "tyro==1.0.17 docstring-parser==0.17.0 typeguard==4.4.4) and transformers")


@pytest.fixture(scope="module")
def titan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for module in ("torchtitan", "spmd_types", "tyro", "transformers"):
        pytest.importorskip(module, reason=REFERENCE)
    out = tmp_path_factory.mktemp("titan")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    done = subprocess.run([sys.executable, str(REPO / "tests" / "titan_fixture.py"), str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    from titan_fixture import hf_config

    assets = out / "assets"
    assets.mkdir()
    (assets / "config.json").write_text(json.dumps(hf_config()))
    (assets / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    return out


def _convert(run_cli: Any, titan: Path, name: str) -> Path:
    out = titan / f"{name}-hf"
    done = run_cli("apply", REPO / "rules" / "torchtitan_llama_to_hf.yaml", "--source", f"model={titan / name}",
                   "--source", f"hf_assets={titan / 'assets'}", "--out", out, timeout=300)
    assert done.returncode == 0, done.stderr
    return out


def _dcp_load(path: Path) -> dict[str, Any]:
    """What ``dcp.load`` reads of the model's keys (a single process, no process group)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(path))
    meta = reader.read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
             if hasattr(m, "size") and not k.startswith(("optimizer.", "lr_scheduler.", "dataloader.", "train_state."))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=reader)
    return state


def _to_hf(state: dict[str, Any]) -> dict[str, Any]:
    from titan_fixture import install_kernel_stub, model_config

    install_kernel_stub()
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    return Llama3StateDictAdapter(model_config(), None).to_hf(dict(state))


def _bits(t: Any) -> Any:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("name", ["model", "step-1"])
def test_output_is_torchtitans_to_hf_bit_for_bit(titan: Path, run_cli: Any, name: str) -> None:
    from safetensors.torch import load_file

    got = load_file(str(_convert(run_cli, titan, name) / "model.safetensors"))
    want = _to_hf(_dcp_load(titan / name))
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and got[key].shape == tensor.shape, key
        assert torch.equal(_bits(got[key]), _bits(tensor)), key


def test_every_tensor_of_the_fsdp2_save_is_chunked_across_both_rank_files(titan: Path) -> None:
    from ckptxform.sources.dcp import open_dcp

    ckpt = open_dcp(titan / "model")
    assert ckpt.files == ("__0_0.distcp", "__1_0.distcp")
    assert ckpt.tensors and all(info.offset == -1 for info in ckpt.tensors.values())  # no tensor in one file
    assert ckpt.tensors["tok_embeddings.weight"].shape == (161, 64)  # 81 + 80 rows: an uneven split


def test_training_state_is_skipped_with_its_reason_and_the_model_loads_in_transformers(
        titan: Path, run_cli: Any) -> None:
    from transformers import LlamaForCausalLM

    out = _convert(run_cli, titan, "step-1")
    events = [json.loads(line) for line in (out / "ckptxform_audit.jsonl").read_text().splitlines()]
    skipped = {e["key"]: e["reason"] for e in events if e.get("event") == "tensor" and e["action"] == "skipped"}
    for entry in ("optimizer", "lr_scheduler", "dataloader", "train_state"):
        keys = [k for k in skipped if k.startswith(entry + ".")]
        assert keys and all(f"(entry {entry!r}): not a model weight, never read" in skipped[k] for k in keys), entry
    assert any(k.endswith(".exp_avg_sq") for k in skipped)  # AdamW's state after the real step
    assert (out / "tokenizer_config.json").is_file()

    model, info = LlamaForCausalLM.from_pretrained(str(out), output_loading_info=True, dtype=torch.float32)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    from titan_fixture import build_model

    titan_model = build_model(fuse_qkv=True)
    titan_model.load_state_dict(_dcp_load(titan / "step-1"))
    tokens = torch.randint(0, 161, (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = titan_model(tokens)
        got = model(tokens).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_0_2_rule_is_to_hf_on_the_same_tensors_under_0_3_names(tmp_path: Path, run_cli: Any) -> None:
    """torchtitan 0.2 named the projections attention.wq/wk/wv and the head output.weight;
    its rule equals 0.3's adapter on the same tensors renamed, bit for bit (bf16, GQA)."""
    pytest.importorskip("torchtitan", reason=REFERENCE)
    from safetensors.torch import load_file
    from titan_fixture import DIMS

    from ckptxform.standins.dcp_checkpoints import build_torchtitan_llama
    from ckptxform.standins.hf_models import LM_TINY as d

    sources = build_torchtitan_llama(tmp_path / "src", layout="0.2", seed=3)
    out = tmp_path / "hf"
    done = run_cli("apply", REPO / "rules" / "torchtitan_0_2_llama_to_hf.yaml", "--source", f"model={sources['model']}",
                   "--source", f"hf_assets={sources['hf_assets']}", "--out", out)
    assert done.returncode == 0, done.stderr
    renamed = {k.replace(".attention.w", ".attention.qkv_linear.w").replace("qkv_linear.wo", "wo")
               .replace("output.weight", "lm_head.weight"): v for k, v in _dcp_load(Path(sources["model"])).items()}
    dims = {**DIMS, "dim": d.hidden, "n_heads": d.heads, "n_kv_heads": d.kv_heads, "n_layers": d.layers,
            "vocab": d.vocab, "hidden": d.intermediate}
    from titan_fixture import install_kernel_stub, model_config

    install_kernel_stub()
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    want = Llama3StateDictAdapter(model_config(dims), None).to_hf(renamed)
    got = load_file(str(out / "model.safetensors"))
    assert sorted(got) == sorted(want) and len(want) == 3 + 9 * d.layers
    for key, tensor in want.items():
        assert torch.equal(_bits(got[key]), _bits(tensor)), key
