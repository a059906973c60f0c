"""bf16_to_w4a16 and bf16_to_w4a16_asym against the libraries whose output they reproduce.

- The kernels (quant/int4_quantize.py) against compressed-tensors' own ``calculate_qparams``
  and ``PackedQuantizationCompressor.compress`` (which runs its ``quantize`` and
  ``pack_to_int32``), on BF16, F16 and F32 weights, groups of 128 and 32, odd row counts,
  all-zero rows and groups, ``-0.0``, groups of one sign and constant groups.
- Each rule's output against llm-compressor 0.14's ``model_free_ptq`` (scheme W4A16 or
  W4A16_ASYM, the rule's ignore list, on the CPU), byte for byte with config.json's
  quantization_config, on a tiny LlamaForCausalLM built by transformers (GQA, head_dim not
  hidden/heads) and on a bare checkpoint with odd row counts (1, 37, 129 rows: a zero point
  word of fewer than 8 rows) and columns that are a multiple of the group only.
- The same for strategy channel (one scale and zero point per row, no preset: the scheme
  given to model_free_ptq as an object), sym and asym.
- compressed-tensors' decompress of the output equals compressed_int4_to_bf16's, and
  transformers (with compressed-tensors) loads the W4A16 output with no missing or unexpected
  key (not W4A16_ASYM: transformers refuses llm-compressor's own output of that scheme).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptxform import api
from conftest import assert_same_checkpoint, read_output, same_bits

pytestmark = pytest.mark.reference
transformers = pytest.importorskip("transformers", reason="the reference extra (transformers) is not installed")
pytest.importorskip("compressed_tensors", reason="the reference extra (compressed-tensors) is not installed")

RULES = Path(__file__).resolve().parent.parent / "rules"
SCHEMES = {"bf16_to_w4a16": "W4A16", "bf16_to_w4a16_asym": "W4A16_ASYM"}
TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def _edges(w: torch.Tensor, group: int, g: torch.Generator) -> torch.Tensor:
    """Plant the values whose rounding or packing is easy to get wrong."""
    rows = w.shape[0]
    w[0, :group] = 0.0                                          # an all-zero group
    if rows > 8:
        w[2] = 0.0                                              # an all-zero row
        w[3, :group] = -0.0                                     # a group of -0.0
        w[4, ::3] = -0.0
        w[5, :group] = torch.rand(group, generator=g).to(w.dtype)  # one sign: lo = 0
        w[6, :group] = -torch.rand(group, generator=g).to(w.dtype)  # the other: hi = 0
        w[7, :group] = 0.5                                      # constant
    return w


def _spread(rows: int, cols: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return (torch.randn(rows, cols, generator=g) * torch.exp(torch.randn(rows, 1, generator=g) * 3)).to(dtype)


@pytest.mark.parametrize("dtype", sorted(TORCH_DTYPES))
@pytest.mark.parametrize("group", [128, 32])
@pytest.mark.parametrize("scheme", sorted(SCHEMES.values()))
def test_kernels_are_compressed_tensors_quantize_and_pack(scheme: str, group: int, dtype: str) -> None:
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    from ckptxform.quant.int4_quantize import int4_rows, int4_scale_rows, int4_zero_point_rows

    spec = preset_name_to_scheme(scheme, ["Linear"])
    spec.weights.group_size = group
    symmetric = scheme == "W4A16"
    for rows in (1, 13, 37, 64):
        g = torch.Generator().manual_seed(rows * group)
        cols = group * 3
        w = _edges(_spread(rows, cols, TORCH_DTYPES[dtype], g), group, g)
        groups = w.unflatten(-1, (-1, group))
        scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), spec.weights)
        want = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp},
                                                     spec)
        raw = w.contiguous().view(torch.uint8).numpy().tobytes()
        got = {"weight_packed": int4_rows(raw, dtype, cols, group, symmetric),
               "weight_scale": int4_scale_rows(raw, dtype, cols, group, symmetric)}
        if not symmetric:
            got["weight_zero_point"] = int4_zero_point_rows(raw, dtype, cols, group)
        assert set(want) == {*got, "weight_shape"}
        for part, data in got.items():
            assert data == want[part].contiguous().view(torch.uint8).numpy().tobytes(), (rows, part)


def _llama(folder: Path) -> Path:
    torch.manual_seed(3)
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=96,
                                      vocab_size=301, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():  # a spread of magnitudes, not only init's small ones
            p.mul_(torch.exp(torch.randn(p.shape[0], *([1] * (p.dim() - 1)), generator=g) * 2))
        _edges(model.model.layers[0].mlp.down_proj.weight.data, 128, g)
        model.model.layers[1].self_attn.o_proj.weight[:, :128] = 0.0
    model.save_pretrained(folder)
    return folder


def _bare(folder: Path) -> Path:
    """Odd row counts, columns that are a multiple of the group only, under keys the rules target."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(5)
    shapes = {"model.layers.0.mlp.down_proj.weight": (37, 384), "model.layers.0.mlp.up_proj.weight": (129, 256),
              "model.layers.0.self_attn.k_proj.weight": (1, 640), "model.layers.0.self_attn.q_proj.weight": (13, 128),
              "model.embed_tokens.weight": (301, 128), "lm_head.weight": (301, 128)}
    tensors = {k: _edges(_spread(*shape, torch.bfloat16, g), 128, g) for k, shape in shapes.items()}
    tensors["model.norm.weight"] = torch.ones(128, dtype=torch.bfloat16)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    return folder


