"""The shipped rule library (rules/*.yaml) on stand-ins of the checkpoints each rule names.

Every rule validates, runs, and accounts for every tensor of the checkpoint it converts;
native-layout outputs hold exactly what SGLang's llama_eagle3 loader places; native ->
speculators -> native gives back the same bytes; pruning a full-vocabulary lm_head selects
rows by target id. Expectations are computed here from the source files with torch, never
from what the engine computed.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import ckptxform
import torch
from conftest import REPO, read_audit, read_output, same_bits
from reference_models import OWN_REFERENCE_RULES, STRUCTURAL_RULES
from safetensors.torch import load_file, save_file

from ckptxform import api
from ckptxform.engine.run.execute import ApplyResult
from ckptxform.errors import PlanError, VocabMapError
from ckptxform.rules.loader import load_rules
from ckptxform.standins.gpt_oss import build_gpt_oss
from ckptxform.standins import (
    KIMI_K2_TINY,
    KIMI_K25_MLA_TINY,
    LLAMA31_8B_TINY,
    build_eagle3_drafter,
    build_full_vocab_drafter,
    build_headline_standins,
    build_kimi_k2,
    build_kimi_k25_verifier,
    build_llama_eagle3,
    build_mla_drafter,
    make_draft_vocab,
)

RULES = REPO / "rules"
SHIPPED = sorted(p.name for p in RULES.glob("*.yaml"))
#: the EAGLE-3 drafter rules and the dequant rules, run here on stand-ins; the structural
#: rules (MoE fusing, Meta/Phi-3/GPT-2 layouts, tying) are run against transformers in
#: test_structural_library
#: rules for a trainer's own checkpoints, run on checkpoints the trainers write in
#: test_dcp_torchtitan and test_dcp_megatron
TRAINER_RULES = ("megatron_gpt_to_hf.yaml", "megatron_moe_to_hf.yaml", "torchtitan_0_2_llama_to_hf.yaml",
                 "torchtitan_llama_to_hf.yaml")
#: rules one of whose sources is what the user trained (an adapter), which no Hub repo holds: an example path
OWN_OUTPUT_RULES = ("peft_lora_merge.yaml", "peft_lora_merge_fp8_block.yaml")
DRAFTER_RULES = sorted(set(SHIPPED) - set(STRUCTURAL_RULES) - set(OWN_REFERENCE_RULES) - set(TRAINER_RULES))
SCHEMA_LINE = "# yaml-language-server: $schema=../schemas/rules.schema.json"

LAYER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
         "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
         "mlp.down_proj.weight", "input_layernorm.weight", "hidden_norm.weight",
         "post_attention_layernorm.weight")
#: what SGLang's llama_eagle3 loader places (eagle3-formats.md); embed_tokens is optional
SGLANG_KEYS = {f"midlayer.{k}" for k in LAYER} | {"fc.weight", "norm.weight", "lm_head.weight",
                                                  "d2t", "t2d"}
NATIVE_RULES = ("aqmedai_k2_to_k25_sglang.yaml", "speculators_to_eagle3.yaml",
                "prune_draft_vocab.yaml")


# ------------------------------------------------------------------------------ stand-ins


@dataclass(frozen=True)
class Scenario:
    """Stand-ins for one rule: ``--source`` locations and the converted source's keys."""

    sources: dict[str, str]
    converted_keys: frozenset[str]
    #: the rule's ``convert`` source
    converted: str = "drafter"


def _headline(root: Path) -> Scenario:
    standins = build_headline_standins(root, dims=KIMI_K2_TINY, seed=3)
    return Scenario(standins.sources, frozenset(standins.drafter.keys))


def _native_llama(root: Path) -> Scenario:
    # yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: a pickled pytorch_model.bin, float16
    drafter = build_llama_eagle3(root / "EAGLE3-LLaMA3.1-Instruct-8B", seed=4)
    return Scenario({"drafter": str(drafter.path)}, frozenset(drafter.keys))


