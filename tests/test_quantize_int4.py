"""rules/bf16_to_w4a16.yaml and bf16_to_w4a16_asym.yaml (the quantize_w4a16 op) on the engine's
side: every output tensor equal to a torch transcription of compressed-tensors' CPU
arithmetic (calculate_qparams, quantize, pack_to_int32: written out here op for op; the
library itself is the reference of tests/test_w4a16_reference.py), the same bytes whatever
the block size, compressed_int4_to_bf16 reading the output back, and one clear error for
each input the scheme cannot take.

The checkpoint has odd row counts (37, 1), a column count that is a multiple of the group
only (384 = 3 x 128), an all-zero row, ``-0.0`` entries, a group of one sign and a
constant group, beside the tensors the rules keep (embeddings, lm_head, norms).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckptxform import api
from ckptxform.engine.plan import recipes
from ckptxform.errors import CheckpointFormatError, PlanError
from ckptxform.standins.tensors import save_safetensors
from conftest import read_audit, read_output, same_bits

RULES = Path(__file__).resolve().parent.parent / "rules"
STEMS = ("bf16_to_w4a16", "bf16_to_w4a16_asym")
QUANTIZED = ("model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.q_proj.weight",
             "model.layers.0.self_attn.k_proj.weight")


def _weights(seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def spread(rows: int, cols: int) -> torch.Tensor:  # rows of very different magnitudes
        return (torch.randn(rows, cols, generator=g) * torch.exp(torch.randn(rows, 1, generator=g) * 3)).to(dtype)

    down = spread(37, 384)
    down[2] = 0.0                        # an all-zero row: every group's scale is the epsilon
    down[4, :128] = -0.0                 # a group of -0.0
    down[5, ::3] = -0.0
    down[6, 128:256] = torch.rand(128, generator=g).to(dtype)  # one sign only: lo = 0
    down[7, 256:] = 0.5                  # a constant group
    return {
        "model.embed_tokens.weight": spread(300, 256), "lm_head.weight": spread(300, 256),
        "model.layers.0.input_layernorm.weight": torch.ones(256, dtype=dtype),
        "model.layers.0.mlp.down_proj.weight": down,
        "model.layers.0.self_attn.q_proj.weight": spread(128, 256),
        "model.layers.0.self_attn.k_proj.weight": spread(1, 128),  # one row: a zero point word of one row
    }


def _checkpoint(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True)
    save_safetensors(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    return folder


def _pack(values: torch.Tensor) -> torch.Tensor:
    """pack_to_int32 along dim 1 of int ``values`` in -8..7: ``value + 8`` as nibbles, element
    ``8w + k`` in bits ``4k..`` of word ``w``, a short last word padded with zero nibbles."""
    rows, cols = values.shape
    nibbles = torch.zeros(rows, -(-cols // 8) * 8, dtype=torch.int64)
    nibbles[:, :cols] = values.to(torch.int64) + 8
    words = (nibbles.view(rows, -1, 8) << (4 * torch.arange(8))).sum(-1)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # the same 32 bits, as a signed int32


def qparams(w: torch.Tensor, symmetric: bool, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """calculate_qparams of each group of ``w`` (static min-max): the scale in ``w``'s dtype and
    the zero point (int8: zeros when symmetric)."""
    groups = w.unflatten(-1, (-1, group))
    lo = torch.min(groups.amin(-1), torch.zeros(1, dtype=w.dtype))
    hi = torch.max(groups.amax(-1), torch.zeros(1, dtype=w.dtype))
    if symmetric:
        scale = torch.max(lo.abs(), hi) / torch.tensor(7.5, dtype=w.dtype)
        zp = torch.zeros(scale.shape, dtype=torch.int8)
    else:
        scale = (hi - lo) / torch.tensor(15.0, dtype=w.dtype)
        zp = torch.clamp(torch.tensor(-8.0) - lo / scale, -8, 7)
        zp = torch.round(zp.nan_to_num(0.0)).to(torch.int8)  # a zero group: 0 / 0, which the int8 cast makes 0
    return torch.where(scale == 0, torch.tensor(torch.finfo(w.dtype).eps, dtype=w.dtype), scale), zp


def codes(w: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, group: int = 128) -> torch.Tensor:
    """quantize: ``round(clamp(x / scale + zp, -8, 7))``, each step in ``w``'s dtype."""
    scaled = w.unflatten(-1, (-1, group)) / scale[..., None] + zp.to(w.dtype)[..., None]
    return torch.round(torch.clamp(scaled, -8, 7)).flatten(-2)


