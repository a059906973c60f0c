"""GGUF as a source (sources/gguf.py), its decoders (quant/gguf_blocks.py, quant/gguf_fast.py)
and rules/gguf_to_hf.yaml, without transformers: the reference is gguf-py itself (llama.cpp's
Python library, which transformers' GGUF loader calls), on files gguf-py wrote.
tests/test_gguf_reference.py checks the rule against transformers' from_pretrained.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import read_output

from ckptxform import api
from ckptxform.errors import CheckpointFormatError, SourceNotFoundError
from ckptxform.quant.gguf_blocks import decodable, dequant_gguf_bytes
from ckptxform.quant.gguf_fast import FAST
from ckptxform.sources.gguf import open_gguf
from ckptxform.standins.gguf_models import GgufDims, build_llama_gguf, random_blocks

gguf = pytest.importorskip("gguf")
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader  # noqa: E402
from gguf.quants import _type_traits, dequantize, quantize  # noqa: E402

RULE = Path(__file__).resolve().parents[1] / "rules" / "gguf_to_hf.yaml"
#: every block format gguf-py dequantizes
FORMATS = sorted(t.name for t in _type_traits)


def _blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """``[rows, cols]`` values as ``kind`` blocks: gguf-py's quantizer where it has one, else
    random blocks with finite scales."""
    values = (np.random.default_rng(seed).standard_normal((rows, cols)) * 0.3).astype(np.float32)
    try:
        return quantize(values, GGMLQuantizationType[kind])
    except NotImplementedError:
        return random_blocks(kind, rows, cols, seed)


@pytest.mark.parametrize("kind", FORMATS)
def test_every_format_decodes_as_gguf_py_does(kind: str) -> None:
    values = GGML_QUANT_SIZES[GGMLQuantizationType[kind]][0]
    blocks = _blocks(kind, 5, values * 3, seed=len(kind))
    want = dequantize(blocks, GGMLQuantizationType[kind]).reshape(-1)
    got = dequant_gguf_bytes(blocks.tobytes(), kind)
    assert decodable(kind)
    assert got.dtype == np.float32 and got.view(np.uint32).tolist() == want.view(np.uint32).tolist()


@pytest.mark.parametrize("kind", sorted(FAST))
@pytest.mark.parametrize("source", ["quantized", "random"])
def test_fast_kernels_match_gguf_py_on_any_bytes(kind: str, source: str) -> None:
    """The numpy kernels against gguf-py on gguf-py's own blocks and on random bytes whose
    scales are anything (NaN, inf, subnormal float16): the same bits."""
    size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1]
    gen = np.random.default_rng(3)
    blocks = (_blocks(kind, 7, 512, seed=4).reshape(-1, size) if source == "quantized"
              else gen.integers(0, 256, (4096, size), dtype=np.uint8))
    want = dequantize(blocks, GGMLQuantizationType[kind]).reshape(-1)
    got = FAST[kind](blocks).reshape(-1)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_plain_types_widen_like_gguf_py() -> None:
    halves = np.random.default_rng(1).integers(0, 2**16, 999, dtype=np.uint16)  # NaNs and infs too
    for kind in ("F16", "BF16"):
        want = dequantize(halves.view(np.uint8), GGMLQuantizationType[kind])
        assert np.array_equal(dequant_gguf_bytes(halves.tobytes(), kind).view(np.uint32), want.view(np.uint32))


def test_a_file_indexes_as_gguf_py_reads_it(tmp_path: Path) -> None:
    path = build_llama_gguf(tmp_path / "m.gguf", qtype="Q4_K")
    reader = GGUFReader(path)
    with open_gguf(path) as ckpt:
        assert list(ckpt.tensors) == [t.name for t in sorted(reader.tensors, key=lambda t: t.data_offset)]
        for t in reader.tensors:
            info = ckpt.tensors[t.name]
            assert (info.offset, info.nbytes) == (t.data_offset, t.n_bytes)
            assert ckpt.ggml_types[t.name] == t.tensor_type.name
            assert ckpt.logical_shapes[t.name] == tuple(reversed(t.shape.tolist()))
            assert ckpt.read(info, info.row_nbytes, info.row_nbytes) == t.data.tobytes()[info.row_nbytes:2 * info.row_nbytes]
        config = ckpt.config()
        assert config["llama"]["attention"]["head_count_kv"] == 2 and config["general"]["architecture"] == "llama"
        assert ckpt.ggml_types["blk.0.ffn_down.weight"] == "F16"  # 528 columns: no whole Q4_K block


def test_a_split_set_is_one_checkpoint(tmp_path: Path) -> None:
    whole = build_llama_gguf(tmp_path / "one" / "m.gguf", qtype="Q8_0")
    first = build_llama_gguf(tmp_path / "split" / "m.gguf", qtype="Q8_0", split_max_tensors=8)
    assert first.name == "m-00001-of-00003.gguf"
    with open_gguf(whole) as one, open_gguf(first) as split, open_gguf(first.parent) as folder:
        assert len(split.files) == 3 and folder.files == split.files
        assert set(one.tensors) == set(split.tensors)
        for key, info in one.tensors.items():
            assert one.read(info) == split.read(split.tensors[key])
    (first.parent / "m-00002-of-00003.gguf").unlink()
    with pytest.raises(SourceNotFoundError, match="m-00002-of-00003.gguf is not beside it"):
        open_gguf(first)


def test_a_truncated_file_is_one_clear_error(tmp_path: Path) -> None:
    path = build_llama_gguf(tmp_path / "m.gguf", qtype="Q8_0")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 4096])
    with pytest.raises(CheckpointFormatError, match="truncated"):
        open_gguf(path)
    path.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(CheckpointFormatError, match="not a readable GGUF file"):
        open_gguf(path)


def test_inspect_shows_types_and_metadata(tmp_path: Path) -> None:
    path = build_llama_gguf(tmp_path / "m.gguf", qtype="Q6_K")
    run = subprocess.run([sys.executable, "-m", "ckptxform", "inspect", str(path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert ": GGUF (llama.cpp)" in run.stdout
    assert "blk.0.attn_q.weight" in run.stdout and "Q6_K  [192, 256]" in run.stdout
    assert "llama.rope.dimension_count = 48" in run.stdout
    as_json = json.loads(subprocess.run([sys.executable, "-m", "ckptxform", "inspect", "--json", str(path)],
                                        capture_output=True, text=True, check=True).stdout)
    q = next(t for t in as_json["tensors"] if t["key"] == "blk.0.attn_q.weight")
    assert q["ggml_type"] == "Q6_K" and q["values_shape"] == [192, 256] and q["dtype"] == "U8"


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """transformers' reverse_permute_weights, written out."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "IQ4_XS"])
def test_rule_gives_gguf_py_values_in_hf_layout(tmp_path: Path, kind: str) -> None:
    dims = GgufDims(hidden=256, heads=8, kv_heads=2, head_dim=40, intermediate=288, layers=1, vocab=96)
    path = build_llama_gguf(tmp_path / "m.gguf", qtype=kind, dims=dims, seed=5)
    out = api.apply(str(RULE), out=tmp_path / "hf", sources={"model": str(path)}, progress=False).out
    got = read_output(out)
    reader = GGUFReader(path)
    names = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
             "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
             "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
             "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight"}
    for t in reader.tensors:
        if t.name not in names:
            continue
        want = dequantize(t.data, t.tensor_type)
        if t.name == "blk.0.attn_q.weight":
            want = _unpermute(want, dims.heads)
        if t.name == "blk.0.attn_k.weight":
            want = _unpermute(want, dims.kv_heads)
        ours = got[names[t.name]].numpy()
        assert ours.dtype == np.float32 and np.array_equal(ours.view(np.uint32), want.view(np.uint32)), t.name
    config = json.loads((out / "config.json").read_text())
    assert (config["head_dim"], config["num_key_value_heads"], config["intermediate_size"]) == (40, 2, 288)


