"""Small, real stand-ins of the checkpoints the shipped rules read.

The Hub is out of reach for the demo, the tests and the benchmark, so they run on
checkpoints built here: the real key names, layouts, dtypes, config fields and vocabulary
maps of AQ-MedAI/Kimi-K2-Instruct-eagle3, AQ-MedAI/Kimi-K25-eagle3, moonshotai/Kimi-K2.5
(int4 routed experts), moonshotai/Kimi-K2-Instruct (FP8) and Kimi-K2-Thinking (int4),
lightseekorg/kimi-k2.5-eagle3 and yuhuili/EAGLE3-LLaMA3.1-Instruct-8B (see
eagle3-formats.md), with the dimensions scaled down. Every builder is deterministic: the
same arguments give byte-identical files, so tests can compare hashes.

Tensor values are seeded by (seed, native key name), not by position: the speculators
layout of a drafter holds exactly the values of its native layout, and omitting a key does
not change the others. Only the builders import torch (lazily), so importing the package
costs nothing to ``validate`` or ``plan``.

Modules: ``dims`` (model families' dimensions), ``draft_vocab`` (vocabulary maps),
``tensors`` (seeded values, file writing, records), ``configs`` (config.json contents),
``drafters``, ``mla`` (an MLA drafter) and ``verifiers`` (builders per family), ``headline`` (the headline
conversion's three sources), ``deepseek`` (the DeepSeek-V3 text model Kimi-K2/K2.5 share),
``quantized`` (FP8 block and int4 quantization, the Kimi-K2 builder), ``gpt_oss`` (gpt-oss with MXFP4 experts), ``shards``
(multi-shard writing), ``hf_models`` (the whole-model families the structural rules
convert: Llama, Mixtral, Qwen3-MoE, Phi-3, GPT-2, Meta consolidated) and ``for_rules``
(the stand-ins of every shipped rule, which ``ckptxform demo RULE`` builds). The names below are the API; the rest is shared
between these modules only.

Example::

    standins = build_headline_standins(tmp_path)
    standins.sources  # {"drafter": ".../Kimi-K2-Instruct-eagle3", "target_vocab": ..., ...}
"""

from ckptxform.standins.deepseek import KIMI_K2_TEXT, DeepseekV3Dims
from ckptxform.standins.dims import (
    KIMI_K2,
    KIMI_K2_TINY,
    LLAMA31_8B,
    LLAMA31_8B_TINY,
    DrafterDims,
)
from ckptxform.standins.draft_vocab import make_draft_vocab
from ckptxform.standins.drafters import (
    build_eagle3_drafter,
    build_full_vocab_drafter,
    build_llama_eagle3,
)
from ckptxform.standins.headline import HeadlineStandins, build_headline_standins
from ckptxform.standins.mla import KIMI_K25_MLA_TINY, MlaDims, build_mla_drafter
from ckptxform.standins.quantized import KIMI_K2_FP8_TINY, build_kimi_k2
from ckptxform.standins.tensors import BuiltCheckpoint
from ckptxform.standins.verifiers import build_kimi_k25_verifier, build_llama_verifier

__all__ = [
    "KIMI_K2",
    "KIMI_K25_MLA_TINY",
    "KIMI_K2_FP8_TINY",
    "KIMI_K2_TEXT",
    "KIMI_K2_TINY",
    "LLAMA31_8B",
    "LLAMA31_8B_TINY",
    "BuiltCheckpoint",
    "DeepseekV3Dims",
    "DrafterDims",
    "HeadlineStandins",
    "MlaDims",
    "build_eagle3_drafter",
    "build_full_vocab_drafter",
    "build_headline_standins",
    "build_kimi_k2",
    "build_kimi_k25_verifier",
    "build_llama_eagle3",
    "build_llama_verifier",
    "build_mla_drafter",
    "make_draft_vocab",
]