def _speculators_llama(root: Path) -> Scenario:
    dims = LLAMA31_8B_TINY
    drafter = build_eagle3_drafter(
        root / "Llama-3.1-8B-Instruct-speculator.eagle3", dims,
        make_draft_vocab(dims.vocab, dims.draft_vocab, seed=5), seed=5, layout="speculators",
        verifier_name="meta-llama/Llama-3.1-8B-Instruct",
        verifier_architectures=("LlamaForCausalLM",))
    return Scenario({"drafter": str(drafter.path)}, frozenset(drafter.keys))


def _full_vocab_kimi(root: Path) -> Scenario:
    dims = KIMI_K2_TINY
    drafter = build_full_vocab_drafter(root / "kimi-k2.5-eagle3", dims, seed=6)
    vocab = build_eagle3_drafter(root / "Kimi-K25-eagle3", dims,
                                 make_draft_vocab(dims.vocab, dims.draft_vocab, seed=7), seed=7)
    return Scenario({"drafter": str(drafter.path), "vocab": str(vocab.path)},
                    frozenset(drafter.keys))


def _full_vocab_kimi_mla(root: Path) -> Scenario:
    dims = KIMI_K25_MLA_TINY
    drafter = build_mla_drafter(root / "kimi-k2.5-eagle3-mla", dims, seed=10)
    vocab = build_eagle3_drafter(root / "Kimi-K25-eagle3", dims.base,
                                 make_draft_vocab(dims.base.vocab, dims.base.draft_vocab, seed=11), seed=11)
    return Scenario({"drafter": str(drafter.path), "vocab": str(vocab.path)}, frozenset(drafter.keys))


def _kimi_k2_fp8(root: Path) -> Scenario:
    model = build_kimi_k2(root / "Kimi-K2-Instruct", num_shards=5, seed=12)
    return Scenario({"model": str(model.path)}, frozenset(model.keys), "model")


def _kimi_k2_fp8_128(root: Path) -> Scenario:
    """The real 128x128 blocks at 1/4 widths: rows of whole int4 groups of 128 (W4A16 refuses others)."""
    from ckptxform.standins.for_rules import KIMI_K2_REQUANT

    model = build_kimi_k2(root / "Kimi-K2-Instruct", KIMI_K2_REQUANT, block=(128, 128), num_shards=2, seed=12)
    return Scenario({"model": str(model.path)}, frozenset(model.keys), "model")


def _kimi_k25_int4(root: Path) -> Scenario:
    model = build_kimi_k25_verifier(root / "Kimi-K2.5", KIMI_K2_TINY, seed=13)
    return Scenario({"model": str(model.path)}, frozenset(model.keys), "model")


def _gpt_oss_mxfp4(root: Path) -> Scenario:
    model = build_gpt_oss(root / "gpt-oss-20b", seed=14)
    return Scenario({"model": str(model.path)}, frozenset(model.keys), "model")


def _bf16_llama(root: Path) -> Scenario:
    from ckptxform.standins.hf_models import LmDims, build_llama
    from safetensors import safe_open

    model = build_llama(root / "Qwen3-8B-bf16", LmDims(hidden=208, heads=4, kv_heads=2, intermediate=400), seed=14)
    with safe_open(str(model / "model.safetensors"), "np") as f:
        keys = frozenset(f.keys())
    return Scenario({"model": str(model)}, keys, "model")


def _awq_gptq(fmt: str, **kwargs: Any) -> Callable[[Path], Scenario]:
    """AutoAWQ / GPTQ stand-ins (widths of 96 and 160: groups of 32 only, GQA 3:1)."""
    def build(root: Path) -> Scenario:
        from ckptxform.standins.awq_gptq import build_awq_llama, build_gptq_llama

        model = (build_awq_llama if fmt == "awq" else build_gptq_llama)(root / fmt, seed=14, **kwargs)
        return Scenario({"model": str(model)}, frozenset(read_output(model)), "model")
    return build


def _bf16_llama_int4(root: Path) -> Scenario:
    """Widths of whole int4 groups of 128 (W4A16 refuses others), GQA."""
    from ckptxform.standins.hf_models import LmDims, build_llama

    model = build_llama(root / "Qwen3-8B-bf16", LmDims(hidden=256, heads=4, kv_heads=2, intermediate=384), seed=14)
    return Scenario({"model": str(model)}, frozenset(read_output(model)), "model")


