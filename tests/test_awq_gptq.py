"""awq_to_bf16, gptq_to_bf16, awq_to_compressed_int4, gptq_to_compressed_int4 without the
reference libraries (tests/test_awq_gptq_reference.py runs those).

- The kernels against the formats' definitions written out element by element (bit shifts
  in Python, one product per element in torch), on scales of each float dtype, GPTQ rows in
  a desc_act order and zero points of 16.
- Block boundaries: a tiny chunk size writes the same bytes.
- The two paths agree: repacking, then compressed_int4_to_bf16, is the direct dequantization.
- Hostile inputs: one error line naming the key and the fix, exit 1, no output, source untouched.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from ckptxform import api
from ckptxform.engine.plan import recipes
from ckptxform.ops.base import Block, InputTensor, Run, View
from ckptxform.ops.dequant_awq_gptq import DequantAwq, DequantGptq
from ckptxform.quant.awq_gptq import AWQ_ORDER, dequant_awq_columns, dequant_gptq_columns
from ckptxform.standins.awq_gptq import build_awq_llama, build_gptq_llama
from conftest import assert_clean_failure, error_lines, read_output, same_bits

RULES = Path(__file__).resolve().parent.parent / "rules"
TORCH = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
Q = "model.layers.0.self_attn.q_proj"
DOWN = "model.layers.0.mlp.down_proj"  # the first module in key order


def _nibble(word: int, i: int) -> int:
    return (word >> (4 * i)) & 0xF


def _awq_by_definition(qw: np.ndarray, qz: np.ndarray, s: torch.Tensor, group: int) -> torch.Tensor:
    rows, words = qw.shape
    q = torch.zeros(rows, words * 8, dtype=torch.int16)
    z = torch.zeros(rows // group, words * 8, dtype=torch.int16)
    for w in range(words):
        for i in range(8):  # nibble i holds column 8w + AWQ_ORDER[i]
            for r in range(rows):
                q[r, 8 * w + AWQ_ORDER[i]] = _nibble(int(qw[r, w]), i)
            for g in range(rows // group):
                z[g, 8 * w + AWQ_ORDER[i]] = _nibble(int(qz[g, w]), i)
    groups = torch.arange(rows) // group
    return (q - z[groups]).to(s.dtype) * s[groups]


def _gptq_by_definition(qw: np.ndarray, qz: np.ndarray, s: torch.Tensor, g_idx: np.ndarray) -> torch.Tensor:
    words, cols = qw.shape
    q = torch.tensor([[_nibble(int(qw[r // 8, c]), r % 8) for c in range(cols)] for r in range(words * 8)],
                     dtype=torch.int16)
    z = torch.tensor([[_nibble(int(qz[g, c // 8]), c % 8) + 1 for c in range(cols)] for g in range(qz.shape[0])],
                     dtype=torch.int16)
    gi = torch.from_numpy(g_idx.astype(np.int64))
    return (q - z[gi]).to(s.dtype) * s[gi]


@pytest.mark.parametrize("scale_dtype", sorted(TORCH))
@pytest.mark.parametrize("out_dtype", ["BF16", "F16", "F32"])
def test_the_kernels_compute_each_format_as_defined(scale_dtype: str, out_dtype: str) -> None:
    rng = np.random.default_rng(len(scale_dtype) + len(out_dtype))
    words = rng.integers(0, 2**32, (48, 3), dtype=np.uint64).astype(np.uint32)
    zeros = rng.integers(0, 2**32, (3, 3), dtype=np.uint64).astype(np.uint32)
    s = (torch.from_numpy(rng.standard_normal((3, 24)).astype(np.float32)) * 0.03).to(TORCH[scale_dtype])
    s[0, 0] = -s[0, 0]  # a negative scale: -0.0 where q == z
    raw = s.view(torch.int16 if scale_dtype != "F32" else torch.int32).numpy().tobytes()
    got = dequant_awq_columns(words.tobytes(), zeros.tobytes(), raw, rows=48, cols=24, group=16,
                              scale_dtype=scale_dtype, out_dtype=out_dtype)
    want = _awq_by_definition(words, zeros, s, 16).to(TORCH[out_dtype]).T.contiguous()  # nn.Linear's [out, in]
    assert bytes(got) == want.view(torch.uint8).numpy().tobytes()
    # GPTQ: 48 rows packed down in 6 words, 24 columns, rows in a desc_act order over 3 groups
    qw = rng.integers(0, 2**32, (6, 24), dtype=np.uint64).astype(np.uint32)
    qz = np.full((3, 3), 0xFFFFFFFF, dtype=np.uint32)  # every stored zero 15: the zero point 16
    qz[1] = rng.integers(0, 2**32, 3, dtype=np.uint64).astype(np.uint32)
    g_idx = rng.permutation(np.arange(48) // 16).astype(np.int32)
    want = _gptq_by_definition(qw, qz, s, g_idx).to(TORCH[out_dtype]).T.contiguous()
    got = dequant_gptq_columns(qw.tobytes(), qz.tobytes(), raw, g_idx.astype(np.int64), rows=48, cols=24,
                               scale_dtype=scale_dtype, out_dtype=out_dtype)
    assert bytes(got) == want.view(torch.uint8).numpy().tobytes()
    # rows in order, whole groups: a group's scale broadcast, not gathered; the same values
    in_order = np.arange(48) // 16
    got = dequant_gptq_columns(qw.tobytes(), qz.tobytes(), raw, 16, rows=48, cols=24, scale_dtype=scale_dtype,
                               out_dtype=out_dtype)
    want = _gptq_by_definition(qw, qz, s, in_order).to(TORCH[out_dtype]).T.contiguous()
    assert bytes(got) == want.view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("stem", ["awq_to_bf16", "gptq_to_bf16", "awq_to_compressed_int4", "gptq_to_compressed_int4"])
def test_small_blocks_write_the_same_bytes(stem: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = (build_awq_llama(tmp_path / "src") if stem.startswith("awq") else
           build_gptq_llama(tmp_path / "src", sym=False, desc_act=stem == "gptq_to_bf16"))
    outs = []
    for chunk in (None, 700):  # 700 bytes: blocks of a few rows, tiles of a few columns
        if chunk is not None:
            monkeypatch.setattr(recipes, "CHUNK_BYTES", chunk)
        api.apply(RULES / f"{stem}.yaml", out=tmp_path / f"out-{chunk}", sources={"model": str(src)})
        outs.append(read_output(tmp_path / f"out-{chunk}"))
    assert sorted(outs[0]) == sorted(outs[1])
    for key in outs[0]:
        assert same_bits(outs[0][key], outs[1][key]), key


def _module_inputs(parts: dict[str, np.ndarray], path: Path | None) -> list[InputTensor]:
    """The parts as a block op reads them: from one local file (``path``), or by byte ranges."""
    out, offset = [], 0
    for array in parts.values():
        raw = array.tobytes()
        view = View(array.shape, {np.dtype("<i4"): "I32", np.dtype("<f2"): "F16"}[array.dtype],
                    (Run(0, 0, len(raw)),))
        out.append(InputTensor(view, lambda start, length, raw=raw: raw[start:start + length],
                               None if path is None else (path, offset)))
        offset += len(raw)
    if path is not None:
        path.write_bytes(b"".join(a.tobytes() for a in parts.values()))
    return out


@pytest.mark.parametrize("local", [False, True])
@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_any_rows_of_the_output_are_those_rows_of_the_whole(fmt: str, local: bool, tmp_path: Path) -> None:
    """A later op may read rows from anywhere (not whole words of 8): the same bytes as the
    whole output's; column bands read from a file as from bytes (bands of 8 columns of 88: a
    pread a run; of 24: the gaps read too, scattered)."""
    rng = np.random.default_rng(7)
    rows, cols, group = 64, 88, 16

    def words(*shape: int) -> np.ndarray:
        return rng.integers(-(2**31), 2**31 - 1, shape, dtype=np.int32)

    scales = rng.uniform(-0.02, 0.02, (rows // group, cols)).astype("<f2")
    if fmt == "awq":
        op, parts = DequantAwq(), {"qweight": words(rows, cols // 8), "qzeros": words(rows // group, cols // 8),
                                   "scales": scales}
        args: dict[str, Any] = {"group": group}
    else:
        g_idx = rng.permutation(np.arange(rows) // group).astype("<i4")
        op, parts = DequantGptq(), {"qweight": words(rows // 8, cols), "qzeros": words(rows // group, cols // 8),
                                    "scales": scales, "g_idx": g_idx}
        args = {"group": group, "groups": rows // group, "g_idx_key": "g_idx", "label": "test"}
    inputs = _module_inputs(parts, tmp_path / "module.bin" if local else None)
    block = Block(op, {**args, "dtype": "BF16", "nonfinite": None}, tuple(i.view for i in inputs), (cols, rows), "BF16")
    whole = b"".join(op.blocks(block, inputs, 24 * rows * 2))
    assert len(whole) == cols * rows * 2
    for lo, hi in [(0, 88), (3, 13), (9, 17), (16, 40), (85, 88)]:
        got = b"".join(op.blocks(block, inputs, 8 * rows * 2, range(lo, hi)))
        assert got == whole[lo * rows * 2:hi * rows * 2], (lo, hi)


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_repacking_then_dequantizing_is_dequantizing(fmt: str, tmp_path: Path) -> None:
    """compressed_int4_to_bf16 rounds in the scales' dtype, then casts, as dequant_awq/gptq do:
    the repacked nibbles must give the same bytes."""
    src = build_awq_llama(tmp_path / "src") if fmt == "awq" else build_gptq_llama(tmp_path / "src", sym=False)
    api.apply(RULES / f"{fmt}_to_bf16.yaml", out=tmp_path / "direct", sources={"model": str(src)})
    api.apply(RULES / f"{fmt}_to_compressed_int4.yaml", out=tmp_path / "ct", sources={"model": str(src)})
    api.apply(RULES / "compressed_int4_to_bf16.yaml", out=tmp_path / "back", sources={"model": str(tmp_path / "ct")})
    direct, back = read_output(tmp_path / "direct"), read_output(tmp_path / "back")
    assert sorted(direct) == sorted(back) and len(direct) == 21
    for key in direct:
        assert same_bits(direct[key], back[key]), key


def _edited(src: Path, dst: Path, *, config: dict[str, Any] | None = None, drop: str | None = None,
            tensors: dict[str, torch.Tensor] | None = None) -> Path:
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"].update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(dst / "model.safetensors"))
    if drop is not None:
        del state[drop]
    state.update(tensors or {})
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _at(stem: str, verb: str) -> str:
    rule = RULES / f"{stem}.yaml"
    line = next(i for i, text in enumerate(rule.read_text().splitlines(), 1) if text.strip().startswith(f"- {verb}"))
    return f"tensors[0].ops[0] {verb} ({rule}:{line}): "


def _cases(awq: Path, gptq: Path, gptq_desc: Path, gptq_asym: Path) -> dict[str, tuple[str, Any, str]]:
    awq_state, gptq_state = load_file(str(awq / "model.safetensors")), load_file(str(gptq / "model.safetensors"))
    bad_g_idx = gptq_state[f"{Q}.g_idx"].clone()
    bad_g_idx[5] = 1000
    full_zeros = torch.full_like(load_file(str(gptq_asym / "model.safetensors"))[f"{Q}.qzeros"], -1)  # stored 15s
    return {
        "awq group size": ("awq_to_bf16", lambda d: _edited(awq, d, config={"group_size": 16}),
                           _at("awq_to_bf16", "dequant_awq") + f"'{DOWN}.qweight': qweight [160, 12], qzeros [5, 12], "
                           "scales [5, 96]: group_size 16 (quantization_config) and qweight [in=160, out/8=12] need "
                           "in a multiple of 16, qzeros [10, 12] and scales [10, 96]; the quantization_config does "
                           "not match the tensors"),
        "awq missing qzeros": ("awq_to_bf16", lambda d: _edited(awq, d, drop=f"{Q}.qzeros"),
                               _at("awq_to_bf16", "dequant_awq") + f"incomplete module: '{Q}.qzeros' is missing "
                               f"beside '{Q}.qweight' (dequant_awq needs qweight, qzeros, scales)"),
        "awq gemv": ("awq_to_bf16", lambda d: _edited(awq, d, config={"version": "gemv"}),
                     _at("awq_to_bf16", "dequant_awq") + "quantization_config.version is 'gemv'; only AutoAWQ's "
                     "'gemm' layout is supported (GEMV, Marlin and ExLlama checkpoints pack otherwise)"),
        "awq scales dtype": ("awq_to_compressed_int4", lambda d: _edited(
            awq, d, tensors={f"{Q}.scales": awq_state[f"{Q}.scales"].to(torch.int16)}),
            _at("awq_to_compressed_int4", "repack_awq") + f"{Q}.scales is I16; repack_awq needs F16 or BF16 or F32"),
        "awq orphan zeros": ("awq_to_compressed_int4", lambda d: _edited(awq, d, drop=f"{Q}.qweight"),
                             None),
        "gptq v2": ("gptq_to_bf16", lambda d: _edited(gptq, d, config={"checkpoint_format": "gptq_v2"}),
                    _at("gptq_to_bf16", "dequant_gptq") + "quantization_config.checkpoint_format is 'gptq_v2'; "
                    "only 'gptq' (v1: zero points stored less one) is supported; save the model in the v1 format"),
        "gptq 8 bits": ("gptq_to_bf16", lambda d: _edited(gptq, d, config={"bits": 8}),
                        _at("gptq_to_bf16", "dequant_gptq") + "quantization_config.bits is 8; only 4-bit "
                        "checkpoints are supported"),
        "gptq g_idx range": ("gptq_to_bf16", lambda d: _edited(gptq, d, tensors={f"{Q}.g_idx": bad_g_idx}),
                             _at("gptq_to_bf16", "dequant_gptq") + f"'{Q}.g_idx'[5] is 1000, but the module has 3 "
                             "groups of scales; the checkpoint is corrupt"),
        "gptq desc_act repack": ("gptq_to_compressed_int4", lambda d: _edited(gptq_desc, d), "desc_act"),
        "gptq zero 16 repack": ("gptq_to_compressed_int4", lambda d: _edited(
            gptq_asym, d, tensors={f"{Q}.qzeros": full_zeros}), "zero point 16"),
    }


CASES = ["awq group size", "awq missing qzeros", "awq gemv", "awq scales dtype", "awq orphan zeros", "gptq v2",
         "gptq 8 bits", "gptq g_idx range", "gptq desc_act repack", "gptq zero 16 repack"]


@pytest.mark.parametrize("case", CASES)
def test_a_source_the_rule_cannot_explain_fails_with_one_line(case: str, tmp_path_factory: Any, run_cli: Any) -> None:
    base = tmp_path_factory.getbasetemp() / "awq-gptq-sources"
    if not base.exists():
        build_awq_llama(base / "awq")
        build_gptq_llama(base / "gptq")
        build_gptq_llama(base / "gptq-desc", desc_act=True)
        build_gptq_llama(base / "gptq-asym", sym=False)
    stem, make, message = _cases(base / "awq", base / "gptq", base / "gptq-desc", base / "gptq-asym")[case]
    root = tmp_path_factory.mktemp("case")
    src = make(root / "src")
    before = sorted((p.name, p.stat().st_mtime_ns) for p in src.iterdir())
    rule = RULES / f"{stem}.yaml"
    proc = run_cli("apply", rule, "--source", f"model={src}", "--out", root / "out")
    assert_clean_failure(proc, 1)
    lines = error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    if case == "awq orphan zeros":
        assert f"model:{Q}.qzeros is consumed" in lines[0] and "no op of the rules read it" in lines[0]
    elif case == "gptq desc_act repack":
        assert lines[0].startswith("error: " + _at(stem, "repack_gptq")) and ".g_idx'[" in lines[0]
        assert "not in group order (desc_act)" in lines[0] and "dequantize with gptq_to_bf16" in lines[0]
    elif case == "gptq zero 16 repack":
        assert lines[0] == "error: " + _at(stem, "repack_gptq") + (
            f"'{Q}.qzeros' stores 15, the zero point 16 (GPTQ v1's offset of one), which compressed-tensors' "
            "int4 zero point (-8..7) cannot hold: dequantize with gptq_to_bf16 instead")
    else:
        assert lines == ["error: " + message]
    assert not (root / "out").exists() and [p.name for p in root.iterdir()] == ["src"]
    assert sorted((p.name, p.stat().st_mtime_ns) for p in src.iterdir()) == before
