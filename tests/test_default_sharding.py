"""Issue 35 item 8: without ``output.max_shard_size`` or ``output.shards`` the output is
sharded as the converted source is (engine/plan/layout_follow.py): a 3-file source gives 3
files named as save_pretrained names them, each holding what was made from its source
file; a one-file or non-HF source is packed as save_pretrained packs (one file here).
transformers loads the sharded output as it is."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import file_keys, read_output, source_args
from safetensors.numpy import save_file

from ckptxform import api

#: source file -> its tensors (key -> shape), a Llama-shaped model in 3 shards
_FILES = {
    "model-00001-of-00003.safetensors": {"model.embed_tokens.weight": (32, 8),
                                         "model.layers.0.self_attn.q_proj.weight": (8, 8)},
    "model-00002-of-00003.safetensors": {"model.layers.0.mlp.down_proj.weight": (8, 16),
                                         "model.layers.1.self_attn.q_proj.weight": (8, 8)},
    "model-00003-of-00003.safetensors": {"model.layers.1.mlp.down_proj.weight": (8, 16),
                                         "model.norm.weight": (8,), "lm_head.weight": (32, 8)},
}

_RULE = """version: 1
name: rename-and-fill
sources:
  model: {path: unused}
convert: model
tensors:
  - match: 'model\\.(.*)'
    rename: 'backbone.\\1'
  - match: 'lm_head\\.weight'
    cast: float32
add:
  backbone.extra.bias: {fill: 0, shape: [8], dtype: bfloat16}
"""


def _source(root: Path, files: dict[str, dict[str, tuple[int, ...]]]) -> Path:
    root.mkdir()
    rng = np.random.default_rng(5)
    weight_map = {}
    for file, tensors in files.items():
        save_file({k: rng.standard_normal(shape).astype(np.float16) for k, shape in tensors.items()},
                  str(root / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    if len(files) > 1:
        (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps({"architectures": ["X"], "model_type": "x"}))
    return root


def _rule(tmp_path: Path, output: str = "") -> Path:
    path = tmp_path / "rule.yaml"
    path.write_text(_RULE + output)
    return path


def test_output_follows_the_source_files(tmp_path: Path) -> None:
    src = _source(tmp_path / "src", _FILES)
    out = tmp_path / "out"
    api.apply(_rule(tmp_path), out=out, sources={"model": str(src)}, progress=False)
    names = [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert sorted(p.name for p in out.glob("*.safetensors")) == names
    for name, theirs in zip(names, _FILES.values(), strict=True):
        expected = {("backbone." + k[len("model."):]) if k.startswith("model.") else k for k in theirs}
        if name == names[-1]:
            expected.add("backbone.extra.bias")  # a constant: the last file
        assert set(file_keys(out / name)) == expected, name
    assert file_keys(out / names[-1])["lm_head.weight"] == ([32, 8], "F32")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(names)
    written = read_output(out)
    original = {k: v for file in _FILES for k, v in _load(src / file).items()}
    np.testing.assert_array_equal(written["backbone.layers.1.mlp.down_proj.weight"],
                                  original["model.layers.1.mlp.down_proj.weight"])


def test_plan_lists_the_files_it_will_write(tmp_path: Path, run_cli) -> None:
    src = _source(tmp_path / "src", _FILES)
    proc = run_cli("plan", _rule(tmp_path), *source_args({"model": str(src)}))
    assert proc.returncode == 0, proc.stderr
    for k in (1, 2, 3):
        assert f"model-0000{k}-of-00003.safetensors" in proc.stdout


def test_a_source_file_nothing_comes_from_has_no_file(tmp_path: Path) -> None:
    src = _source(tmp_path / "src", _FILES)
    rule = tmp_path / "only.yaml"
    rule.write_text("""version: 1
name: first-and-last
sources:
  model: {path: unused}
convert: model
tensors:
  - match: 'model\\.embed_tokens\\.weight|model\\.layers\\.1\\.mlp\\..*|model\\.norm\\.weight|lm_head\\.weight'
  - match: '.*'
    skip: 'not part of this output'
""")
    out = tmp_path / "out"
    api.apply(rule, out=out, sources={"model": str(src)}, progress=False)
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    assert sorted(p.name for p in out.glob("*.safetensors")) == [first, second]
    assert set(file_keys(out / first)) == {"model.embed_tokens.weight"}
    assert set(file_keys(out / second)) == set(_FILES["model-00003-of-00003.safetensors"])


def test_a_one_file_source_gives_one_file(tmp_path: Path) -> None:
    merged = {k: v for tensors in _FILES.values() for k, v in tensors.items()}
    src = _source(tmp_path / "src", {"model.safetensors": merged})
    out = tmp_path / "out"
    api.apply(_rule(tmp_path), out=out, sources={"model": str(src)}, progress=False)
    assert [p.name for p in out.glob("*.safetensors")] == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists()


def test_max_shard_size_packs_instead(tmp_path: Path) -> None:
    src = _source(tmp_path / "src", _FILES)
    assert _written(tmp_path, src, "output: {max_shard_size: 1GB}\n", "one")[1] == ["model.safetensors"]
    out, names = _written(tmp_path, src, "output: {max_shard_size: 1000}\n", "packed")
    sizes = [_data_sizes(out / name) for name in names]
    assert len(names) > 1 and names[0] == f"model-00001-of-{len(names):05d}.safetensors"
    for here, after in zip(sizes, [*sizes[1:], None], strict=True):
        assert sum(here) <= 1000 or len(here) == 1  # only a tensor over the limit is alone over it
        if after is not None:
            assert sum(here) + after[0] > 1000  # greedy: the next file's first did not fit


def test_a_file_name_alone_names_the_one_file(tmp_path: Path) -> None:
    """What a rule that names its file (deepseek_nextn_extract, hf_llama_to_meta) writes."""
    src = _source(tmp_path / "src", _FILES)
    out, names = _written(tmp_path, src, "output: {file_name: nextn.safetensors}\n", "out")
    assert names == ["nextn.safetensors"]
    assert len(file_keys(out / "nextn.safetensors")) == 8


def _written(tmp_path: Path, src: Path, output: str, name: str) -> tuple[Path, list[str]]:
    """Apply the rule with ``output`` to ``src`` into ``tmp_path / name``: it and its files, sorted."""
    out = tmp_path / name
    api.apply(_rule(tmp_path, output), out=out, sources={"model": str(src)}, progress=False)
    return out, sorted(p.name for p in out.glob("*.safetensors"))


def _data_sizes(path: Path) -> list[int]:
    """Each tensor's data bytes in ``path``, in file order."""
    with path.open("rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    spans = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    return [end - start for start, end in spans]


def test_transformers_loads_the_sharded_output(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=96, hidden_size=16, intermediate_size=24, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    src = tmp_path / "src"
    model.save_pretrained(src, max_shard_size="8KB")  # several files
    assert (src / "model.safetensors.index.json").exists()
    rule = tmp_path / "keep.yaml"
    rule.write_text("version: 1\nname: keep\nsources:\n  model: {path: unused}\nconvert: model\n"
                    "tensors:\n  - match: '.*'\nconfig: {from: model}\n")
    out = tmp_path / "out"
    api.apply(rule, out=out, sources={"model": str(src)}, progress=False)
    ours = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    theirs = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    assert ours == theirs  # save_pretrained's names, each tensor in the file it was in
    loaded = transformers.LlamaForCausalLM.from_pretrained(out)
    for name, tensor in model.state_dict().items():
        assert loaded.state_dict()[name].equal(tensor), name


def _load(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path))