def _scaled_llama(scheme: str) -> Callable[[Path], Scenario]:
    def build(root: Path) -> Scenario:
        from ckptxform.standins.scaled import build_scaled_llama

        model = build_scaled_llama(root / f"Llama-{scheme}", scheme, seed=14)  # type: ignore[arg-type]
        return Scenario({"model": str(model)}, frozenset(read_output(model)), "model")
    return build


_FP8_SCALED, _NVFP4_MIXED = _scaled_llama("fp8-tensor"), _scaled_llama("mixed")

#: rules that convert a verifier (dequantize or quantize it), not a drafter: no drafter config to write
VERIFIER_RULES = ("compressed_int4_to_bf16.yaml", "fp8_block_to_bf16.yaml", "mxfp4_to_bf16.yaml", "fp8_to_bf16.yaml",
                  "nvfp4_to_bf16.yaml", "bf16_to_fp8_block.yaml", "bf16_to_fp8_dynamic.yaml", "bf16_to_nvfp4.yaml",
                  "bf16_to_w4a16.yaml", "bf16_to_w4a16_asym.yaml", "awq_to_bf16.yaml", "gptq_to_bf16.yaml",
                  "awq_to_compressed_int4.yaml", "gptq_to_compressed_int4.yaml", "fp8_block_to_nvfp4.yaml",
                  "fp8_block_to_w4a16.yaml")

#: drafters that are not EAGLE-3 ones (no norm flags, no vocabulary map)
NOT_EAGLE3_RULES = ("deepseek_nextn_extract.yaml", "dflash_to_speculators.yaml", "mtp_extract.yaml",
                    "mtp_graft.yaml", "dspark_to_speculators.yaml", "speculators_to_dspark.yaml",
                    "speculators_to_dflash.yaml")

#: one stand-in builder per shipped rule: a new rule must come with its stand-ins
STANDINS: dict[str, Callable[[Path], Scenario]] = {
    "aqmedai_k2_to_k25.yaml": _headline,
    "aqmedai_k2_to_k25_sglang.yaml": _headline,
    "eagle3_to_speculators.yaml": _native_llama,
    "speculators_to_eagle3.yaml": _speculators_llama,
    "prune_draft_vocab.yaml": _full_vocab_kimi,
    "prune_draft_vocab_mla.yaml": _full_vocab_kimi_mla,
    "fp8_block_to_bf16.yaml": _kimi_k2_fp8,
    "fp8_block_to_nvfp4.yaml": _kimi_k2_fp8_128,
    "fp8_block_to_w4a16.yaml": _kimi_k2_fp8_128,
    "compressed_int4_to_bf16.yaml": _kimi_k25_int4,
    "mxfp4_to_bf16.yaml": _gpt_oss_mxfp4,
    "bf16_to_fp8_block.yaml": _bf16_llama,
    "bf16_to_fp8_dynamic.yaml": _bf16_llama,
    "bf16_to_nvfp4.yaml": _bf16_llama,
    "bf16_to_w4a16.yaml": _bf16_llama_int4,
    "bf16_to_w4a16_asym.yaml": _bf16_llama_int4,
    "awq_to_bf16.yaml": _awq_gptq("awq"),
    "awq_to_compressed_int4.yaml": _awq_gptq("awq"),
    "gptq_to_bf16.yaml": _awq_gptq("gptq", desc_act=True, sym=False),
    "gptq_to_compressed_int4.yaml": _awq_gptq("gptq", sym=False),
    "fp8_to_bf16.yaml": _FP8_SCALED,
    "nvfp4_to_bf16.yaml": _NVFP4_MIXED,
    "mtp_extract.yaml": lambda root: _qwen3_next(root),
    "dflash_to_speculators.yaml": lambda root: _dflash(root),
    "dspark_to_speculators.yaml": lambda root: _dspark(root),
    "speculators_to_dspark.yaml": lambda root: _speculators_dspark(root),
    "speculators_to_dflash.yaml": lambda root: _speculators_dflash(root),
    "mtp_graft.yaml": lambda root: _mtp_graft(root),
    "deepseek_nextn_extract.yaml": lambda root: _deepseek_v3(root),
}


