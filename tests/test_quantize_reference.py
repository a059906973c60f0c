"""The bf16_to_* quantize rules against the libraries whose output they reproduce.

On tiny random LlamaForCausalLM models built here by transformers (GQA, widths that leave
partial 128x128 blocks, several seeds, and one model with the edge values planted: an
all-zero block, an all-zero row, an all-zero fused gate/up set, -0.0 entries), each rule's
output must be, byte for byte and including config.json's quantization_config:

- what llm-compressor 0.14's ``model_free_ptq`` writes for the matching preset (FP8_BLOCK,
  FP8_DYNAMIC, NVFP4A16) with the same ignore list on the CPU (that release hands
  ``save_file`` a non-contiguous view for a partial-block FP8_BLOCK weight and fails: the
  test makes its tensors contiguous, which changes no byte);
- what compressed-tensors' own calculate_qparams + compressor give for each weight (the
  global scale of NVFP4 from the fused q/k/v and gate/up sets);

and transformers loads it with no missing or unexpected keys. compressed-tensors'
decompress of our output must equal the project's dequant rule for the format, where that
rule is shipped (``test_followup_*``: the fp8-nvfp4 helper writes them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ckptxform import api

pytestmark = pytest.mark.reference
transformers = pytest.importorskip("transformers", reason="the reference extra (transformers) is not installed")
pytest.importorskip("compressed_tensors", reason="the reference extra (compressed-tensors) is not installed")

RULES = Path(__file__).resolve().parent.parent / "rules"
#: rule stem -> llm-compressor / compressed-tensors preset
SCHEMES = {"bf16_to_fp8_block": "FP8_BLOCK", "bf16_to_fp8_dynamic": "FP8_DYNAMIC", "bf16_to_nvfp4": "NVFP4A16"}
#: (hidden, intermediate, heads, kv heads, seed, plant edge values)
MODELS = [(208, 400, 4, 2, 0, True), (144, 272, 3, 1, 1, False), (208, 400, 4, 2, 2, False)]
FUSED = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


def _ignore(stem: str) -> list[str]:
    import yaml

    return yaml.safe_load((RULES / f"{stem}.yaml").read_text())["config"]["set"]["quantization_config"]["ignore"]


@pytest.fixture(scope="module", params=MODELS, ids=lambda m: f"h{m[0]}-i{m[1]}-kv{m[3]}-seed{m[4]}")
def model_dir(request: Any, tmp_path_factory: Any) -> Path:
    hidden, inter, heads, kv, seed, plant = request.param
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads,
                                      vocab_size=300, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():  # a spread of magnitudes, not only init's small ones
            p.mul_(torch.exp(torch.randn(p.shape[0], *([1] * (p.dim() - 1))) * 2))
        if plant:
            layer = model.model.layers[0]
            layer.self_attn.q_proj.weight[:128, :128] = 0.0        # a zero block: the scale's epsilon
            layer.self_attn.o_proj.weight[5] = 0.0                 # a zero row (per-channel)
            layer.self_attn.k_proj.weight[3, :16] = -0.0           # a zero NVFP4 group of -0.0
            layer.mlp.down_proj.weight[7, ::3] = -0.0
            model.model.layers[1].mlp.gate_proj.weight.zero_()    # a zero fused set: global scale 1.0
            model.model.layers[1].mlp.up_proj.weight.zero_()
    out = tmp_path_factory.mktemp("bf16") / "model"
    model.save_pretrained(out)
    return out


_OUTPUTS: dict[tuple[str, Path], Path] = {}


def _ours(stem: str, model_dir: Path, out: Path) -> Path:
    """The rule's output for ``model_dir`` (made once per rule and model: the tests only read it)."""
    if (stem, model_dir) not in _OUTPUTS:
        api.apply(RULES / f"{stem}.yaml", out=out, sources={"model": str(model_dir)}, progress=False)
        _OUTPUTS[stem, model_dir] = out
    return _OUTPUTS[stem, model_dir]


def _llm_compressor(stem: str, model_dir: Path, out: Path, monkeypatch: Any) -> Path:
    model_free = pytest.importorskip("llmcompressor.entrypoints.model_free",
                                     reason="llm-compressor (installed --no-deps) is not installed")
    save = model_free.save_file
    monkeypatch.setattr(model_free, "save_file",
                        lambda tensors, path, *a, **k: save({n: t.contiguous() for n, t in tensors.items()}, path, *a, **k))
    model_free.model_free_ptq(str(model_dir), str(out), scheme=SCHEMES[stem], ignore=_ignore(stem),
                              max_workers=1, device="cpu")
    return out


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    bad = [k for k in want if got[k].dtype != want[k].dtype or got[k].shape != want[k].shape
           or _bits(got[k]) != _bits(want[k])]
    assert not bad, f"{len(bad)} tensors differ, first {bad[:3]}"


