"""A stand-in for every shipped rule: what ``ckptxform demo RULE`` builds, and what the
rule library's catalogue (``ckptxform rules show``, the README's table) says of each rule.

One ``RuleStandin`` per rule file stem in ``STANDINS``; a new rule adds one entry (a
builder writing its sources under a folder, and four short lines of catalogue text).
tests/test_rule_standins.py fails for a shipped rule without an entry.

>>> sorted(STANDINS)[0]
'aqmedai_k2_to_k25'
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ckptxform.standins.awq_gptq import build_awq_llama, build_gptq_llama
from ckptxform.standins.dcp_checkpoints import build_megatron_gpt, build_torchtitan_llama
from ckptxform.standins.dims import KIMI_K2_TINY, LLAMA31_8B_TINY
from ckptxform.standins.dflash import build_dflash_drafter, build_qwen3_verifier
from ckptxform.standins.draft_vocab import make_draft_vocab
from ckptxform.standins.dspark import build_dspark_drafter, build_dspark_verifier
from ckptxform.standins.drafters import build_eagle3_drafter, build_full_vocab_drafter, build_llama_eagle3
from ckptxform.standins.gguf_models import QWEN2_GGUF, build_llama_gguf
from ckptxform.standins.gpt_oss import build_gpt_oss
from ckptxform.standins.headline import build_headline_standins
from ckptxform.standins.hf_models import (
    LM_TINY as LLAMA_DIMS_FOR_LORA,
    LmDims,
    build_gemma,
    build_gpt2,
    build_llama,
    build_meta_consolidated,
    build_moe,
    build_phi3,
    build_qwen2,
)
from ckptxform.standins.lora import build_lora_adapter
from ckptxform.standins.mistral import build_mistral_consolidated
from ckptxform.standins.mtp import build_qwen3_next_verifier
from ckptxform.standins.mla import KIMI_K25_MLA_TINY, build_mla_drafter
from ckptxform.standins.deepseek import KIMI_K2_TEXT
from ckptxform.standins.quantized import DEEPSEEK_V3_61_TINY, build_kimi_k2
from ckptxform.standins.scaled import build_scaled_llama
from ckptxform.standins.prebuilt import prebuilt_or
from ckptxform.standins.spm_llama import build_spm_llama
from ckptxform.standins.verifiers import build_kimi_k25_verifier
from ckptxform.standins.vlm import build_llava

__all__ = ["STANDINS", "RuleStandin", "standin_for"]

#: writes a rule's sources under a folder; returns ``NAME -> LOCATION`` for ``--source``
Builder = Callable[[Path], dict[str, str]]


@dataclass(frozen=True)
class RuleStandin:
    """A shipped rule's stand-in builder and its catalogue entry."""

    build: Builder
    #: what it converts from and into (the README table's first columns)
    source_layout: str
    target_layout: str
    #: the real model families (Hub repos) it covers
    families: str
    #: the reference its tests compare the output with
    checked_against: str


def _headline(root: Path) -> dict[str, str]:
    return build_headline_standins(root).sources


def _native_llama_drafter(root: Path) -> dict[str, str]:
    return {"drafter": str(build_llama_eagle3(root / "EAGLE3-LLaMA3.1-Instruct-8B").path)}


#: the stand-ins torch writes (DCP, torch_dist, a pickled .bin): shipped prebuilt for the
#: light install (ckptxform/standins/prebuilt.py)
TORCH_WRITTEN: dict[str, Builder] = {
    "eagle3_to_speculators": _native_llama_drafter,
    "torchtitan_llama_to_hf": lambda root: build_torchtitan_llama(root / "torchtitan-llama3", training_state=True),
    "torchtitan_0_2_llama_to_hf": lambda root: build_torchtitan_llama(root / "torchtitan-0.2-llama3", layout="0.2"),
    "megatron_gpt_to_hf": lambda root: build_megatron_gpt(root / "megatron-llama"),
    "megatron_moe_to_hf": lambda root: build_megatron_gpt(root / "megatron-mixtral", moe=True),
}


def _speculators_llama_drafter(root: Path) -> dict[str, str]:
    dims = LLAMA31_8B_TINY
    drafter = build_eagle3_drafter(root / "Llama-3.1-8B-Instruct-speculator.eagle3", dims,
                                   make_draft_vocab(dims.vocab, dims.draft_vocab, seed=5), seed=5,
                                   layout="speculators", verifier_name="meta-llama/Llama-3.1-8B-Instruct",
                                   verifier_architectures=("LlamaForCausalLM",))
    return {"drafter": str(drafter.path)}