def _deepseek_v3(root: Path) -> Scenario:
    from ckptxform.standins.quantized import DEEPSEEK_V3_61_TINY

    model = build_kimi_k2(root / "DeepSeek-V3", DEEPSEEK_V3_61_TINY, num_shards=8, seed=17, nextn=True)
    return Scenario({"verifier": str(model.path)}, frozenset(model.keys), "verifier")


def _mtp_graft(root: Path) -> Scenario:
    from ckptxform.standins.for_rules import STANDINS as RULE_STANDINS

    sources = RULE_STANDINS["mtp_graft"].build(root)
    keys = frozenset(read_output(Path(sources["drafter"])))
    return Scenario(sources, keys, "drafter")


def _qwen3_next(root: Path) -> Scenario:
    from ckptxform.standins.mtp import build_qwen3_next_verifier

    verifier = build_qwen3_next_verifier(root / "Qwen3-Next-80B-A3B-Instruct", seed=14)
    return Scenario({"verifier": str(verifier.path)}, frozenset(verifier.keys), "verifier")


def _dflash(root: Path) -> Scenario:
    from ckptxform.standins.dflash import build_dflash_drafter, build_qwen3_verifier

    drafter = build_dflash_drafter(root / "Qwen3-8B-DFlash-b16", seed=15)
    verifier = build_qwen3_verifier(root / "Qwen3-8B", seed=16)
    return Scenario({"model": str(drafter.path), "verifier": str(verifier.path)}, frozenset(drafter.keys), "model")


def _dspark(root: Path) -> Scenario:
    from ckptxform.standins.dspark import build_dspark_drafter, build_dspark_verifier

    verifier = build_dspark_verifier(root / "Qwen3-4B", seed=18)
    drafter = build_dspark_drafter(root / "DSpark-Qwen3-4B", verifier.path, seed=19)
    return Scenario({"model": str(drafter.path), "verifier": str(verifier.path)}, frozenset(drafter.keys), "model")


def _speculators_dflash(root: Path) -> Scenario:
    from ckptxform.standins.for_rules import STANDINS as RULE_STANDINS

    sources = RULE_STANDINS["speculators_to_dflash"].build(root)
    return Scenario(sources, frozenset(read_output(Path(sources["model"]))), "model")


def _speculators_dspark(root: Path) -> Scenario:
    from ckptxform.standins.for_rules import STANDINS as RULE_STANDINS

    sources = RULE_STANDINS["speculators_to_dspark"].build(root)
    return Scenario(sources, frozenset(read_output(Path(sources["model"]))), "model")