def transcription(w: torch.Tensor, symmetric: bool, group: int = 128) -> dict[str, torch.Tensor]:
    """compressed-tensors 0.20's W4A16 (W4A16_ASYM) compressed state of ``w``."""
    scale, zp = qparams(w, symmetric, group)
    out = {"weight_packed": _pack(codes(w, scale, zp, group)), "weight_scale": scale,
           "weight_shape": torch.tensor(w.shape)}
    if not symmetric:
        out["weight_zero_point"] = _pack(zp.T).T.contiguous()
    return out


def channel_rule(folder: Path, symmetric: bool) -> Path:
    """The shipped W4A16 rule with one scale (and zero point) per row: strategy channel, the
    config group named as llm-compressor names a scheme it is given as an object."""
    stem = "bf16_to_w4a16" if symmetric else "bf16_to_w4a16_asym"
    text = (RULES / f"{stem}.yaml").read_text()
    for old, new in [("          group_size: 128\n", "          strategy: channel\n"),
                     ("weights: {dynamic: false, group_size: 128, num_bits: 4, strategy: group,",
                      "weights: {dynamic: false, group_size: null, num_bits: 4, strategy: channel,"),
                     ("        W4A16_ASYM:\n" if not symmetric else "        W4A16:\n", "        config_group_0:\n")]:
        assert old in text
        text = text.replace(old, new)
    rule = folder / f"{stem}_channel.yaml"
    rule.write_text(text)
    return rule


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("int4") / "model", _weights())


