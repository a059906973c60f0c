"""Quantized sources made by the libraries themselves, and each library's own dequantization
of them, for tests/test_scaled_dequant_reference.py. Run as a script (a subprocess): ModelOpt
and llm-compressor patch transformers' classes when they quantize, which must not leak into
the test process.

    python tests/scaled_sources.py OUT '{"maker": "oneshot", "scheme": "FP8", "dims": [...], "seed": 0}'

writes OUT/src (the quantized checkpoint as the library saves it) and OUT/reference.safetensors:

- llm-compressor (``model_free``: ``model_free_ptq``; ``oneshot``: calibrated on random
  token ids, for the presets with static activation scales; ``mixed``: ``model_free_ptq``
  with an FP8_DYNAMIC group for attention and an NVFP4A16 group for the MLP), reference
  ``CompressedTensorsDequantizer.process`` (compressed-tensors' checkpoint decompress), its
  activation scales left out (the rules drop them);
- ``modelopt``: ``mtq.quantize(NVFP4_DEFAULT_CFG)`` + ``export_hf_checkpoint``, reference
  ``NVFP4QTensor.dequantize`` per module (ModelOpt's own dequantizer), every other tensor
  but the scales as exported.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

ACTIVATION_SCALES = ("input_scale", "input_global_scale")


def tiny_llama(dims: list[int], seed: int, dtype: torch.dtype) -> Any:
    """A random LlamaForCausalLM: dims = [hidden, heads, kv_heads, head_dim, intermediate]."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, heads, kv_heads, head_dim, intermediate = dims
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, intermediate_size=intermediate, num_hidden_layers=2, vocab_size=128,
                         architectures=["LlamaForCausalLM"])
    return LlamaForCausalLM(config).to(dtype)


def tensors_of(root: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(root.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", pad_token="t0")


def llm_compressor(spec: dict[str, Any], out: Path) -> None:
    dtype = getattr(torch, spec.get("dtype", "bfloat16"))
    tiny_llama(spec["dims"], spec["seed"], dtype).save_pretrained(out / "base")
    src = out / "src"
    if spec["maker"] == "oneshot":
        from datasets import Dataset
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import QuantizationModifier
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(out / "base", dtype=dtype)  # oneshot wants a saved model
        ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(spec["seed"]))
        data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * 16] * 4})
        oneshot(model=model, dataset=data, processor=tokenizer(), output_dir=str(src), num_calibration_samples=4,
                max_seq_length=16, recipe=QuantizationModifier(targets="Linear", scheme=spec["scheme"],
                                                                ignore=["lm_head"]))
    else:
        from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
        from llmcompressor.entrypoints.model_free import model_free_ptq

        if spec["maker"] == "mixed":
            groups = {"attention": preset_name_to_scheme("FP8_DYNAMIC", ["re:.*self_attn.*"]),
                      "mlp": preset_name_to_scheme("NVFP4A16", ["re:.*mlp.*"])}
            model_free_ptq(out / "base", src, config=QuantizationConfig(config_groups=groups, ignore=["lm_head"]),
                           device="cpu")
        else:
            model_free_ptq(out / "base", src, scheme=spec["scheme"], ignore=["lm_head", "model.embed_tokens"],
                           device="cpu")
    from compressed_tensors.entrypoints.convert import CompressedTensorsDequantizer

    tensors = tensors_of(src)
    # a header shows no module classes: the modules stored unquantized are named to it
    plain = [k.removesuffix(".weight") for k in tensors if k.endswith(".weight")
             and not any(k.removesuffix("weight") + p in tensors for p in ("weight_scale", "weight_packed"))]
    reference = CompressedTensorsDequantizer(str(src), ignore=plain).process(tensors)
    save_file({k: v.contiguous() for k, v in reference.items() if not k.endswith(ACTIVATION_SCALES)},
              str(out / "reference.safetensors"))


def modelopt(spec: dict[str, Any], out: Path) -> None:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    model = tiny_llama(spec["dims"], spec["seed"], torch.bfloat16)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(spec["seed"]))
    model = mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, lambda m: m(ids))
    export_hf_checkpoint(model, export_dir=str(out / "src"))
    tensors = tensors_of(out / "src")
    reference = {}
    for key, value in tensors.items():
        module = key.removesuffix(".weight")
        if f"{module}.weight_scale_2" in tensors:
            shape = torch.Size((value.shape[0], value.shape[1] * 2))
            value = NVFP4QTensor(shape, torch.bfloat16, value).dequantize(
                dtype=torch.bfloat16, scale=tensors[f"{module}.weight_scale"],
                double_scale=tensors[f"{module}.weight_scale_2"], block_sizes={-1: 16})
        if not key.endswith(("weight_scale", "weight_scale_2", *ACTIVATION_SCALES)):
            reference[key] = value.contiguous()
    save_file(reference, str(out / "reference.safetensors"))


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    out_dir, spec_text = Path(sys.argv[1]), sys.argv[2]
    spec_in = json.loads(spec_text)
    (modelopt if spec_in["maker"] == "modelopt" else llm_compressor)(spec_in, out_dir)