def test_bands_of_rows_make_the_whole_tensor() -> None:
    """dequant_gguf's program over any rows, in bands of a few rows, gives the same bytes as
    one decode of the whole tensor (bounded memory: each band reads its own rows only)."""
    from ckptxform.ops.base import Block, InputTensor, Run, View
    from ckptxform.ops.dequant_gguf import DequantGguf

    blocks = _blocks("Q4_K", 37, 512, seed=9)
    data = blocks.tobytes()
    reads: list[int] = []

    def read(start: int, length: int) -> bytes:
        reads.append(length)
        return data[start:start + length]

    view = View((37, blocks.shape[1]), "U8", (Run(0, 0, len(data)),))
    block = Block(DequantGguf(), {"type": "Q4_K", "dtype": "F32"}, (view,), (37, 512), "F32")
    whole = dequant_gguf_bytes(data, "Q4_K").tobytes()
    got = b"".join(bytes(b) for b in DequantGguf().blocks(block, [InputTensor(view, read)], chunk_bytes=3 * 2048))
    assert got == whole and max(reads) == 3 * blocks.shape[1]
    part = b"".join(bytes(b) for b in DequantGguf().blocks(block, [InputTensor(view, read)], 4096, rows=range(5, 11)))
    assert part == whole[5 * 2048:11 * 2048]


def test_the_audit_says_the_tokenizer_is_not_carried(tmp_path: Path) -> None:
    """A GGUF with tokenizer metadata: one ``metadata`` record naming its tokenizer.* keys,
    ``not carried``; one without: none."""
    from conftest import read_audit

    from ckptxform.standins.gguf_models import QWEN2_GGUF

    qwen = build_llama_gguf(tmp_path / "q.gguf", qtype="Q8_0", arch="qwen2", dims=QWEN2_GGUF, tied=True)
    out = api.apply(str(RULE.with_name("gguf_qwen2_to_hf.yaml")), out=tmp_path / "hf", sources={"model": str(qwen)},
                    progress=False).out
    (note,) = [e for e in read_audit(out) if e["event"] == "metadata"]
    assert note["source"] == "model" and note["action"] == "not carried"
    assert note["keys"] == ["tokenizer.ggml.model", "tokenizer.ggml.tokens"] and "AutoTokenizer" in note["reason"]
    llama = build_llama_gguf(tmp_path / "l.gguf", qtype="Q8_0")
    out = api.apply(str(RULE), out=tmp_path / "hf2", sources={"model": str(llama)}, progress=False).out
    assert not [e for e in read_audit(out) if e["event"] == "metadata"]