@dataclass(frozen=True)
class Run:
    scenario: Scenario
    result: ApplyResult

    @property
    def out(self) -> Path:
        return self.result.out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Every shipped rule applied once to its stand-ins (read-only)."""
    built: dict[Callable[[Path], Scenario], Scenario] = {}
    done: dict[str, Run] = {}
    for name, build in STANDINS.items():
        root = tmp_path_factory.mktemp(name.removesuffix(".yaml"))
        if build not in built:  # the two headline rules share their stand-ins
            built[build] = build(root / "sources")
        scenario = built[build]
        result = api.apply(RULES / name, out=root / "out", sources=scenario.sources,
                           progress=False)
        done[name] = Run(scenario, result)
    return done


def config_of(out: Path) -> dict[str, Any]:
    return json.loads((out / "config.json").read_text())


def bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


# ------------------------------------------------------------------------------ the files


def test_every_shipped_rule_has_stand_ins() -> None:
    assert sorted(STANDINS) == DRAFTER_RULES
    assert set(STRUCTURAL_RULES) <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_rule_validates_and_is_documented(name: str) -> None:
    path = RULES / name
    rules = load_rules(path)
    lines = path.read_text().splitlines()
    assert lines[0] == SCHEMA_LINE
    header = [line for line in lines[1:lines.index("version: 1")] if line.startswith("#")]
    assert len(header) >= 5, "document what it converts, for which consumer, what is initialised"
    assert rules.convert in rules.sources
    # Shipped rules name the real checkpoints (a trainer's own checkpoint, which no Hub repo
    # holds, an example path); stand-ins come in through --source.
    assert all((spec.repo and not spec.path) or (spec.example and name in (*TRAINER_RULES, *OWN_OUTPUT_RULES))
               for spec in rules.sources.values()), rules.sources


# ------------------------------------------------------------------- runs and the audit


@pytest.mark.parametrize("name", DRAFTER_RULES)
def test_rule_accounts_for_every_source_tensor(name: str, runs: dict[str, Run]) -> None:
    run = runs[name]
    events = read_audit(run.out)
    assert events[0]["event"] == "run" and events[-1]["event"] == "summary"
    assert events[-1]["status"] == "ok"
    tensors = [e for e in events if e["event"] == "tensor"]
    # No tensor of any source is reported twice.
    assert not [k for k, n in Counter((e["source"], e["key"]) for e in tensors).items() if n > 1]
    converted = [e for e in tensors if e["source"] == run.scenario.converted]
    assert {e["key"] for e in converted} == run.scenario.converted_keys
    assert not [e for e in converted if e["action"] == "unused"]
    for event in converted:
        assert event["rule"] and event["reason"], event
        # a consumed tensor (AWQ/GPTQ qzeros, scales) is written into another's outputs, none of its own
        assert (event["target"] is None) == (event["action"] in ("skipped", "consumed")), event


@pytest.mark.parametrize("name", DRAFTER_RULES)
def test_rule_runs_without_warnings(name: str, runs: dict[str, Run]) -> None:
    # The SGLang variant's base rule `midlayer.` -> `layers.0.` is overridden by the child's
    # `midlayer\..+`: it matches keys but takes none, which is intended and not warned about.
    assert runs[name].result.plan.warnings == ()


def test_a_rule_that_matches_no_key_at_all_is_refused(tmp_path: Path) -> None:
    rule = tmp_path / "typo.yaml"
    rule.write_text(
        "version: 1\nsources: {d: {path: unused}}\nconvert: d\ntensors:\n"
        "  - match: 'midlayer\\.(.+)'\n    rename: 'layers.0.\\1'\n"
        "  - match: 'lm_haed\\.weight'\n  - match: '.*'\n")
    from ckptxform.standins import KIMI_K2_TINY, build_eagle3_drafter, make_draft_vocab

    ids = make_draft_vocab(KIMI_K2_TINY.vocab, KIMI_K2_TINY.draft_vocab, seed=0)
    build_eagle3_drafter(tmp_path / "d", KIMI_K2_TINY, ids)
    with pytest.raises(PlanError, match=re.escape(f"tensors[1] ({rule}:7) match 'lm_haed")):
        ckptxform.plan(rule, sources={"d": str(tmp_path / "d")})


@pytest.mark.parametrize("name", DRAFTER_RULES)
def test_copied_tensors_are_the_source_tensors(name: str, runs: dict[str, Run]) -> None:
    """Renames land on the right tensors: every output copied from the converted source
    holds exactly the bytes of the source tensor its audit record names."""
    run = runs[name]
    source = _read_source(Path(run.scenario.sources[run.scenario.converted]))
    written = read_output(run.out)
    copied = [e for e in read_audit(run.out) if e["event"] == "tensor" and e["source"] == run.scenario.converted
              and e["action"] in ("loaded", "renamed")]
    assert copied
    for event in copied:
        assert same_bits(written[event["target"]], source[event["key"]]), event["key"]


def _read_source(path: Path) -> dict[str, torch.Tensor]:
    if (path / "pytorch_model.bin").exists():
        loaded: dict[str, torch.Tensor] = torch.load(path / "pytorch_model.bin", weights_only=True)
        return loaded
    return read_output(path)


# ------------------------------------------------------------------------ SGLang layout


def sglang_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shape of each key SGLang's LlamaForCausalLMEagle3 places, from config.json as
    SGLang builds its modules (q/k/v take embedding ++ hidden state: 2*hidden)."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    fc_in = 3 * config.get("target_hidden_size", h)
    layer = {"self_attn.q_proj.weight": (q, 2 * h), "self_attn.k_proj.weight": (kv, 2 * h),
             "self_attn.v_proj.weight": (kv, 2 * h), "self_attn.o_proj.weight": (h, q),
             "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
             "mlp.down_proj.weight": (h, inter), "input_layernorm.weight": (h,),
             "hidden_norm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    return {**{f"midlayer.{k}": v for k, v in layer.items()},
            "fc.weight": (h, fc_in), "norm.weight": (h,),
            "lm_head.weight": (config["draft_vocab_size"], h),
            "d2t": (config["draft_vocab_size"],), "t2d": (config["vocab_size"],),
            "embed_tokens.weight": (config["vocab_size"], h)}


def sglang_parameter(name: str, params: set[str]) -> str | None:
    """Where LlamaForCausalLMEagle3.load_weights puts checkpoint tensor ``name`` (None:
    silently skipped), mirroring its stacked-parameter mapping and `model.` prefixing."""
    if "d2t" in name or "t2d" in name:
        return "hot_token_id"
    for fused, part in ((".qkv_proj", ".q_proj"), (".qkv_proj", ".k_proj"),
                        (".qkv_proj", ".v_proj"), (".gate_up_proj", ".gate_proj"),
                        (".gate_up_proj", ".up_proj")):
        if part in name:
            name = name.replace(part, fused)
            break
    param = name if name in params else f"model.{name}"
    return param if param in params else None


SGLANG_PARAMS = {"lm_head.weight", "model.embed_tokens.weight", "model.fc.weight", "model.norm.weight",
                 *(f"model.midlayer.{k}" for k in (
                     "self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight",
                     "mlp.down_proj.weight", "input_layernorm.weight", "hidden_norm.weight",
                     "post_attention_layernorm.weight"))}


@pytest.mark.parametrize("name", NATIVE_RULES)
def test_native_output_is_what_sglang_places(name: str, runs: dict[str, Run]) -> None:
    out = runs[name].out
    config = config_of(out)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    tensors = read_output(out)
    assert SGLANG_KEYS <= set(tensors) <= SGLANG_KEYS | {"embed_tokens.weight"}
    want = sglang_shapes(config)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {k: want[k] for k in tensors}
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    placed = {k: sglang_parameter(k, SGLANG_PARAMS) for k in tensors}
    assert None not in placed.values(), placed
    assert SGLANG_PARAMS - set(placed.values()) <= {"model.embed_tokens.weight"}


def test_sglang_mirror_would_notice_a_speculators_key() -> None:
    """Guard on the mirror above: SGLang skips `layers.0.*` without a word."""
    assert sglang_parameter("layers.0.self_attn.q_proj.weight", SGLANG_PARAMS) is None
    assert sglang_parameter("midlayer.self_attn.q_proj.weight", SGLANG_PARAMS) == \
        "model.midlayer.self_attn.qkv_proj.weight"


def test_sglang_variant_changes_only_the_layout(runs: dict[str, Run]) -> None:
    """The extends variant writes the base conversion's tensors under native names."""
    base = read_output(runs["aqmedai_k2_to_k25.yaml"].out)
    native = read_output(runs["aqmedai_k2_to_k25_sglang.yaml"].out)
    renamed = {re.sub(r"^layers\.0\.", "midlayer.", k): v for k, v in base.items()}
    assert sorted(renamed) == sorted(native)
    assert all(same_bits(native[k], v) for k, v in renamed.items())
    config = config_of(runs["aqmedai_k2_to_k25_sglang.yaml"].out)
    assert config["draft_vocab_size"] == native["d2t"].shape[0]
    assert config["vocab_size"] == native["t2d"].shape[0]


