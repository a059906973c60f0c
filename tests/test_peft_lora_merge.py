"""rules/peft_lora_merge.yaml (issue 34 items 1, 3): a PEFT LoRA adapter folder as a source,
merged into its base by ``combine``.

Reference (peft 0.18, transformers): a tiny random Llama (hidden 42, GQA 6/2 heads, head_dim
10, not hidden // heads, intermediate 150: more than one 64-row band) saved in bfloat16 or float32; peft's get_peft_model with nonzero
LoRA factors (plain and rsLoRA, a rank pattern and an alpha pattern, lm_head in
modules_to_save with weights of its own) saves the adapter (its factors also rewritten in
bf16 or fp16, for fp16 and bf16 bases: peft widens them on loading); our rule's output is byte for
byte what peft's merge_and_unload() + save_pretrained writes, and LlamaForCausalLM loads it
strictly. Without the reference extra: the adapter source's key mapping and scales, and the
refusals (DoRA, another peft_type, a LoRA pair the base has no module for, fan_in_fan_out),
and an adapter repo on the (test) Hub read as its local folder is.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

from ckptxform import api
from ckptxform.errors import CkptxformError
from ckptxform.sources.peft_adapter import open_peft_adapter
from ckptxform.standins.hf_models import LM_TINY, build_llama
from ckptxform.standins.lora import build_lora_adapter

RULE = REPO / "rules" / "peft_lora_merge.yaml"
needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                reason="peft is not installed; to run the reference tests: "
                                       "pip install torch==2.13.0 -e '.[test,reference]' and .ci/reference-nodeps.txt")


def _standins(root: Path, **adapter: Any) -> tuple[Path, Path]:
    base = build_llama(root / "base")
    return base, build_lora_adapter(root / "adapter", LM_TINY, **adapter)


def test_the_adapter_keys_are_the_base_modules_and_the_scales_are_peft_s(tmp_path: Path) -> None:
    _, adapter = _standins(tmp_path, r=4, alpha=16, use_rslora=True, rank_pattern={"layers.1.self_attn.q_proj": 6},
                           alpha_pattern={"down_proj": 3}, modules_to_save=("lm_head",))
    ckpt = open_peft_adapter(adapter)
    assert "model.layers.0.self_attn.q_proj.lora_A.weight" in ckpt.tensors
    assert "lm_head.weight" in ckpt.tensors
    assert not any(k.startswith("base_model.") for k in ckpt.tensors)
    scaling = ckpt.config()["lora_scaling"]["model"]["layers"]
    assert scaling["0"]["self_attn"]["q_proj"] == 16 / math.sqrt(4)
    assert scaling["1"]["self_attn"]["q_proj"] == 16 / math.sqrt(6)
    assert scaling["1"]["mlp"]["down_proj"] == 3 / math.sqrt(4)
    assert ckpt.tensors["model.layers.1.self_attn.q_proj.lora_A.weight"].shape == (6, LM_TINY.hidden)


def test_the_merge_plans_every_adapter_tensor_as_consumed(tmp_path: Path) -> None:
    base, adapter = _standins(tmp_path, modules_to_save=("lm_head",))
    result = api.apply(RULE, out=tmp_path / "out", sources={"base": str(base), "adapter": str(adapter)},
                       progress=False)
    audit = [json.loads(line) for line in (result.out / "ckptxform_audit.jsonl").read_text().splitlines()]
    records = [r for r in audit if r.get("event") == "tensor"]
    adapter_records = [r for r in records if r["source"] == "adapter"]
    assert adapter_records and all(r["action"] == "consumed" for r in adapter_records)
    merged = {r["key"] for r in records if r["source"] == "base" and r["action"] == "combined"}
    assert "model.layers.0.self_attn.q_proj.weight" in merged and "lm_head.weight" in merged
    assert "model.norm.weight" not in merged


@pytest.mark.parametrize(("change", "says"), [
    ({"use_dora": True}, "use_dora is True: DoRA"),
    ({"peft_type": "LOHA"}, "peft_type is 'LOHA'"),
    ({"lora_bias": True}, "lora_bias is True"),
    ({"r": 8}, "has lora_A of shape [4, 96], but the config gives it rank 8"),
])
def test_unsupported_adapters_are_refused_naming_the_field(tmp_path: Path, change: dict[str, Any],
                                                           says: str) -> None:
    base, adapter = _standins(tmp_path)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(CkptxformError) as failure:
        api.apply(RULE, out=tmp_path / "out", sources={"base": str(base), "adapter": str(adapter)}, progress=False)
    assert "adapter_config.json: " in str(failure.value) and says in str(failure.value)
    assert not (tmp_path / "out").exists()


def test_fan_in_fan_out_is_refused(tmp_path: Path) -> None:
    base, adapter = _standins(tmp_path)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "fan_in_fan_out": True}))
    with pytest.raises(CkptxformError, match="fan_in_fan_out.*does not write"):
        api.apply(RULE, out=tmp_path / "out", sources={"base": str(base), "adapter": str(adapter)}, progress=False)


def test_a_lora_pair_the_base_has_no_module_for_is_an_error_not_a_silent_drop(tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    base, adapter = _standins(tmp_path)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    renamed = {k.replace("layers.1.", "layers.7."): v for k, v in tensors.items()}
    save_file(renamed, str(adapter / "adapter_model.safetensors"))
    with pytest.raises(CkptxformError) as failure:
        api.apply(RULE, out=tmp_path / "out", sources={"base": str(base), "adapter": str(adapter)}, progress=False)
    message = str(failure.value)
    assert "adapter:model.layers.7." in message and "no op of the rules read it" in message
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ against peft


def _peft_case(root: Path, dtype: str, rslora: bool, patterns: bool,
               factors: str | None = None) -> tuple[Path, Path, Path]:
    """base/, adapter/ (peft's save_pretrained; its factors rewritten in ``factors`` when
    given) and merged/ (peft's merge_and_unload + save)."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    torch_dtype = getattr(torch, dtype)
    config = LlamaConfig(hidden_size=42, num_attention_heads=6, num_key_value_heads=2, head_dim=10,
                         intermediate_size=150, num_hidden_layers=2, vocab_size=77, tie_word_embeddings=False)
    LlamaForCausalLM(config).to(torch_dtype).save_pretrained(root / "base")
    lora = LoraConfig(r=4, lora_alpha=12, use_rslora=rslora, init_lora_weights=False,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                      rank_pattern={"layers.1.self_attn.q_proj": 7} if patterns else {},
                      alpha_pattern={"down_proj": 5, "model.layers.0.mlp.up_proj": 30} if patterns else {},
                      modules_to_save=["lm_head"] if patterns else None)
    model = get_peft_model(LlamaForCausalLM.from_pretrained(root / "base", dtype=torch_dtype), lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # a trained adapter's B, not zero
                param.normal_(0, 0.5)
            if "modules_to_save" in name:
                param.normal_(0, 0.02)
    model.save_pretrained(root / "adapter")
    if factors is not None:  # an adapter saved in 16 bits (trained so, or converted)
        from safetensors.torch import load_file, save_file

        saved = load_file(str(root / "adapter" / "adapter_model.safetensors"))
        save_file({k: v.to(getattr(torch, factors)) if ".lora_" in k else v for k, v in saved.items()},
                  str(root / "adapter" / "adapter_model.safetensors"))
    base = LlamaForCausalLM.from_pretrained(root / "base", dtype=torch_dtype)
    PeftModel.from_pretrained(base, root / "adapter").merge_and_unload().save_pretrained(root / "merged")
    return root / "base", root / "adapter", root / "merged"


@pytest.mark.reference
@needs_peft
@pytest.mark.parametrize(("dtype", "factors"), [("bfloat16", None), ("float32", None), ("float16", "bfloat16"),
                                                ("bfloat16", "float16")])
@pytest.mark.parametrize(("rslora", "patterns"), [(False, False), (True, True), (False, True)])
@pytest.mark.parametrize("banded", [False, True])
def test_the_merge_is_peft_s_byte_for_byte(tmp_path: Path, dtype: str, factors: str | None, rslora: bool,
                                           patterns: bool, banded: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``banded``: the chunk made tiny, so each weight is merged in bands of 64 rows (the
    150-row gate/up_proj in three, the last overlapping the second)."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    from ckptxform.engine.plan import recipes

    if banded:
        monkeypatch.setattr(recipes, "CHUNK_BYTES", 1)
    base, adapter, merged = _peft_case(tmp_path, dtype, rslora, patterns, factors)
    result = api.apply(RULE, out=tmp_path / "out", sources={"base": str(base), "adapter": str(adapter)},
                       progress=False)
    want = load_file(str(merged / "model.safetensors"))
    got = {}
    for file in sorted(result.out.glob("*.safetensors")):
        got.update(load_file(str(file)))
    assert sorted(got) == sorted(want)
    changed = 0
    for key, value in want.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        assert got[key].view(torch.uint8).equal(value.view(torch.uint8)), key
        changed += not value.equal(load_file(str(base / "model.safetensors"))[key])
    assert changed == 14 + (1 if patterns else 0)  # 7 modules x 2 layers (+ lm_head)
    _, info = LlamaForCausalLM.from_pretrained(result.out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info


def test_an_adapter_model_bin_merges_as_its_safetensors_does(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    base, adapter = _standins(tmp_path, modules_to_save=("lm_head",))
    first = api.apply(RULE, out=tmp_path / "from-safetensors", progress=False,
                      sources={"base": str(base), "adapter": str(adapter)})
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    # older peft saves: pytorch pickles, and the adapter name inside the key
    torch.save({k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
                for k, v in saved.items()}, adapter / "adapter_model.bin")
    (adapter / "adapter_model.safetensors").unlink()
    second = api.apply(RULE, out=tmp_path / "from-bin", progress=False,
                       sources={"base": str(base), "adapter": str(adapter)})
    assert (first.out / "model.safetensors").read_bytes() == (second.out / "model.safetensors").read_bytes()


MERGE_FROM_HUB = """
from ckptxform import api
result = api.apply(RULE, out=OUT, sources={"base": BASE, "adapter": "hf://org/adapter@main"}, progress=False)
emit(out=str(result.out))
attempt("not_lora", lambda: api.plan(RULE, sources={"base": BASE, "adapter": "hf://org/dora@main"}))
"""


def test_an_adapter_repo_on_the_hub_is_a_source(tmp_path: Path) -> None:
    """The same merge from a Hub repo (adapter_config.json + adapter_model.safetensors) as
    from its local folder; a DoRA repo refused naming the field."""
    import shutil

    from hub_fixtures import ProxyTrap, client_env, run_client
    from hubserver import HubServer

    base, adapter = _standins(tmp_path, modules_to_save=("lm_head",), rank_pattern={"layers.0.self_attn.v_proj": 3})
    local = api.apply(RULE, out=tmp_path / "local", progress=False, sources={"base": str(base), "adapter": str(adapter)})
    dora = tmp_path / "dora"
    shutil.copytree(adapter, dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    trap = ProxyTrap()
    try:
        with HubServer() as server:
            server.add_repo("org/adapter", adapter)
            server.add_repo("org/dora", dora)
            env = client_env(server, tmp_path / "home", trap)
            code = f"RULE, OUT, BASE = {str(RULE)!r}, {str(tmp_path / 'hub')!r}, {str(base)!r}\n" + MERGE_FROM_HUB
            run = run_client(code, env)
        assert run.returncode == 0, run.stderr
        assert trap.lines == []
    finally:
        trap.close()
    assert (tmp_path / "hub" / "model.safetensors").read_bytes() == (local.out / "model.safetensors").read_bytes()
    refused = run.record("not_lora")
    assert refused["error"] == "CheckpointFormatError" and "adapter_config.json: use_dora is True" in refused["message"]


# ------------------------------------------------------------------ an FP8 block-quantized base

FP8_RULE = REPO / "rules" / "peft_lora_merge_fp8_block.yaml"


@pytest.mark.reference
@needs_peft
@pytest.mark.parametrize("rslora", [False, True])
def test_the_fp8_block_merge_is_peft_s_merge_of_the_dequantized_base_requantized(tmp_path: Path,
                                                                                   rslora: bool) -> None:
    """One rule (dequantize, merge, quantize) == fp8_to_bf16, then peft's merge_and_unload +
    save_pretrained, then bf16_to_fp8_block: every byte, and the quantization_config."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    from ckptxform.standins.for_rules import _QUANTIZE_TINY

    bf16 = build_llama(tmp_path / "bf16", _QUANTIZE_TINY)
    fp8 = api.apply(REPO / "rules" / "bf16_to_fp8_block.yaml", out=tmp_path / "fp8", progress=False,
                    sources={"model": str(bf16)}).out
    adapter = build_lora_adapter(tmp_path / "adapter", _QUANTIZE_TINY, r=8, alpha=16, use_rslora=rslora,
                                 targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                                 rank_pattern={"layers.1.mlp.up_proj": 5}, modules_to_save=("lm_head",))
    ours = api.apply(FP8_RULE, out=tmp_path / "ours", progress=False,
                     sources={"base": str(fp8), "adapter": str(adapter)}).out
    dequantized = api.apply(REPO / "rules" / "fp8_to_bf16.yaml", out=tmp_path / "bf16-again", progress=False,
                            sources={"model": str(fp8)}).out
    base = LlamaForCausalLM.from_pretrained(dequantized, dtype=torch.bfloat16)
    PeftModel.from_pretrained(base, adapter).merge_and_unload().save_pretrained(tmp_path / "peft-merged")
    want = api.apply(REPO / "rules" / "bf16_to_fp8_block.yaml", out=tmp_path / "want", progress=False,
                     sources={"model": str(tmp_path / "peft-merged")}).out
    got, expected = load_file(str(ours / "model.safetensors")), load_file(str(want / "model.safetensors"))
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and got[key].view(torch.uint8).equal(value.view(torch.uint8)), key
    unmerged = load_file(str(fp8 / "model.safetensors"))
    assert not got["model.layers.0.self_attn.q_proj.weight"].view(torch.uint8).equal(
        unmerged["model.layers.0.self_attn.q_proj.weight"].view(torch.uint8))
    config = json.loads((ours / "config.json").read_text())
    assert config["quantization_config"] == json.loads((want / "config.json").read_text())["quantization_config"]
