"""The structural rule library against transformers, the real library (issue 13 item 6).

Every rule runs (``ckptxform apply``) on tiny random models that transformers built and
saved (tests/reference_models.py), twice over: the LIBRARY cases, and the UNSEEN cases
with other sizes, seeds and dtypes that no other test builds. For each case:
- transformers loads the output with no missing, unexpected or mis-shaped key;
- the output is byte for byte what transformers writes for that layout: for MoE, what
  transformers itself makes of the legacy files (``save_pretrained(save_original_format=
  False)``); for every layout a transformers class holds, what it saves back after loading
  our output;
- the converted model computes the source model's logits (the source run by
  transformers; Meta layouts by a reference forward written from Meta's definition);
- ``ckptxform invert`` of the rule gives the reverse, and the round trip is
  byte-identical to the source.
Odd sizes throughout: hidden 20/28/36 (not a power of two), 3 or 5 experts, 5 heads with
1 kv head, GQA, sharded sources, float32 and bfloat16, .safetensors and .pth; the
qwen2_moe-family rule on Qwen2-MoE (shared expert, a dense layer), Qwen3-MoE (no shared
expert, q/k norms) and DeepSeek-V3 (MLA, shared experts, n_routed_experts).

transformers is the optional ``reference`` extra: these tests are marked ``reference``
and skip with a message when it is missing (CI runs them in their own step).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO
from reference_models import (
    Built,
    Dims,
    build_gpt2,
    build_hf,
    build_meta,
    gpt2_with_linear_layers,
    load_strict,
    logits,
    meta_forward,
    meta_keys,
    read_tensors,
    save_tokenizer,
    tensor_bytes,
    transformers_fused,
)

from ckptxform import api

INSTALL = 'pip install torch==2.13.0 -e ".[test,reference]"   # see .ci/run'

pytestmark = [
    pytest.mark.reference,
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                       reason=f"transformers is not installed; to run the reference tests: {INSTALL}"),
]

RULES = REPO / "rules"
MOE_CLASSES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


@dataclass(frozen=True)
class Case:
    """One rule on one tiny model. ``output_class``: the transformers class that holds the
    output layout (None: Meta layout or GPT-2 with Linear layers); ``fused``: the MoE
    family whose fused layout transformers writes itself."""

    id: str
    rule: str
    build: Callable[[Path], Built]
    output_class: str | None
    source_class: str | None
    fused: str | None = None


def _hf(family: str, dims: Dims, seed: int, **options: Any) -> Callable[[Path], Built]:
    return lambda root: build_hf(root, family, dims, seed=seed, **options)


def _tied_llama(dims: Dims, seed: int, **options: Any) -> Callable[[Path], Built]:
    return lambda root: build_hf(root, "llama", dims, seed=seed, tie_word_embeddings=True,
                                 **options)


def _untied_copy(dims: Dims, seed: int, **options: Any) -> Callable[[Path], Built]:
    """An untied Llama whose lm_head.weight is a copy of the embedding (what untie writes,
    or a tied model saved by a tool that writes both)."""

    def build(root: Path) -> Built:
        built = build_hf(root / "tied", "llama", dims, seed=seed, tie_word_embeddings=True,
                         **options)
        model = built.model
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
        model.save_pretrained(root / "untied")
        save_tokenizer(root / "untied", dims.vocab)
        return Built(root / "untied", model)

    return build


def _meta(seed: int, **options: Any) -> Callable[[Path], Built]:
    return lambda root: build_meta(root, seed=seed, **options)


def _gpt2(seed: int, **options: Any) -> Callable[[Path], Built]:
    return lambda root: build_gpt2(root, seed=seed, **options)


LLAMA = "LlamaForCausalLM"

LIBRARY = (
    Case("mixtral-3-experts-gqa-sharded", "mixtral_legacy_to_fused.yaml",
         _hf("mixtral", Dims(hidden=24, heads=4, kv_heads=2, experts=3), 1, shard_size="20KB"),
         "MixtralForCausalLM", "MixtralForCausalLM", fused="mixtral"),
    Case("qwen2-moe-shared-expert-dense-layer", "qwen2_moe_legacy_to_fused.yaml",
         _hf("qwen2_moe", Dims(hidden=20, heads=5, kv_heads=1, intermediate=24, experts=5,
                                shared=16), 2, mlp_only_layers=[0]),
         "Qwen2MoeForCausalLM", "Qwen2MoeForCausalLM", fused="qwen2_moe"),
    Case("qwen3-moe-qk-norm-sharded", "qwen2_moe_legacy_to_fused.yaml",
         _hf("qwen3_moe", Dims(hidden=24, heads=4, kv_heads=2, head_dim=8, experts=3), 3,
              shard_size="16KB"),
         "Qwen3MoeForCausalLM", "Qwen3MoeForCausalLM", fused="qwen3_moe"),
    Case("phi3-5-heads-1-kv-sharded", "phi3_to_llama.yaml",
         _hf("phi3", Dims(hidden=20, heads=5, kv_heads=1, intermediate=28), 4,
              shard_size="8KB"),
         LLAMA, "Phi3ForCausalLM"),
    Case("gpt2-5-heads", "gpt2_conv1d_to_linear.yaml",
         _gpt2(5, hidden=20, heads=5, layers=2, vocab=50), None, "GPT2LMHeadModel"),
    Case("untie-llama-5-heads-1-kv", "untie_embeddings.yaml",
         _tied_llama(Dims(hidden=20, heads=5, kv_heads=1, layers=1), 6), LLAMA, LLAMA),
    Case("tie-llama-gqa", "tie_embeddings.yaml",
         _untied_copy(Dims(hidden=24, heads=4, kv_heads=2, layers=1), 7), LLAMA, LLAMA),
    Case("meta-gqa-safetensors", "meta_llama_to_hf.yaml",
         _meta(8, dim=24, n_heads=4, n_kv_heads=2, n_layers=2, vocab=50), LLAMA, None),
    Case("hf-llama-gqa-to-meta", "hf_llama_to_meta.yaml",
         _hf("llama", Dims(hidden=24, heads=4, kv_heads=2, intermediate=72), 9), None, LLAMA),
)

#: other sizes, seeds and dtypes than LIBRARY: the rules must not fit only the models above
UNSEEN = (
    Case("unseen-mixtral-5-experts-bf16", "mixtral_legacy_to_fused.yaml",
         _hf("mixtral", Dims(hidden=20, heads=5, kv_heads=1, layers=1, intermediate=12,
                              experts=5), 21, dtype=torch.bfloat16),
         "MixtralForCausalLM", "MixtralForCausalLM", fused="mixtral"),
    Case("unseen-qwen2-moe-sharded-bf16", "qwen2_moe_legacy_to_fused.yaml",
         _hf("qwen2_moe", Dims(hidden=28, heads=7, kv_heads=7, layers=2, intermediate=16,
                                experts=3, shared=12), 22, shard_size="12KB",
              dtype=torch.bfloat16),
         "Qwen2MoeForCausalLM", "Qwen2MoeForCausalLM", fused="qwen2_moe"),
    Case("unseen-qwen3-moe-5-heads", "qwen2_moe_legacy_to_fused.yaml",
         _hf("qwen3_moe", Dims(hidden=20, heads=5, kv_heads=1, layers=1, head_dim=6,
                                intermediate=16, experts=5), 23),
         "Qwen3MoeForCausalLM", "Qwen3MoeForCausalLM", fused="qwen3_moe"),
    Case("unseen-deepseek-v3-shared-experts-dense-first", "qwen2_moe_legacy_to_fused.yaml",
         _hf("deepseek_v3", Dims(hidden=24, heads=4, kv_heads=4, layers=2, intermediate=20,
                                 experts=5), 30),
         "DeepseekV3ForCausalLM", "DeepseekV3ForCausalLM", fused="deepseek_v3"),
    Case("unseen-phi3-gqa-bf16", "phi3_to_llama.yaml",
         _hf("phi3", Dims(hidden=36, heads=6, kv_heads=2, layers=1, intermediate=40), 24,
              dtype=torch.bfloat16),
         LLAMA, "Phi3ForCausalLM"),
    Case("unseen-gpt2-3-layers", "gpt2_conv1d_to_linear.yaml",
         _gpt2(25, hidden=12, heads=3, layers=3, vocab=60), None, "GPT2LMHeadModel"),
    Case("unseen-untie-bf16", "untie_embeddings.yaml",
         _tied_llama(Dims(hidden=28, heads=7, kv_heads=1, layers=2), 26, dtype=torch.bfloat16),
         LLAMA, LLAMA),
    Case("unseen-tie-5-heads", "tie_embeddings.yaml",
         _untied_copy(Dims(hidden=20, heads=5, kv_heads=1, layers=2), 27), LLAMA, LLAMA),
    Case("unseen-meta-pth-5-heads-1-kv", "meta_llama_to_hf.yaml",
         _meta(28, dim=20, n_heads=5, n_kv_heads=1, n_layers=1, vocab=60,
               file_name="consolidated.00.pth", ffn_dim_multiplier=None), LLAMA, None),
    Case("unseen-hf-llama-5-heads-to-meta", "hf_llama_to_meta.yaml",
         _hf("llama", Dims(hidden=20, heads=5, kv_heads=1, layers=2, intermediate=56), 29,
              shard_size="12KB"), None, LLAMA),
)

CASES = LIBRARY + UNSEEN


@dataclass(frozen=True)
class Run:
    case: Case
    source: Built
    out: Path
    root: Path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Case], Run]:
    """Each case's source built and its rule applied once, on first use (read-only)."""
    done: dict[str, Run] = {}

    def get(case: Case) -> Run:
        if case.id not in done:
            root = tmp_path_factory.mktemp(case.id)
            source = case.build(root / "source")
            result = api.apply(RULES / case.rule, out=root / "out",
                               sources={"model": str(source.path)}, progress=False)
            assert result.plan.warnings == ()
            done[case.id] = Run(case, source, result.out, root)
        return done[case.id]

    return get