@pytest.fixture(scope="module", params=["llama", "bare"])
def model_dir(request: Any, tmp_path_factory: Any) -> Path:
    folder = tmp_path_factory.mktemp("bf16") / request.param
    return _llama(folder) if request.param == "llama" else _bare(folder)


def _ignore(stem: str) -> list[str]:
    import yaml

    return yaml.safe_load((RULES / f"{stem}.yaml").read_text())["config"]["set"]["quantization_config"]["ignore"]


_OUTPUTS: dict[tuple[str, Path], Path] = {}


def _ours(stem: str, model_dir: Path, out: Path) -> Path:
    if (stem, model_dir) not in _OUTPUTS:
        api.apply(RULES / f"{stem}.yaml", out=out, sources={"model": str(model_dir)}, progress=False)
        _OUTPUTS[stem, model_dir] = out
    return _OUTPUTS[stem, model_dir]


@pytest.mark.parametrize("stem", sorted(SCHEMES))
def test_output_is_llm_compressors_model_free_output(stem: str, model_dir: Path, tmp_path: Path) -> None:
    model_free = pytest.importorskip("llmcompressor.entrypoints.model_free",
                                     reason="llm-compressor (installed --no-deps) is not installed")
    theirs = tmp_path / "theirs"
    model_free.model_free_ptq(str(model_dir), str(theirs), scheme=SCHEMES[stem], ignore=_ignore(stem),
                              max_workers=1, device="cpu")
    ours = _ours(stem, model_dir, tmp_path / "ours")
    assert_same_checkpoint(ours, theirs)


@pytest.mark.parametrize("stem", sorted(SCHEMES))
def test_compressed_int4_to_bf16_equals_compressed_tensors_decompress(stem: str, model_dir: Path,
                                                                      tmp_path: Path) -> None:
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    quantized = _ours(stem, model_dir, tmp_path / "quantized")
    api.apply(RULES / "compressed_int4_to_bf16.yaml", out=tmp_path / "back", sources={"model": str(quantized)},
              progress=False)
    back, tensors = read_output(tmp_path / "back"), read_output(quantized)
    scheme = preset_name_to_scheme(SCHEMES[stem], ["Linear"])
    modules = {k.rpartition(".")[0] for k in tensors if k.endswith(".weight_packed")}
    assert modules
    for m in sorted(modules):
        state = {p: tensors[f"{m}.{p}"] for p in ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
                 if f"{m}.{p}" in tensors}
        zp = state.get("weight_zero_point")
        if zp is not None and zp.shape[0] == 1:
            # compressed-tensors 0.20 unpacks it transposed, then views the words as bytes, which
            # torch refuses for a [groups, 1] transpose (its last stride is the row's length):
            # the same words with the strides of a column make its view legal, no value changed
            state["weight_zero_point"] = zp.as_strided(zp.shape, (1, 1))
        assert same_bits(back[f"{m}.weight"], PackedQuantizationCompressor.decompress(state, scheme)["weight"]), m


def test_transformers_loads_the_output_with_no_missing_or_unexpected_keys(tmp_path_factory: Any) -> None:
    """W4A16 only: transformers 5.23 with compressed-tensors 0.20 refuses llm-compressor's own
    W4A16_ASYM output (it expects the zero point unpacked, [rows, groups], where the checkpoint
    holds it packed, [rows / 8, groups]); the asymmetric rule is held to byte equality with that
    output instead (test_output_is_llm_compressors_model_free_output)."""
    stem = "bf16_to_w4a16"
    model_dir = _llama(tmp_path_factory.mktemp("load") / "llama")
    out = _ours(stem, model_dir, tmp_path_factory.mktemp("ours") / "out")
    _, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_channel_wise_is_llm_compressors_and_reads_back_as_compressed_tensors_decompresses(
        symmetric: bool, model_dir: Path, tmp_path: Path) -> None:
    """strategy channel (one scale, and zero point, per row): no preset names it, so the scheme
    is given to model_free_ptq as an object; compressed_int4_to_bf16 reads it back."""
    model_free = pytest.importorskip("llmcompressor.entrypoints.model_free",
                                     reason="llm-compressor (installed --no-deps) is not installed")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from test_quantize_int4 import channel_rule

    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=4, type="int",
                                                                            symmetric=symmetric, strategy="channel"))
    model_free.model_free_ptq(str(model_dir), str(tmp_path / "theirs"), scheme=scheme,
                              ignore=_ignore("bf16_to_w4a16"), max_workers=1, device="cpu")
    api.apply(channel_rule(tmp_path, symmetric), out=tmp_path / "ours", sources={"model": str(model_dir)},
              progress=False)
    assert_same_checkpoint(tmp_path / "ours", tmp_path / "theirs")
    got = read_output(tmp_path / "ours")
    api.apply(RULES / "compressed_int4_to_bf16.yaml", out=tmp_path / "back", sources={"model": str(tmp_path / "ours")},
              progress=False)
    back = read_output(tmp_path / "back")
    for m in sorted({k.rpartition(".")[0] for k in got if k.endswith(".weight_packed")}):
        state = {p: got[f"{m}.{p}"] for p in ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
                 if f"{m}.{p}" in got}
        zp = state.get("weight_zero_point")
        if zp is not None and zp.shape[0] == 1:  # see test_compressed_int4_to_bf16_equals_compressed_tensors_decompress
            state["weight_zero_point"] = zp.as_strided(zp.shape, (1, 1))
        assert same_bits(back[f"{m}.weight"], PackedQuantizationCompressor.decompress(state, scheme)["weight"]), m