def _k25_vocab(root: Path) -> str:
    dims = KIMI_K2_TINY
    vocab = make_draft_vocab(dims.vocab, dims.draft_vocab, seed=7)
    return str(build_eagle3_drafter(root / "Kimi-K25-eagle3", dims, vocab, seed=7).path)


def _full_vocab_drafter(root: Path) -> dict[str, str]:
    return {"drafter": str(build_full_vocab_drafter(root / "kimi-k2.5-eagle3", KIMI_K2_TINY, seed=6).path),
            "vocab": _k25_vocab(root)}


def _full_vocab_mla_drafter(root: Path) -> dict[str, str]:
    drafter = build_mla_drafter(root / "kimi-k2.5-eagle3-mla", KIMI_K25_MLA_TINY, seed=10)
    return {"drafter": str(drafter.path), "vocab": _k25_vocab(root)}


def _dflash(root: Path) -> dict[str, str]:
    return {"model": str(build_dflash_drafter(root / "Qwen3-8B-DFlash-b16").path),
            "verifier": str(build_qwen3_verifier(root / "Qwen3-8B").path)}


def _dspark(root: Path) -> dict[str, str]:
    verifier = build_dspark_verifier(root / "Qwen3-4B").path
    return {"model": str(build_dspark_drafter(root / "DSpark-Qwen3-4B", verifier).path), "verifier": str(verifier)}


def _speculators_dspark(root: Path) -> dict[str, str]:
    """A speculators DSpark drafter: what dspark_to_speculators writes of DeepSpec's layout."""
    from ckptxform import api

    deepspec = _dspark(root / "deepspec")
    drafter = api.apply("dspark_to_speculators", out=root / "Qwen3-4B-speculator.dspark", sources=deepspec,
                        progress=False).out
    return {"model": str(drafter), "verifier": deepspec["verifier"]}


def _speculators_dflash(root: Path) -> dict[str, str]:
    """A speculators DFlash drafter: what dflash_to_speculators writes of z-lab's layout."""
    from ckptxform import api

    zlab = _dflash(root / "zlab")
    drafter = api.apply("dflash_to_speculators", out=root / "Qwen3-8B-speculator.dflash", sources=zlab,
                        progress=False).out
    return {"model": str(drafter), "verifier": zlab["verifier"]}


def _mtp_graft(root: Path) -> dict[str, str]:
    """A verifier, and its MTP layer with other (fine-tuned) values as a standalone drafter:
    what mtp_extract writes of it, which is what speculators' converter writes."""
    from ckptxform import api

    verifier = build_qwen3_next_verifier(root / "Qwen3-Next-80B-A3B-Instruct").path
    tuned = build_qwen3_next_verifier(root / "tuned" / "verifier", mtp_seed=1).path
    drafter = api.apply("mtp_extract", out=root / "Qwen3-Next-80B-A3B-Instruct-mtp-finetuned",
                        sources={"verifier": str(tuned)}, progress=False).out
    return {"drafter": str(drafter), "verifier": str(verifier)}


def _model_as(name: str, path: Path | str) -> dict[str, str]:
    return {name: str(path)}


def _model(path: Path | str) -> dict[str, str]:
    return {"model": str(path)}


def _lora(root: Path) -> dict[str, str]:
    """A Llama base and an rsLoRA adapter with a rank pattern, an alpha pattern and modules_to_save."""
    base = build_llama(root / "Llama-3.1-8B-Instruct")
    adapter = build_lora_adapter(root / "lora-adapter", LLAMA_DIMS_FOR_LORA, r=4, alpha=16, use_rslora=True,
                                 rank_pattern={"layers.1.self_attn.q_proj": 6}, alpha_pattern={"down_proj": 3},
                                 modules_to_save=("lm_head",))
    return {"base": str(base), "adapter": str(adapter)}


_DRAFTER_CHECKS = "the key set SGLang's llama_eagle3 loader places; speculators 0.9 loads it (tests/test_consumers.py)"
_STRUCTURAL_CHECKS = "transformers 5.x: loads it strictly, same bytes as its own save, same logits"
_QUANTIZE_CHECKS = ("llm-compressor 0.14 model_free_ptq and compressed-tensors 0.20, byte for byte with "
                    "quantization_config; transformers loads it (tests/test_quantize_reference.py)")