@pytest.mark.parametrize("stem", STEMS)
def test_every_tensor_is_compressed_tensors_arithmetic_whatever_the_block(stem: str, source: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    weights = _weights()
    symmetric = stem == "bf16_to_w4a16"
    want: dict[str, torch.Tensor] = {k: v for k, v in weights.items() if k not in QUANTIZED}
    for key in QUANTIZED:
        want.update({f"{key.rpartition('.')[0]}.{part}": t for part, t in transcription(weights[key], symmetric).items()})
    outs = []
    for chunk in (None, 3000):  # 3000 bytes: tasks of 3 rows of down_proj, 8 rows for its zero points
        if chunk is not None:
            monkeypatch.setattr(recipes, "CHUNK_BYTES", chunk)
        out = tmp_path / f"out-{chunk}"
        api.apply(RULES / f"{stem}.yaml", out=out, sources={"model": str(source)}, progress=False)
        got = read_output(out)
        assert sorted(got) == sorted(want)
        bad = sorted(k for k in want if not same_bits(got[k], want[k]))
        assert not bad, f"differ: {bad}"
        outs.append((out / "model.safetensors").read_bytes())
    assert outs[0] == outs[1]
    config = json.loads((tmp_path / "out-None" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized" and [g["weights"]["symmetric"] for g in
                                                     config["config_groups"].values()] == [symmetric]
    reasons = {r["key"]: r["reason"] for r in read_audit(tmp_path / "out-None") if r["event"] == "tensor"}
    assert "ignore entry 're:.*lm_head$' names 'lm_head'" in reasons["lm_head.weight"]
    assert "is a norm" in reasons["model.layers.0.input_layernorm.weight"]


@pytest.mark.parametrize("stem", STEMS)
def test_compressed_int4_to_bf16_reads_the_output_back(stem: str, source: Path, tmp_path: Path) -> None:
    """Dequantized: ``(q - zp) * scale`` in the scale's dtype, as compressed-tensors' dequantize."""
    weights = _weights()
    api.apply(RULES / f"{stem}.yaml", out=tmp_path / "q", sources={"model": str(source)}, progress=False)
    api.apply(RULES / "compressed_int4_to_bf16.yaml", out=tmp_path / "back", sources={"model": str(tmp_path / "q")},
              progress=False)
    back = read_output(tmp_path / "back")
    assert sorted(back) == sorted(weights)
    for key in QUANTIZED:
        w = weights[key]
        scale, zp = qparams(w, stem == "bf16_to_w4a16")
        q = codes(w, scale, zp).to(torch.int8).to(w.dtype).unflatten(-1, (-1, 128))  # unpacked ints: no -0.0
        want = ((q - zp.to(w.dtype)[..., None]) * scale[..., None]).flatten(-2)
        assert same_bits(back[key], want), key
    assert same_bits(back["lm_head.weight"], weights["lm_head.weight"])


def test_a_row_of_partial_groups_is_a_plan_error_naming_the_key(tmp_path: Path) -> None:
    src = _checkpoint(tmp_path / "model", {"m.o_proj.weight": torch.ones(4, 200, dtype=torch.bfloat16)})
    with pytest.raises(PlanError, match=r"'m\.o_proj\.weight' has 200 columns: quantize_w4a16 scales groups of "
                                        r"128 .* add 'm\.o_proj' to ignore"):
        api.plan(RULES / "bf16_to_w4a16.yaml", sources={"model": str(src)}).close()


def test_a_config_that_says_another_group_size_is_a_plan_error(tmp_path: Path) -> None:
    src = _checkpoint(tmp_path / "model", {"m.o_proj.weight": torch.ones(4, 256, dtype=torch.bfloat16)})
    text = (RULES / "bf16_to_w4a16.yaml").read_text()
    rule = tmp_path / "g32.yaml"
    rule.write_text(text.replace("weights: {dynamic: false, group_size: 128,", "weights: {dynamic: false, group_size: 32,"))
    with pytest.raises(PlanError, match=r"writes int4 with \{'strategy': 'group', 'group_size': 128, 'symmetric': "
                                        r"True\}, but quantization_config\.config_groups\.W4A16\.weights says "
                                        r"\{'strategy': 'group', 'group_size': 32, 'symmetric': True\}; make them "
                                        r"agree"):
        api.plan(rule, sources={"model": str(src)}).close()


def test_an_asymmetric_rule_must_name_the_zero_point(tmp_path: Path) -> None:
    src = _checkpoint(tmp_path / "model", {"m.o_proj.weight": torch.ones(4, 256, dtype=torch.bfloat16)})
    text = (RULES / "bf16_to_w4a16_asym.yaml").read_text().replace(",weight_shape,weight_zero_point}", ",weight_shape}")
    rule = tmp_path / "asym.yaml"
    rule.write_text(text)
    with pytest.raises(PlanError, match=r"'to' must enumerate T with the parts it writes: "
                                        r"\{T:weight,weight_packed,weight_scale,weight_shape,weight_zero_point\}"):
        api.plan(rule, sources={"model": str(src)}).close()


def test_a_nan_weight_is_an_error_naming_the_tensor(tmp_path: Path) -> None:
    w = torch.ones(9, 128, dtype=torch.bfloat16)
    w[8, 5] = float("nan")
    src = _checkpoint(tmp_path / "model", {"m.o_proj.weight": w})
    with pytest.raises(CheckpointFormatError, match=r"'m\.o_proj\.weight' holds NaN or infinite values"):
        api.apply(RULES / "bf16_to_w4a16_asym.yaml", out=tmp_path / "out", sources={"model": str(src)},
                  progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_channel_wise_is_one_group_a_row_and_reads_back(symmetric: bool, source: Path, tmp_path: Path) -> None:
    weights = _weights()
    api.apply(channel_rule(tmp_path, symmetric), out=tmp_path / "q", sources={"model": str(source)}, progress=False)
    got = read_output(tmp_path / "q")
    for key in QUANTIZED:
        w = weights[key]
        for part, want in transcription(w, symmetric, group=w.shape[1]).items():
            assert same_bits(got[f"{key.rpartition('.')[0]}.{part}"], want), (key, part)
    api.apply(RULES / "compressed_int4_to_bf16.yaml", out=tmp_path / "back", sources={"model": str(tmp_path / "q")},
              progress=False)
    back = read_output(tmp_path / "back")
    for key in QUANTIZED:
        w = weights[key]
        scale, zp = qparams(w, symmetric, w.shape[1])
        q = codes(w, scale, zp, w.shape[1]).to(torch.int8).to(w.dtype)
        assert same_bits(back[key], (q - zp.to(w.dtype)) * scale), key