@pytest.mark.parametrize("stem", sorted(SCHEMES))
def test_output_is_llm_compressors_model_free_output(stem: str, model_dir: Path, tmp_path: Path,
                                                     monkeypatch: Any) -> None:
    ours = _ours(stem, model_dir, tmp_path / "ours")
    theirs = _llm_compressor(stem, model_dir, tmp_path / "theirs", monkeypatch)
    _same(_tensors(ours), _tensors(theirs))
    mine, ref = (json.loads((d / "config.json").read_text()) for d in (ours, theirs))
    assert mine["quantization_config"] == ref["quantization_config"]
    assert mine == ref


def _ct_expected(scheme_name: str, weights: dict[str, torch.Tensor], ignore: list[str]) -> dict[str, torch.Tensor]:
    """Every weight compressed by compressed-tensors' own calculate_qparams and compressor."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    from compressed_tensors.utils import match_quantizable_tensors

    scheme = preset_name_to_scheme(scheme_name, ["Linear"])
    args = scheme.weights
    out = dict(weights)
    for module, name in match_quantizable_tensors(weights, ignore, ["Linear"]):
        w = out.pop(name)
        if scheme_name == "NVFP4A16":
            kind, _, proj = module.rpartition(".")
            prefix, _, block = kind.rpartition(".")
            members = next((ms for b, ms in FUSED if b == block and proj in ms), (proj,))
            fused = torch.cat([weights[f"{kind}.{m}.weight"] for m in members])
            glob = generate_gparam(-fused.abs().amax().reshape(1), fused.abs().amax().reshape(1))
            groups = w.unflatten(-1, (-1, 16))
            scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=glob)
            state = NVFP4PackedCompressor.compress(
                {"weight": w, "weight_scale": scale, "weight_global_scale": glob}, scheme)
        else:
            if scheme_name == "FP8_BLOCK":
                rows, cols = w.shape
                padded = torch.nn.functional.pad(w, (0, -cols % 128, 0, -rows % 128))
                blocks = padded.unflatten(0, (-1, 128)).unflatten(2, (-1, 128))
                lo, hi = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
            else:
                lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
            scale, _ = calculate_qparams(lo, hi, args)
            state = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
        out.update({f"{module}.{k}": v for k, v in state.items()})
    return out


@pytest.mark.parametrize("stem", sorted(SCHEMES))
def test_output_is_what_compressed_tensors_computes(stem: str, model_dir: Path, tmp_path: Path) -> None:
    want = _ct_expected(SCHEMES[stem], _tensors(model_dir), _ignore(stem))
    _same(_tensors(_ours(stem, model_dir, tmp_path / "ours")), want)


@pytest.mark.parametrize("stem", sorted(SCHEMES))
def test_transformers_loads_the_output_with_no_missing_or_unexpected_keys(stem: str, model_dir: Path,
                                                                          tmp_path: Path) -> None:
    out = _ours(stem, model_dir, tmp_path / "ours")
    _, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info


def _decompressed(stem: str, folder: Path) -> dict[str, torch.Tensor]:
    """compressed-tensors' decompress of every quantized module of ``folder``."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme(SCHEMES[stem], ["Linear"])
    compressor = NVFP4PackedCompressor if stem == "bf16_to_nvfp4" else FloatQuantizationCompressor
    tensors = _tensors(folder)
    parts = ("weight_packed", "weight_global_scale") if stem == "bf16_to_nvfp4" else ("weight",)
    modules = {k.rpartition(".")[0] for k in tensors if k.endswith(".weight_scale")}
    out = {k: v for k, v in tensors.items() if k.rpartition(".")[0] not in modules}
    for m in modules:
        state = {p: tensors[f"{m}.{p}"] for p in (*parts, "weight_scale")}
        out[f"{m}.weight"] = compressor.decompress(state, scheme)["weight"]
    return out


#: the project's dequant rule for each format (the fp8-nvfp4 helper's; None: none planned)
DEQUANT_RULES = {"bf16_to_fp8_block": "fp8_to_bf16", "bf16_to_fp8_dynamic": "fp8_to_bf16",
                 "bf16_to_nvfp4": "nvfp4_to_bf16"}


@pytest.mark.parametrize("stem", sorted(SCHEMES))
def test_followup_project_dequant_equals_compressed_tensors_decompress(stem: str, model_dir: Path,
                                                                      tmp_path: Path) -> None:
    rule = RULES / f"{DEQUANT_RULES[stem]}.yaml"
    if not rule.is_file():
        pytest.skip(f"follow-up for the lead: rules/{rule.name} (the fp8-nvfp4 helper's dequant rule) is not on "
                    "this branch; compressed-tensors' decompress of the output is checked by the other tests")
    quantized = _ours(stem, model_dir, tmp_path / "quantized")
    back = _tensors(_ours(DEQUANT_RULES[stem], quantized, tmp_path / "back"))
    _same(back, _decompressed(stem, quantized))