#: a bf16 Llama whose widths leave partial 128x128 blocks (208, 400) and divide into NVFP4 groups of 16, GQA
_QUANTIZE_TINY = LmDims(hidden=208, heads=4, kv_heads=2, intermediate=400)


def _bf16_llama(root: Path) -> dict[str, str]:
    return _model(build_llama(root / "Qwen3-8B-bf16", _QUANTIZE_TINY))


def _lora_fp8_block(root: Path) -> dict[str, str]:
    """An FP8_BLOCK base (the bf16 stand-in through bf16_to_fp8_block) and a LoRA adapter of it."""
    from ckptxform import api
    from ckptxform.rules.library import shipped_rule_path

    bf16 = build_llama(root / "Qwen3-8B-bf16", _QUANTIZE_TINY)
    base = root / "Qwen3-8B-FP8-block"
    api.apply(str(shipped_rule_path("bf16_to_fp8_block")), out=base, sources={"model": str(bf16)}, progress=False)
    adapter = build_lora_adapter(root / "lora-adapter", _QUANTIZE_TINY, r=8, alpha=16,
                                 targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                                 modules_to_save=("lm_head",))
    return {"base": str(base), "adapter": str(adapter)}


#: int4 groups of 128 need rows of whole groups: every width a multiple of 128, GQA
_INT4_TINY = LmDims(hidden=256, heads=4, kv_heads=2, intermediate=384)
_INT4_CHECKS = ("llm-compressor 0.14 model_free_ptq and compressed-tensors 0.20, byte for byte with "
                "quantization_config; compressed_int4_to_bf16 and transformers read it (tests/test_w4a16_reference.py)")
_INT4_ASYM_CHECKS = ("llm-compressor 0.14 model_free_ptq and compressed-tensors 0.20, byte for byte with "
                     "quantization_config; compressed_int4_to_bf16 reads it (transformers 5.23 refuses this "
                     "scheme's zero points, llm-compressor's own output too) (tests/test_w4a16_reference.py)")


def _bf16_llama_int4(root: Path) -> dict[str, str]:
    return _model(build_llama(root / "Qwen3-8B-bf16", _INT4_TINY))


#: Kimi-K2 at 1/4 widths with the real 128x128 FP8 blocks: every row a whole number of int4
#: groups of 128 (NVFP4's 16 too), kv_a_proj's 144 rows a partial block, a 301-row vocabulary
KIMI_K2_REQUANT = KIMI_K2_TEXT.scaled(4, layers=2, routed_experts=2, experts_per_token=1, vocab=301,
                                      intermediate=1152)
_REQUANT_CHECKS = ("the two-step reference: compressed-tensors' FP8BlockDequantizer, then llm-compressor 0.14 "
                   "model_free_ptq, byte for byte with quantization_config; fp8_block_to_bf16 then {} gives "
                   "the same bytes (tests/test_requantize_reference.py, tests/test_requantize_rules.py)")


def _kimi_k2_fp8_128(root: Path) -> dict[str, str]:
    return _model(build_kimi_k2(root / "Kimi-K2-Instruct", KIMI_K2_REQUANT, block=(128, 128), num_shards=3).path)