SPECULATORS_RULES = ("aqmedai_k2_to_k25.yaml", "eagle3_to_speculators.yaml")


@pytest.mark.parametrize("name", SPECULATORS_RULES)
def test_speculators_config_fits_the_weights(name: str, runs: dict[str, Run]) -> None:
    """What speculators builds from config.json (speculators_model_type, a llama
    transformer_layer_config, draft_vocab_size) has the shapes of the weights written;
    tests/test_consumers.py checks the same with the speculators package itself."""
    out = runs[name].out
    config = config_of(out)
    assert config["architectures"] == ["Eagle3Speculator"]
    assert config["speculators_model_type"] == "eagle3"
    assert config["speculators_config"]["algorithm"] == "eagle3"
    assert config["speculators_config"]["verifier"]["name_or_path"]
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    native = {**layer, "draft_vocab_size": config["draft_vocab_size"],
              **({"target_hidden_size": config["target_hidden_size"]}
                 if config.get("target_hidden_size") else {})}
    want = {re.sub(r"^midlayer\.", "layers.0.", k): v for k, v in sglang_shapes(native).items()}
    aux = config.get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0]
    want["fc.weight"] = (layer["hidden_size"], len(aux) * native.get("target_hidden_size", layer["hidden_size"]))
    tensors = read_output(out)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {k: want[k] for k in tensors}
    assert set(tensors) >= {re.sub(r"^midlayer\.", "layers.0.", k) for k in SGLANG_KEYS}
    floats = {str(v.dtype).removeprefix("torch.") for v in tensors.values() if v.is_floating_point()}
    assert floats == {config["dtype"]}