def invert(rule: Path, dest: Path, over: Path) -> Path:
    """``ckptxform invert RULE --over OUT`` as a user runs it, its output saved to ``dest``
    as it is. (A rule with a catch-all inverts only over the keys a run wrote: kept keys
    could look like its renamed ones.)"""
    done = subprocess.run([sys.executable, "-m", "ckptxform", "invert", str(rule), "--over", str(over)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert "write the inverse's config section by hand" not in done.stdout, done.stdout
    dest.write_text(done.stdout)
    return dest


def _output_model(run: Run) -> Any:
    assert run.case.output_class is not None
    return load_strict(run.case.output_class, run.out)


def _output_logits(run: Run) -> torch.Tensor:
    if run.case.output_class is not None:
        return logits(_output_model(run))
    if run.case.rule == "hf_llama_to_meta.yaml":
        params = json.loads((run.out / "params.json").read_text())
        state = read_tensors(run.out)
        assert set(state) == meta_keys(params["n_layers"])  # what Meta's model loads, no more
        return meta_forward(state, params)
    # GPT-2 with Linear layers: transformers' GPT-2 forward on our state dict
    model = gpt2_with_linear_layers(run.source.model.config)
    problems = model.transformer.load_state_dict(read_tensors(run.out), strict=False)
    assert not problems.missing_keys and not problems.unexpected_keys, problems
    return logits(model)


def _source_logits(run: Run) -> torch.Tensor:
    if run.source.model is None:  # a Meta checkpoint
        return meta_forward(read_tensors(run.source.path), run.source.params)
    return logits(run.source.model)


@pytest.mark.parametrize("case", [c for c in CASES if c.output_class], ids=lambda c: c.id)
def test_transformers_loads_the_output_and_saves_it_back_unchanged(case: Case, runs: Callable[[Case], Run],
                                                                   tmp_path: Path) -> None:
    run = runs(case)
    model = _output_model(run)  # no missing, unexpected or mis-shaped key
    model.save_pretrained(tmp_path / "saved", save_original_format=False)
    assert tensor_bytes(tmp_path / "saved") == tensor_bytes(run.out)


@pytest.mark.parametrize("case", [c for c in CASES if c.fused], ids=lambda c: c.id)
def test_fused_moe_is_what_transformers_writes_from_the_legacy_files(case: Case, runs: Callable[[Case], Run],
                                                                     tmp_path: Path) -> None:
    run = runs(case)
    expected = transformers_fused(run.source.path, tmp_path / "transformers", case.fused)  # type: ignore[arg-type]
    assert tensor_bytes(run.out) == tensor_bytes(expected)
    assert json.loads((run.out / "config.json").read_text()) == json.loads(
        (run.source.path / "config.json").read_text())


@pytest.mark.parametrize("case", [c for c in CASES if c.fused], ids=lambda c: c.id)
def test_inverse_writes_what_save_pretrained_of_the_fused_model_writes(case: Case, runs: Callable[[Case], Run],
                                                                       tmp_path: Path) -> None:
    """fused -> legacy: the inverse rule run on transformers' own fused files gives what
    ``save_pretrained()`` (legacy layout, the default) writes for the fused model in
    memory. (A model loaded from fused files is saved fused again: transformers reverses
    only the conversions it applied while loading.)"""
    run = runs(case)
    fused = transformers_fused(run.source.path, tmp_path / "fused", case.fused)  # type: ignore[arg-type]
    legacy = tmp_path / "legacy"
    run.source.model.save_pretrained(legacy)
    inverse = invert(RULES / case.rule, tmp_path / "inverse.yaml", run.out)
    api.apply(inverse, out=tmp_path / "ours", sources={"model": str(fused)}, progress=False)
    assert tensor_bytes(tmp_path / "ours") == tensor_bytes(legacy)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_converted_model_computes_the_source_logits(case: Case, runs: Callable[[Case], Run]) -> None:
    run = runs(case)
    expected, got = _source_logits(run), _output_logits(run)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_inverse_round_trip_is_byte_identical(case: Case, runs: Callable[[Case], Run], tmp_path: Path) -> None:
    run = runs(case)
    inverse = invert(RULES / case.rule, tmp_path / "inverse.yaml", run.out)
    api.apply(inverse, out=tmp_path / "back", sources={"model": str(run.out)}, progress=False)
    source, back = tensor_bytes(run.source.path), tensor_bytes(tmp_path / "back")
    if case.rule == "gpt2_conv1d_to_linear.yaml":
        # The causal-mask buffers are skipped (not weights): the only tensors not restored.
        dropped = {k for k in source if k.endswith(".attn.bias")}
        assert dropped and set(source) - set(back) == dropped
        source = {k: v for k, v in source.items() if k not in dropped}
    assert back == source
    if case.source_class is not None:
        load_strict(case.source_class, tmp_path / "back")


def test_cases_cover_every_structural_rule() -> None:
    from reference_models import STRUCTURAL_RULES

    assert {c.rule for c in LIBRARY} == {c.rule for c in UNSEEN} == set(STRUCTURAL_RULES)
    assert {c.fused for c in CASES} >= set(MOE_CLASSES)


def test_transformers_is_5x() -> None:
    """The fused MoE layout and save_original_format are transformers 5.x behaviour."""
    import transformers

    assert transformers.__version__.startswith("5."), transformers.__version__


def test_the_engine_never_imports_transformers(runs: Callable[[Case], Run], tmp_path: Path) -> None:
    """transformers is the tests' reference only: a structural apply and invert in a fresh
    interpreter leave it unimported."""
    run = runs(LIBRARY[0])
    script = (
        "import sys\n"
        "from ckptxform import api\n"
        "from ckptxform.cli import main\n"
        f"api.apply({str(RULES / run.case.rule)!r}, out={str(tmp_path / 'out')!r},\n"
        f"          sources={{'model': {str(run.source.path)!r}}}, progress=False)\n"
        "try:\n"
        f"    main(['invert', {str(RULES / run.case.rule)!r}, '--over', {str(tmp_path / 'out')!r}])\n"
        "except SystemExit as done:\n"
        "    assert not done.code, done.code\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_meta_output_writes_params_json_and_verifies(runs: Callable[[Case], Run], tmp_path: Path) -> None:
    """hf_llama_to_meta writes its config as params.json (output.config_file), and
    ``ckptxform verify`` checks that file, not a config.json."""
    from ckptxform.errors import VerifyError
    from ckptxform.engine.output.verify import verify

    run = runs(LIBRARY[-1])
    assert sorted(p.name for p in run.out.iterdir() if p.suffix != ".jsonl") == [
        "consolidated.safetensors", "params.json"]
    params = json.loads((run.out / "params.json").read_text())
    config = run.source.model.config
    assert params == {"dim": config.hidden_size, "n_layers": config.num_hidden_layers,
                      "n_heads": config.num_attention_heads,
                      "n_kv_heads": config.num_key_value_heads, "vocab_size": config.vocab_size,
                      "norm_eps": config.rms_norm_eps,
                      "rope_theta": config.rope_parameters["rope_theta"],
                      "hidden_dim": config.intermediate_size,
                      "multiple_of": config.intermediate_size, "ffn_dim_multiplier": None}
    assert verify(run.out).tensors == len(read_tensors(run.out))
    edited = shutil.copytree(run.out, tmp_path / "edited")
    (edited / "params.json").write_text(json.dumps(params | {"n_kv_heads": 1}))
    with pytest.raises(VerifyError, match=r"params\.json: changed after apply"):
        verify(edited)
    # An earlier Meta output is ckptxform's own (params.json included): --force replaces it.
    again = api.apply(RULES / run.case.rule, out=edited, sources={"model": str(run.source.path)},
                      force=True, progress=False)
    assert (again.out / "params.json").read_text() == (run.out / "params.json").read_text()


#: rules that convert a whole HF model, so their output must be servable as it is
CARRY_FILES = ("mixtral_legacy_to_fused.yaml", "qwen2_moe_legacy_to_fused.yaml", "phi3_to_llama.yaml",
               "gpt2_conv1d_to_linear.yaml", "untie_embeddings.yaml", "tie_embeddings.yaml")
SERVING_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json")


@pytest.mark.parametrize("case", [c for c in CASES if c.rule in CARRY_FILES], ids=lambda c: c.id)
def test_whole_model_output_carries_tokenizer_chat_template_and_generation_config(
        case: Case, runs: Callable[[Case], Run]) -> None:
    import transformers

    run = runs(case)
    present = [name for name in SERVING_FILES if (run.source.path / name).exists()]
    assert present[:3] == list(SERVING_FILES[:3])
    for name in present:
        assert (run.out / name).read_bytes() == (run.source.path / name).read_bytes(), name
    chat = [{"role": "user", "content": "t4 t9"}]
    ours, theirs = (transformers.AutoTokenizer.from_pretrained(p) for p in (run.out, run.source.path))
    assert ours.apply_chat_template(chat, tokenize=True) == theirs.apply_chat_template(chat, tokenize=True)