STANDINS: dict[str, RuleStandin] = {
    "aqmedai_k2_to_k25": RuleStandin(
        _headline, "Kimi-K2 EAGLE-3 drafter (native)", "Kimi-K2.5 drafter (speculators layout)",
        "AQ-MedAI/Kimi-K2-Instruct-eagle3 -> AQ-MedAI/Kimi-K25-eagle3's vocabulary, moonshotai/Kimi-K2.5 rows",
        "lm_head rows by target token from the sources; speculators 0.9 loads it (tests/test_consumers.py)"),
    "aqmedai_k2_to_k25_sglang": RuleStandin(
        _headline, "Kimi-K2 EAGLE-3 drafter (native)", "Kimi-K2.5 drafter (native, SGLang)",
        "AQ-MedAI/Kimi-K2-Instruct-eagle3 -> AQ-MedAI/Kimi-K25-eagle3's vocabulary", _DRAFTER_CHECKS),
    "awq_to_bf16": RuleStandin(
        lambda root: _model(build_awq_llama(root / "Qwen2.5-7B-Instruct-AWQ")), "AutoAWQ GEMM int4 (qweight, qzeros, scales)",
        "bfloat16", "Qwen/Qwen2.5-7B-Instruct-AWQ, TheBloke/*-AWQ, casperhansen/*-awq",
        "AutoAWQ 0.2.9's dequantize_gemm, bit for bit (tests/test_awq_gptq_reference.py)"),
    "gptq_to_bf16": RuleStandin(
        lambda root: _model(build_gptq_llama(root / "Qwen2.5-7B-Instruct-GPTQ-Int4", desc_act=True, sym=False)),
        "GPTQ v1 int4 (qweight, qzeros, scales, g_idx; desc_act, asymmetric)", "bfloat16",
        "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4, TheBloke/*-GPTQ (auto-gptq, optimum, GPTQModel v1)",
        "auto-gptq 0.7.1's QuantLinear CPU path, bit for bit (tests/test_awq_gptq_reference.py)"),
    "awq_to_compressed_int4": RuleStandin(
        lambda root: _model(build_awq_llama(root / "Qwen2.5-7B-Instruct-AWQ")), "AutoAWQ GEMM int4 (qweight, qzeros, scales)",
        "compressed-tensors pack-quantized int4 with zero points (nibbles moved)",
        "Qwen/Qwen2.5-7B-Instruct-AWQ, TheBloke/*-AWQ, casperhansen/*-awq",
        "compressed-tensors 0.20's AutoAWQConverter: same tensors byte for byte, same quantization_config "
        "(tests/test_awq_gptq_reference.py)"),
    "gptq_to_compressed_int4": RuleStandin(
        lambda root: _model(build_gptq_llama(root / "Qwen2.5-7B-Instruct-GPTQ-Int4", sym=False)),
        "GPTQ v1 int4, rows in group order (qweight, qzeros, scales, g_idx)",
        "compressed-tensors pack-quantized int4 (nibbles moved; zero points when asymmetric)",
        "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4, TheBloke/*-GPTQ (auto-gptq, optimum, GPTQModel v1)",
        "compressed-tensors has no GPTQ converter: its decompress of the output is auto-gptq 0.7.1's "
        "QuantLinear dequantization, bit for bit (tests/test_awq_gptq_reference.py)"),
    "compressed_int4_to_bf16": RuleStandin(
        lambda root: _model(build_kimi_k25_verifier(root / "Kimi-K2.5", KIMI_K2_TINY, num_shards=5).path),
        "compressed-tensors pack-quantized int4", "bfloat16",
        "moonshotai/Kimi-K2.5, moonshotai/Kimi-K2-Thinking",
        "compressed-tensors' own dequantizer, bit for bit"),
    "eagle3_to_speculators": RuleStandin(
        prebuilt_or("eagle3_to_speculators", TORCH_WRITTEN["eagle3_to_speculators"]), "native EAGLE-3 drafter (midlayer.*)", "speculators layout (layers.0.*)",
        "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, EAGLE / SpecForge / SGLang drafters",
        "speculators 0.9 loads it (tests/test_consumers.py); native -> speculators -> native is byte-identical"),
    "fp8_block_to_bf16": RuleStandin(
        lambda root: _model(build_kimi_k2(root / "Kimi-K2-Instruct", num_shards=5).path),
        "FP8 e4m3 block-scaled", "bfloat16", "DeepSeek-V3/R1, moonshotai/Kimi-K2-Instruct",
        "DeepSeek's weight_dequant, block by block; transformers loads it"),
    "fp8_block_to_nvfp4": RuleStandin(
        _kimi_k2_fp8_128, "FP8 e4m3 block-scaled", "NVFP4 weights, 16-bit activations (compressed-tensors "
        "NVFP4A16), in one pass", "DeepSeek-V3/R1, moonshotai/Kimi-K2-Instruct", _REQUANT_CHECKS.format("bf16_to_nvfp4")),
    "fp8_block_to_w4a16": RuleStandin(
        _kimi_k2_fp8_128, "FP8 e4m3 block-scaled", "int4 weights, symmetric, group 128, 16-bit activations "
        "(compressed-tensors W4A16), in one pass", "DeepSeek-V3/R1, moonshotai/Kimi-K2-Instruct",
        _REQUANT_CHECKS.format("bf16_to_w4a16")),
    "gpt2_conv1d_to_linear": RuleStandin(
        lambda root: _model(build_gpt2(root / "gpt2")), "GPT-2 Conv1D [in, out], fused c_attn",
        "nn.Linear [out, in], q/k/v_proj", "openai-community/gpt2 and GPT2LMHeadModel saves",
        "transformers' GPT-2 forward on Linear layers: same logits"),
    **{f"hf_to_gguf_{t}": RuleStandin(
        lambda root: _model(build_spm_llama(root / "TinyLlama-1.1B-Chat-v1.0")), "HF LlamaForCausalLM + tokenizer.model",
        f"one llama.cpp GGUF file, {t.upper()}", "TinyLlama, Llama 2, Mistral 7B v0.1 (SentencePiece tokenizers)",
        f"llama.cpp's convert_hf_to_gguf.py --outtype {t}: same tensor bytes and metadata key/values; "
        "GGUFReader reads it") for t in ("f16", "bf16", "q8_0")},
    "hf_llama_to_meta": RuleStandin(
        lambda root: _model(build_llama(root / "Llama-3.1-8B-Instruct")), "HF LlamaForCausalLM",
        "Meta consolidated.safetensors + params.json", "meta-llama/Llama-3.x, Mistral-7B",
        "a forward written from Meta's reference model: same logits; round trip byte-identical"),
    "meta_llama_to_hf": RuleStandin(
        lambda root: _model(build_meta_consolidated(root / "Mistral-7B-Instruct-v0.3")),
        "Meta/Mistral consolidated + params.json", "HF LlamaForCausalLM",
        "Llama 2/3, CodeLlama (Meta, consolidated.NN.pth: MP=1..8), mistralai/Mistral-7B",
        _STRUCTURAL_CHECKS + "; MP=2/4 shards: transformers' Meta converter (write_model), bit for bit"),
    "mistral_to_hf": RuleStandin(
        lambda root: _model(build_mistral_consolidated(root / "Mistral-Nemo-Instruct-2407")),
        "Mistral consolidated.safetensors + params.json (head_dim, n_kv_heads, sliding_window)",
        "HF MistralForCausalLM", "mistralai/Mistral-Nemo, Mistral-7B-v0.3, Mistral-Small, Codestral",
        "transformers' convert_mistral_weights_to_hf.py (restated at a pinned commit): every tensor bit for bit, "
        "same config; MistralForCausalLM: same logits"),
    "peft_lora_merge": RuleStandin(
        _lora, "HF model + PEFT LoRA adapter folder (plain or rsLoRA, rank/alpha patterns, modules_to_save)",
        "the merged model (W + B @ A * scale, in float32, rounded once)", "any LoRA adapter of a Llama/Qwen/Mistral "
        "base (peft 0.18 save_pretrained)", "peft 0.18's merge_and_unload() + save_pretrained, bit for bit (bf16 and "
        "float32 bases); transformers loads it strictly"),
    "gguf_to_hf": RuleStandin(
        lambda root: _model(build_llama_gguf(root / "Meta-Llama-3.1-8B-Instruct-GGUF" / "model-Q4_K.gguf",
                                             qtype="Q4_K")),
        "Llama GGUF (llama.cpp; F16..Q8_0, K-, I-quants, MXFP4)", "HF LlamaForCausalLM float32",
        "Llama 2/3, Mistral 7B, CodeLlama GGUFs (bartowski/*-GGUF, TheBloke/*-GGUF), tied or not, one file or a "
        "split set",
        "transformers' from_pretrained(gguf_file=): every tensor bit for bit, on each block format"),
    "gguf_qwen2_to_hf": RuleStandin(
        lambda root: _model(build_llama_gguf(root / "Qwen2.5-0.5B-Instruct-GGUF" / "qwen2.5-0.5b-instruct-q8_0.gguf",
                                             qtype="Q8_0", arch="qwen2", tied=True, dims=QWEN2_GGUF)),
        "Qwen2 GGUF (llama.cpp; F16..Q8_0, K-, I-quants, MXFP4)", "HF Qwen2ForCausalLM float32",
        "Qwen2, Qwen2.5 GGUFs (Qwen/Qwen2.5-*-GGUF, bartowski/*-GGUF), tied or not, one file or a split set",
        "transformers' from_pretrained(gguf_file=): every tensor bit for bit, q/k/v biases, tied head"),
    "peft_lora_merge_fp8_block": RuleStandin(
        _lora_fp8_block, "FP8 block-quantized model (compressed-tensors FP8_BLOCK) + PEFT LoRA adapter folder",
        "the merged model, FP8_BLOCK again (scales recomputed)", "LoRA adapters of llm-compressor FP8_BLOCK "
        "models and bf16_to_fp8_block outputs", "peft 0.18's merge_and_unload() on the dequantized base, then "
        "bf16_to_fp8_block, bit for bit"),
    "llava_to_text": RuleStandin(
        lambda root: _model(build_llava(root / "llava-1.5-7b-hf")),
        "Llava VLM (language_model.*, vision_tower.*, text_config)", "text-only LlamaForCausalLM",
        "llava-hf/llava-1.5-7b-hf, llava-1.5-13b-hf and their fine-tunes",
        "transformers' LlavaForConditionalGeneration text path: same logits; LlamaForCausalLM loads it strictly"),
    "mixtral_legacy_to_fused": RuleStandin(
        lambda root: _model(build_moe(root / "Mixtral-8x7B-Instruct-v0.1", "mixtral")),
        "Mixtral per-expert w1/w2/w3", "fused gate_up_proj/down_proj (transformers 5.x)",
        "mistralai/Mixtral-8x7B, Mixtral-8x22B", _STRUCTURAL_CHECKS),
    "phi3_to_llama": RuleStandin(
        lambda root: _model(build_phi3(root / "Phi-3-medium-4k-instruct")),
        "Phi-3 fused qkv_proj/gate_up_proj", "Llama q/k/v_proj, gate/up_proj",
        "microsoft/Phi-3 and Phi-3.5 (mini, medium)", _STRUCTURAL_CHECKS),
    "prune_draft_vocab": RuleStandin(
        _full_vocab_drafter, "full-vocabulary EAGLE-3 drafter", "draft-vocabulary drafter (native)",
        "lightseekorg/kimi-k2.5-eagle3 with AQ-MedAI/Kimi-K25-eagle3's map",
        "lm_head rows selected by target id, computed from the sources; " + _DRAFTER_CHECKS.split("; ")[0]),
    "prune_draft_vocab_mla": RuleStandin(
        _full_vocab_mla_drafter, "full-vocabulary MLA EAGLE-3 drafter", "draft-vocabulary MLA drafter (native)",
        "lightseekorg/kimi-k2.5-eagle3-mla (key list unverified)",
        "lm_head rows selected by target id, computed from the sources"),
    "qwen2_moe_legacy_to_fused": RuleStandin(
        lambda root: _model(build_moe(root / "Qwen3-30B-A3B", "qwen3_moe")),
        "qwen2_moe-family per-expert experts", "fused gate_up_proj/down_proj (transformers 5.x)",
        "Qwen2/3-MoE, DeepSeek-V2/V3, GLM-4-MoE, OLMoE, ...", _STRUCTURAL_CHECKS),
    "qwen2_to_llama": RuleStandin(
        lambda root: _model(build_qwen2(root / "Qwen2.5-7B-Instruct")),
        "Qwen2 (q/k/v_proj biases, no o_proj bias)", "LlamaForCausalLM, attention_bias with zero o_proj biases",
        "Qwen/Qwen2-*, Qwen/Qwen2.5-* (dense, tied or untied)",
        "transformers' Qwen2ForCausalLM: the same logits; LlamaForCausalLM loads it strictly"),
    "speculators_to_eagle3": RuleStandin(
        _speculators_llama_drafter, "speculators layout (layers.0.*)", "native EAGLE-3 drafter (midlayer.*)",
        "RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3", _DRAFTER_CHECKS.split("; ")[0]
        + "; native -> speculators -> native is byte-identical"),
    "tie_embeddings": RuleStandin(
        lambda root: _model(build_llama(root / "Llama-3.2-1B-untied", head="copy")),
        "lm_head.weight equal to the embedding", "tied embeddings (checked byte-identical)",
        "Llama-3.2-1B, Qwen2.5-0.5B, Gemma (what untie_embeddings writes)", _STRUCTURAL_CHECKS),
    "untie_embeddings": RuleStandin(
        lambda root: _model(build_llama(root / "Llama-3.2-1B", head="tied")),
        "tied embeddings (no lm_head.weight)", "an explicit lm_head.weight",
        "meta-llama/Llama-3.2-1B, Qwen2.5-0.5B, Gemma", _STRUCTURAL_CHECKS),
    "mxfp4_to_bf16": RuleStandin(
        lambda root: _model(build_gpt_oss(root / "gpt-oss-20b").path),
        "gpt-oss MXFP4 experts (*_blocks, *_scales)", "bfloat16, transformers' GptOssExperts layout",
        "openai/gpt-oss-20b, openai/gpt-oss-120b",
        "transformers 5.x from_pretrained(Mxfp4Config(dequantize=True)), bit for bit; loads it strictly"),
    "gemma_to_llama": RuleStandin(
        lambda root: _model(build_gemma(root / "gemma-7b")), "Gemma (x * (1 + w) norms, scaled embedding, tied)",
        "Llama layout (w + 1 norms, scale folded, untied head)", "google/gemma-2b, google/gemma-7b",
        "llama.cpp's w + 1 and transformers' embedding scale bit for bit; LlamaForCausalLM computes Gemma's logits"),
    "bf16_to_fp8_block": RuleStandin(
        _bf16_llama, "bfloat16 HF decoder (Llama/Qwen/Mistral keys)", "FP8 e4m3, 128x128 block scales "
        "(compressed-tensors FP8_BLOCK)", "Qwen/Qwen3-8B, meta-llama/Llama-3.1-8B-Instruct, fine-tuned bf16 models",
        _QUANTIZE_CHECKS),
    "bf16_to_fp8_dynamic": RuleStandin(
        _bf16_llama, "bfloat16 HF decoder (Llama/Qwen/Mistral keys)", "FP8 e4m3, per-channel scales "
        "(compressed-tensors FP8_DYNAMIC)", "Qwen/Qwen3-8B, meta-llama/Llama-3.1-8B-Instruct, fine-tuned bf16 models",
        _QUANTIZE_CHECKS),
    "bf16_to_nvfp4": RuleStandin(
        _bf16_llama, "bfloat16 HF decoder (Llama/Qwen/Mistral keys)", "NVFP4 weights, 16-bit activations "
        "(compressed-tensors NVFP4A16)", "Qwen/Qwen3-8B, meta-llama/Llama-3.1-8B-Instruct, fine-tuned bf16 models",
        _QUANTIZE_CHECKS),
    "bf16_to_w4a16": RuleStandin(
        _bf16_llama_int4, "bfloat16 HF decoder (Llama/Qwen/Mistral keys)", "int4 weights, symmetric, group 128, "
        "16-bit activations (compressed-tensors W4A16)", "Qwen/Qwen3-8B, meta-llama/Llama-3.1-8B-Instruct, "
        "fine-tuned bf16 models", _INT4_CHECKS),
    "bf16_to_w4a16_asym": RuleStandin(
        _bf16_llama_int4, "bfloat16 HF decoder (Llama/Qwen/Mistral keys)", "int4 weights with zero points, "
        "group 128, 16-bit activations (compressed-tensors W4A16_ASYM)", "Qwen/Qwen3-8B, "
        "meta-llama/Llama-3.1-8B-Instruct, fine-tuned bf16 models", _INT4_ASYM_CHECKS),
    "fp8_to_bf16": RuleStandin(
        lambda root: _model(build_scaled_llama(root / "Llama-3.1-8B-Instruct-FP8-dynamic", "fp8-channel")),
        "FP8 e4m3 x weight_scale per tensor/channel (compressed-tensors)", "bfloat16",
        "RedHatAI/*-FP8, *-FP8-dynamic (llm-compressor FP8, FP8_DYNAMIC)",
        "compressed-tensors' own decompress on llm-compressor outputs, bit for bit; transformers loads it"),
    "nvfp4_to_bf16": RuleStandin(
        lambda root: _model(build_scaled_llama(root / "Llama-3.1-8B-Instruct-NVFP4", "mixed")),
        "NVFP4 (compressed-tensors or ModelOpt; FP8 groups beside)", "bfloat16",
        "RedHatAI/*-NVFP4 (llm-compressor), nvidia/*-FP4 (ModelOpt)",
        "compressed-tensors' decompress (llm-compressor outputs) and ModelOpt's dequantize (its exports), "
        "bit for bit"),
    "mtp_extract": RuleStandin(
        lambda root: {"verifier": str(build_qwen3_next_verifier(root / "Qwen3-Next-80B-A3B-Instruct").path)},
        "a verifier's own MTP layer (mtp.*)", "standalone MTP drafter (speculators layout)",
        "Qwen/Qwen3-Next-80B-A3B, Qwen3.5 (mtp.* keys)",
        "speculators 0.9's MTPConverter, tensor for tensor and field for field; speculators loads it"),
    "dflash_to_speculators": RuleStandin(
        _dflash, "z-lab DFlash drafter", "speculators DFlash layout (aux ids + 1)",
        "z-lab/Qwen3-8B-DFlash-b16 and the other z-lab DFlash drafters",
        "speculators 0.9's DFlashConverter, tensor for tensor and field for field; speculators loads it"),
    "dspark_to_speculators": RuleStandin(
        _dspark, "DeepSpec DSpark drafter (Qwen3DSparkModel)", "speculators DSpark layout (aux ids + 1)",
        "DeepSpec-trained Qwen3 DSpark drafters (deepseek-ai/DeepSpec's dspark_qwen3 recipes)",
        "speculators 0.9's DSparkDraftModel loads it strictly; tensors byte for byte; DeepSpec -> speculators -> "
        "DeepSpec is byte-identical"),
    "speculators_to_dspark": RuleStandin(
        _speculators_dspark, "speculators DSpark drafter", "DeepSpec's Qwen3DSparkModel layout (aux ids - 1)",
        "speculators-trained Qwen3 DSpark drafters (anchor-first blocks)",
        "DeepSpec -> speculators -> DeepSpec gives back the tensors and config fields"),
    "speculators_to_dflash": RuleStandin(
        _speculators_dflash, "speculators DFlash drafter (Qwen3 layers)", "z-lab DFlash layout (aux ids - 1)",
        "speculators-trained Qwen3 DFlash drafters",
        "z-lab's dflash 0.1.0 loads it strictly; z-lab -> speculators -> z-lab gives back the tensors and config"),
    "mtp_graft": RuleStandin(
        _mtp_graft, "standalone MTP drafter + its verifier", "the verifier with that MTP layer (mtp.*)",
        "Qwen/Qwen3-Next-80B-A3B, Qwen3.5 with a speculators-trained MTP head",
        "grafting speculators' own extraction back gives the verifier's shard files byte for byte"),
    "deepseek_nextn_extract": RuleStandin(
        lambda root: _model_as("verifier", build_kimi_k2(root / "DeepSeek-V3", DEEPSEEK_V3_61_TINY, num_shards=8,
                                                         nextn=True).path),
        "DeepSeek-V3 MTP block (model.layers.61.*)", "SGLang's standalone NextN layer (model.layers.0.*)",
        "deepseek-ai/DeepSeek-V3, DeepSeek-R1 (FP8 kept)",
        "the keys, bytes and config SGLang's export_deepseek_nextn.py writes"),
    "torchtitan_llama_to_hf": RuleStandin(
        prebuilt_or("torchtitan_llama_to_hf", TORCH_WRITTEN["torchtitan_llama_to_hf"]),
        "torchtitan 0.3 Llama-3 DCP checkpoint (+ hf_assets)", "HF LlamaForCausalLM",
        "torchtitan Llama-3 training runs (FSDP/TP, any rank count), meta-llama/Llama-3.1-8B assets",
        "torchtitan's Llama3StateDictAdapter.to_hf on what dcp.load reads, bit for bit, on real 2-rank FSDP2 "
        "saves; transformers loads it with torchtitan's logits"),
    "torchtitan_0_2_llama_to_hf": RuleStandin(
        prebuilt_or("torchtitan_0_2_llama_to_hf", TORCH_WRITTEN["torchtitan_0_2_llama_to_hf"]),
        "torchtitan 0.2 Llama-3 DCP checkpoint (+ hf_assets)", "HF LlamaForCausalLM",
        "torchtitan <= 0.2 Llama-3 training runs",
        "torchtitan 0.3's to_hf on the same tensors under 0.3's names, bit for bit"),
    "megatron_gpt_to_hf": RuleStandin(
        prebuilt_or("megatron_gpt_to_hf", TORCH_WRITTEN["megatron_gpt_to_hf"]),
        "Megatron-Core torch_dist GPT (Llama-style) + its saved args", "HF LlamaForCausalLM",
        "Megatron-LM / NeMo Llama-style GPT training runs (any TP/PP; dense)",
        "Megatron-Bridge's stream_weights_megatron_to_hf (LlamaBridge) on the same TP=2 model, bit for bit; "
        "transformers loads it with megatron-core's own TP=2 logits"),
    "megatron_moe_to_hf": RuleStandin(
        prebuilt_or("megatron_moe_to_hf", TORCH_WRITTEN["megatron_moe_to_hf"]),
        "Megatron-Core torch_dist GPT with MoE layers (Mixtral-style) + its saved args", "HF MixtralForCausalLM",
        "Megatron-LM / NeMo Mixtral-style MoE training runs (any TP/PP; softmax top-k router, no shared expert)",
        "Megatron-Bridge's stream_weights_megatron_to_hf (Qwen3MoEBridge's expert and router mappings) on the "
        "same TP=2 model, bit for bit; transformers loads it with megatron-core's own TP=2 logits"),
}


def standin_for(stem: str) -> RuleStandin | None:
    """The stand-in of the shipped rule with file stem ``stem``, or None."""
    return STANDINS.get(stem)
