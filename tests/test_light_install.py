"""The light install: with torch absent, byte-level rules, casts, mean fills and FP8
dequantization run on numpy, and what needs torch is one line naming the extra.

Each case runs ``ckptxform`` in a subprocess whose imports of torch fail, so the file
passes in a venv with torch and in CI's venv without it (``-m notorch``). The expected
values are computed here with numpy, independently of ckptxform's code.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

pytestmark = pytest.mark.notorch

# torch's import fails in the child, as where it is not installed
NO_TORCH = textwrap.dedent("""\
    import importlib.abc, sys
    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r}")
    sys.meta_path.insert(0, NoTorch())
    from ckptxform.cli import main
    sys.argv = ["ckptxform", *sys.argv[1:]]
    main()
    """)


def ckptxform(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", NO_TORCH, *args], capture_output=True, text=True, timeout=300)


def apply(tmp_path: Path, body: str, config: dict | None = None) -> subprocess.CompletedProcess[str]:
    (tmp_path / "src").mkdir(exist_ok=True)
    (tmp_path / "src" / "config.json").write_text(json.dumps(config or {"model_type": "llama"}))
    rule = tmp_path / "rules.yaml"
    rule.write_text("version: 1\nsources:\n  model: {path: src}\nconvert: model\n" + textwrap.dedent(body))
    return ckptxform("-q", "apply", str(rule), f"--source=model={tmp_path / 'src'}", "--out", str(tmp_path / "out"))


def write_raw(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """A safetensors file from raw bytes (numpy has no fp8 dtype to hand to save_file)."""
    header, offset = {}, 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(t[2] for t in tensors.values()))


def read_raw(path: Path, name: str) -> bytes:
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    start, end = json.loads(raw[8:8 + size])[name]["data_offsets"]
    return raw[8 + size + start:8 + size + end]


def test_byte_level_rule_cast_and_mean_fill_without_torch(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((5, 4), dtype=np.float32)
    gate, up = rng.standard_normal((3, 4), dtype=np.float32), rng.standard_normal((3, 4), dtype=np.float32)
    (tmp_path / "src").mkdir()
    save_file({"emb": emb, "gate": gate, "up": up, "norm": rng.standard_normal(9, dtype=np.float32)},
              str(tmp_path / "src" / "model.safetensors"))
    done = apply(tmp_path, """\
        tensors:
          - key: emb
            to: model.embed_tokens.weight
            ops: [{resize_rows: {rows: 7, fill: mean}}]
          - key: '{P:gate,up}'
            to: gate_up
            ops: [{concat: {over: P, dim: 0}}, {transpose: [0, 1]}]
          - key: norm
            cast: bfloat16
        """)
    assert done.returncode == 0, done.stderr
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    mean = (emb.astype(np.float64).sum(0) / 5).astype(np.float32)
    assert got["model.embed_tokens.weight"].tobytes() == np.concatenate([emb, mean[None], mean[None]]).tobytes()
    assert got["gate_up"].tobytes() == np.ascontiguousarray(np.concatenate([gate, up]).T).tobytes()
    norm = load_file(str(tmp_path / "src" / "model.safetensors"))["norm"]
    assert read_raw(tmp_path / "out" / "model.safetensors", "norm") == norm.astype(ml_dtypes.bfloat16).tobytes()


def test_affine_and_view_ops_without_torch(tmp_path: Path) -> None:
    """Gemma's norm + 1 and scaled embedding, a deinterleave along an inner dim and a
    reshape: numpy with ml_dtypes, float32 arithmetic rounded once to bfloat16."""
    rng = np.random.default_rng(2)
    norm = rng.standard_normal(6, dtype=np.float32).astype(ml_dtypes.bfloat16)
    emb = rng.standard_normal((5, 6), dtype=np.float32).astype(ml_dtypes.bfloat16)
    gate_up = rng.standard_normal((2, 3, 8), dtype=np.float32)
    (tmp_path / "src").mkdir()
    write_raw(tmp_path / "src" / "model.safetensors", {
        "norm": ("BF16", [6], norm.tobytes()), "emb": ("BF16", [5, 6], emb.tobytes()),
        "gate_up": ("F32", [2, 3, 8], gate_up.tobytes())})
    done = apply(tmp_path, """\
        tensors:
          - key: norm
            ops: [{add: 1}]
          - key: emb
            ops: [{multiply: {value: '${sqrt(config.hidden_size)}', round_value_to: tensor}}, {reshape: [-1]}]
          - key: gate_up
            to: '{P:gate,up}'
            ops: [{deinterleave: {into: P, dim: -1}}]
        """, {"model_type": "gemma", "hidden_size": 3072})
    assert done.returncode == 0, done.stderr
    out = tmp_path / "out" / "model.safetensors"
    assert read_raw(out, "norm") == (norm.astype(np.float32) + np.float32(1)).astype(ml_dtypes.bfloat16).tobytes()
    normalizer = np.float32(np.float32(3072 ** 0.5).astype(ml_dtypes.bfloat16))
    assert read_raw(out, "emb") == (emb.astype(np.float32) * normalizer).astype(ml_dtypes.bfloat16).tobytes()
    assert read_raw(out, "gate") == np.ascontiguousarray(gate_up[..., ::2]).tobytes()
    assert read_raw(out, "up") == np.ascontiguousarray(gate_up[..., 1::2]).tobytes()


def test_fp8_dequant_without_torch(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 256, (4, 6), dtype=np.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0x38
    bits[0, 0] = 0x7F  # NaN stays NaN
    scale = np.array([[0.5, 2.0]], dtype=np.float32)
    (tmp_path / "src").mkdir()
    write_raw(tmp_path / "src" / "model.safetensors", {"w.weight": ("F8_E4M3", [4, 6], bits.tobytes()),
                                                       "w.weight_scale_inv": ("F32", [1, 2], scale.tobytes())})
    done = apply(tmp_path, """\
        tensors:
          - key: '{M*}.{T:weight,weight_scale_inv}'
            to: '{M}.weight'
            ops: [{dequant_fp8_block: {over: T, allow_nonfinite: true}}]
        """, {"model_type": "llama", "quantization_config": {"quant_method": "fp8", "weight_block_size": [4, 4]}})
    assert done.returncode == 0, done.stderr
    got = np.frombuffer(read_raw(tmp_path / "out" / "model.safetensors", "w.weight"), dtype=ml_dtypes.bfloat16)
    want = bits.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.repeat(scale, 4, axis=1)[:, :6]
    want = want.astype(ml_dtypes.bfloat16).reshape(-1)
    assert np.isnan(got[0]) and np.isnan(want[0])
    assert got[1:].tobytes() == want[1:].tobytes()


def test_what_needs_torch_is_one_line_naming_the_extra(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    save_file({"emb": np.ones((2, 3), np.float32)}, str(tmp_path / "src" / "model.safetensors"))
    done = apply(tmp_path, """\
        tensors:
          - key: emb
            ops: [{resize_rows: {rows: 4, fill: normal, seed: 3}}]
        """)
    assert done.returncode != 0
    assert "pip install 'ckptxform[torch]'" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()
    pickled = tmp_path / "bin"
    pickled.mkdir()
    # torch's pre-1.6 format, a bare pickle (torch's zip format reads without torch)
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19.")
    done = ckptxform("inspect", str(pickled))
    assert done.returncode != 0, done.stderr
    assert done.stderr.strip().endswith(f"{pickled / 'pytorch_model.bin'}: a legacy (non-zip) pickled .bin/.pth "
                                        "needs torch, which is not installed; pip install 'ckptxform[torch]'")
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("rule", ["aqmedai_k2_to_k25", "compressed_int4_to_bf16", "fp8_to_bf16", "nvfp4_to_bf16",
                                  # DCP and torch_dist stand-ins torch writes, shipped prebuilt (issue 35 item 8)
                                  "torchtitan_llama_to_hf", "torchtitan_0_2_llama_to_hf", "megatron_gpt_to_hf",
                                  "megatron_moe_to_hf"])
def test_demo_and_its_apply_without_torch(tmp_path: Path, rule: str) -> None:
    done = ckptxform("demo", rule, "--out", str(tmp_path / "demo"))
    assert done.returncode == 0, done.stderr
    apply = next(line.removeprefix("$ ") for line in done.stdout.splitlines() if line.startswith("$ ckptxform apply "))
    args = [a.strip("'") for a in apply.split()[1:]]  # the demo's paths hold no spaces (tmp_path)
    if "--out" in args:  # our own OUT, not the demo's
        args = args[:args.index("--out")]
    converted = ckptxform(*args, "--out", str(tmp_path / "out"))
    assert converted.returncode == 0, converted.stderr
    assert ckptxform("verify", str(tmp_path / "out")).returncode == 0


def test_the_demo_of_a_pickled_bin_rule_runs_without_torch(tmp_path: Path) -> None:
    """The stand-in pytorch_model.bin is shipped prebuilt, and torch's zip format is read
    without torch: ``demo --run`` converts it, and the output verifies."""
    done = ckptxform("demo", "eagle3_to_speculators", "--run", "--out", str(tmp_path / "demo"))
    assert done.returncode == 0, done.stderr
    drafter = tmp_path / "demo" / "sources" / "EAGLE3-LLaMA3.1-Instruct-8B"
    assert (drafter / "pytorch_model.bin").read_bytes()[:4] == b"PK\x03\x04"
    converted = tmp_path / "demo" / "converted"
    assert (converted / "config.json").is_file() and list(converted.glob("*.safetensors")), done.stdout
    assert ckptxform("verify", str(converted)).returncode == 0


def test_a_hostile_bin_is_one_line_without_torch(tmp_path: Path) -> None:
    """A data.pkl that calls os.system: refused by name, the call never made."""
    import zipfile

    marker = tmp_path / "marker"
    command = f"touch {marker}".encode()
    pickled = (b"\x80\x02}X\x01\x00\x00\x00wcos\nsystem\n(X" + len(command).to_bytes(4, "little") + command
               + b"tRs.")
    path = tmp_path / "pytorch_model.bin"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", pickled)
        archive.writestr("archive/byteorder", b"little")
    done = ckptxform("inspect", str(path))
    assert done.returncode != 0 and len(done.stderr.splitlines()) == 1, done.stderr
    assert "the pickle names 'os.system', which a torch.save'd state dict never holds" in done.stderr
    assert not marker.exists()


def test_a_dcp_checkpoint_converts_and_inspects_without_torch(tmp_path: Path) -> None:
    """The DCP source reads torch's .metadata pickle and torch.save records itself."""
    fixture = Path(__file__).parent / "fixtures" / "torchtitan_tiny"
    done = ckptxform("apply", "torchtitan_llama_to_hf", f"--source=model={fixture / 'model'}",
                     f"--source=hf_assets={fixture / 'assets'}", "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert "optimizer state saved by the trainer (entry 'optimizer'): not a model weight, never read" in done.stdout
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert len(out) == 3 + 9 and out["model.layers.0.self_attn.k_proj.weight"].shape == (4, 8)
    shown = ckptxform("inspect", str(fixture / "model"))
    assert shown.returncode == 0 and "torch.distributed.checkpoint (DCP)" in shown.stdout.splitlines()[0]