# ------------------------------------------------------------------------- round trip


#: the native config fields SGLang reads, which must survive native -> speculators -> native
NATIVE_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings",
                 "vocab_size", "draft_vocab_size", "hidden_act", "num_hidden_layers",
                 "tie_word_embeddings", "torch_dtype", "architectures")


def _round_trip(native: Path, root: Path) -> tuple[Path, Path]:
    spec = api.apply(RULES / "eagle3_to_speculators.yaml", out=root / "speculators",
                     sources={"drafter": str(native)}, progress=False).out
    back = api.apply(RULES / "speculators_to_eagle3.yaml", out=root / "native",
                     sources={"drafter": str(spec)}, progress=False).out
    return spec, back


@pytest.mark.parametrize("kind", ["llama-bin", "kimi-safetensors-with-embed"])
def test_round_trip_native_speculators_native_is_byte_identical(kind: str, tmp_path: Path) -> None:
    if kind == "llama-bin":
        native = build_llama_eagle3(tmp_path / "src", seed=8).path
        original = torch.load(native / "pytorch_model.bin", weights_only=True)
    else:
        dims = KIMI_K2_TINY
        native = build_eagle3_drafter(tmp_path / "src", dims,
                                      make_draft_vocab(dims.vocab, dims.draft_vocab, seed=9),
                                      seed=9, include_embed=True).path
        original = load_file(str(native / "model.safetensors"))
    spec, back = _round_trip(native, tmp_path / "first")
    outside_layer = {k for k in read_output(spec) if not k.startswith("layers.0.")}
    assert outside_layer == {k for k in original if not k.startswith("midlayer.")}
    result = read_output(back)
    assert sorted(result) == sorted(original)
    for key, tensor in original.items():
        assert result[key].dtype == tensor.dtype and result[key].shape == tensor.shape, key
        assert torch.equal(bytes_of(result[key]), bytes_of(tensor)), key
    before, after = json.loads((native / "config.json").read_text()), config_of(back)
    assert {f: after.get(f) for f in NATIVE_FIELDS} == {f: before.get(f) for f in NATIVE_FIELDS}
    assert after["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == \
        before["eagle_config"]["eagle_aux_hidden_state_layer_ids"]

    # The stand-in was written by the safetensors library, which orders data by dtype
    # alignment; ckptxform writes in key order, so the first native file's bytes differ
    # from the stand-in's by layout only (compared tensor by tensor above). From there on
    # the round trip is a fixpoint, file for file, byte for byte.
    spec2, back2 = _round_trip(back, tmp_path / "second")
    for first, second in ((spec, spec2), (back, back2)):
        for file in ("model.safetensors", "config.json"):
            assert (first / file).read_bytes() == (second / file).read_bytes(), (first, file)


# ------------------------------------------------------------------------------ strictness


def test_eagle3_to_speculators_refuses_a_key_it_cannot_place(tmp_path: Path) -> None:
    """speculators' own converter drops unknown keys with a log line; the rule refuses."""
    dims = KIMI_K2_TINY
    native = build_eagle3_drafter(tmp_path / "src", dims,
                                  make_draft_vocab(dims.vocab, dims.draft_vocab, seed=1)).path
    tensors = load_file(str(native / "model.safetensors"))
    tensors["midlayer2.self_attn.q_proj.weight"] = tensors["midlayer.self_attn.q_proj.weight"]
    save_file({k: v.clone() for k, v in tensors.items()}, str(native / "model.safetensors"))
    with pytest.raises(PlanError) as err:
        api.plan(RULES / "eagle3_to_speculators.yaml", sources={"drafter": str(native)})
    assert "'midlayer2.self_attn.q_proj.weight'" in str(err.value)
    assert "match no rule" in str(err.value)


def test_speculators_to_eagle3_refuses_a_second_layer(tmp_path: Path) -> None:
    """SGLang's midlayer holds one layer; `layers.1.*` must stop the plan, not vanish."""
    dims = LLAMA31_8B_TINY
    spec = build_eagle3_drafter(tmp_path / "src", dims,
                                make_draft_vocab(dims.vocab, dims.draft_vocab, seed=1),
                                layout="speculators").path
    tensors = load_file(str(spec / "model.safetensors"))
    tensors["layers.1.mlp.up_proj.weight"] = tensors["layers.0.mlp.up_proj.weight"].clone()
    save_file(tensors, str(spec / "model.safetensors"))
    with pytest.raises(PlanError, match=r"'layers\.1\.mlp\.up_proj\.weight'"):
        api.plan(RULES / "speculators_to_eagle3.yaml", sources={"drafter": str(spec)})


def test_eagle3_to_speculators_names_a_missing_config_field(tmp_path: Path) -> None:
    native = build_llama_eagle3(tmp_path / "src").path
    config = json.loads((native / "config.json").read_text())
    del config["head_dim"]
    (native / "config.json").write_text(json.dumps(config))
    with pytest.raises(PlanError, match=r"\$\{config\.head_dim\}.*has no field 'head_dim'"):
        api.plan(RULES / "eagle3_to_speculators.yaml", sources={"drafter": str(native)})


# ---------------------------------------------------------------------------- pruning


def test_prune_selects_lm_head_rows_by_target_id(runs: dict[str, Run]) -> None:
    run = runs["prune_draft_vocab.yaml"]
    full = read_output(Path(run.scenario.sources["drafter"]))["lm_head.weight"]
    vocab = read_output(Path(run.scenario.sources["vocab"]))
    out = read_output(run.out)
    d2t = out["d2t"]
    target = torch.arange(d2t.shape[0]) + d2t  # d2t is an offset
    assert torch.equal(out["lm_head.weight"], full[target])
    assert same_bits(out["d2t"], vocab["d2t"]) and same_bits(out["t2d"], vocab["t2d"])
    assert torch.equal(out["t2d"].nonzero().flatten(), target)
    # The easy bug, indexing by the raw offsets, agrees only where d2t[j] == j (j = 0 here):
    # this test would catch it.
    by_offset = full[d2t]
    agree = (out["lm_head.weight"] == by_offset).all(dim=1)
    assert int(agree.sum()) <= 1 and not torch.equal(out["lm_head.weight"], by_offset)
    assert config_of(run.out)["draft_vocab_size"] == d2t.shape[0]


def test_prune_refuses_a_vocab_map_of_another_vocabulary(tmp_path: Path) -> None:
    dims = KIMI_K2_TINY
    drafter = build_full_vocab_drafter(tmp_path / "full", dims)
    other = dims.scaled(vocab=2 * dims.vocab)
    vocab = build_eagle3_drafter(tmp_path / "vocab", other,
                                 make_draft_vocab(other.vocab, other.draft_vocab, seed=2))
    with pytest.raises(VocabMapError, match="vocab_size"):
        api.plan(RULES / "prune_draft_vocab.yaml",
                 sources={"drafter": str(drafter.path), "vocab": str(vocab.path)})


def test_prune_reads_the_map_from_a_vocab_mapping_file(tmp_path: Path, runs: dict[str, Run]) -> None:
    """`--source vocab=FILE` takes a bare d2t/t2d file (as SpecForge writes) as well."""
    run = runs["prune_draft_vocab.yaml"]
    vocab = read_output(Path(run.scenario.sources["vocab"]))
    mapping = tmp_path / "vocab_mapping.pt"
    torch.save({"d2t": vocab["d2t"], "t2d": vocab["t2d"]}, mapping)
    result = api.apply(RULES / "prune_draft_vocab.yaml", out=tmp_path / "out", progress=False,
                       sources={"drafter": run.scenario.sources["drafter"], "vocab": str(mapping)})
    assert (result.out / "model.safetensors").read_bytes() == \
        (run.out / "model.safetensors").read_bytes()
