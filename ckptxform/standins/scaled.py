"""Llama stand-ins quantized with per-tensor, per-channel and per-16 scales, laid out as
llm-compressor (compressed-tensors) and NVIDIA ModelOpt write them; numpy only.

- ``fp8-tensor`` / ``fp8-channel``: compressed-tensors ``float-quantized`` (llm-compressor's
  FP8 / FP8_DYNAMIC): ``weight`` e4m3 = ``w / scale``, ``weight_scale`` = ``amax / 448``:
  float32 ``[1]`` per tensor (with a static bf16 ``input_scale [1]``), or bf16
  ``[rows, 1]`` per output channel (the model dtype, as FP8_DYNAMIC writes it).
- ``nvfp4``: compressed-tensors ``nvfp4-pack-quantized`` (NVFP4A16): ``weight_global_scale``
  = ``448 * 6 / amax`` (float32 ``[1]``, the reciprocal), ``weight_scale`` e4m3 per 16 =
  ``amax16 / 6 * global``, ``weight_packed`` the e2m1 codes of ``w / (scale / global)``.
- ``nvfp4-modelopt``: ModelOpt's HF export: ``weight_scale_2`` = ``amax / (6 * 448)``
  (float32 ``[]``), ``weight_scale`` e4m3 = ``amax16 / 6 / scale_2``, ``weight`` the packed
  codes, ``input_scale`` float32 ``[]``; ``quant_method: modelopt``, ``quant_algo: NVFP4``.
- ``mixed``: attention FP8 per channel, MLP NVFP4, two config groups targeting each by regex.

Codes round to the nearest e2m1 value (ties away from zero: stand-ins need no library's
tie rule); a negative value that rounds to zero keeps its sign (code 8, ``-0``).
Embeddings, norms and lm_head stay bf16 (``ignore: [lm_head]``; the rest is not Linear).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ckptxform.standins.hf_models import LmDims, build_llama
from ckptxform.standins.tensors import save_safetensors, write_json

if TYPE_CHECKING:
    import numpy as np

__all__ = ["SCALED_SCHEMES", "SCALED_TINY", "build_scaled_llama", "e2m1_codes", "scaled_quantization_config"]

Scheme = Literal["fp8-tensor", "fp8-channel", "nvfp4", "nvfp4-modelopt", "mixed"]
SCALED_SCHEMES: tuple[Scheme, ...] = ("fp8-tensor", "fp8-channel", "nvfp4", "nvfp4-modelopt", "mixed")

#: widths NVFP4 can pack (every Linear's columns a multiple of 16), GQA 6:2
SCALED_TINY = LmDims(hidden=96, heads=6, kv_heads=2, intermediate=176, layers=2, vocab=160)

_E4M3_MAX, _E2M1_MAX = 448.0, 6.0
_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_scaled_llama(out_dir: str | Path, scheme: Scheme, dims: LmDims = SCALED_TINY, *, seed: int = 0) -> Path:
    """A LlamaForCausalLM checkpoint (``build_llama``'s values) with every Linear of its
    layers quantized as ``scheme`` says, and its ``quantization_config``."""
    import json

    import numpy as np

    out = build_llama(out_dir, dims, seed=seed)
    tensors = _read(out / "model.safetensors")
    quantized: dict[str, Any] = {}
    for key, value in tensors.items():
        module = key.removesuffix(".weight")
        kind = _scheme_of(scheme, module) if key.endswith(".weight") else None
        if kind is None:
            quantized[key] = value
        else:
            quantized.update({f"{module}.{part}": v for part, v in _QUANTIZERS[kind](value.astype(np.float32)).items()})
    save_safetensors(quantized, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = scaled_quantization_config(scheme)
    write_json(out / "config.json", config)
    return out


def _scheme_of(scheme: Scheme, module: str) -> str | None:
    if module.rsplit(".", 1)[-1] not in _LINEAR or ".layers." not in module:
        return None
    if scheme == "mixed":
        return "fp8-channel" if ".self_attn." in module else "nvfp4"
    return scheme


def e2m1_codes(x: np.ndarray) -> np.ndarray:
    """The nearest e2m1 code (uint8 0..15) of each float32 value, clamped to +-6; the sign
    bit of a negative value is kept even when it rounds to zero."""
    import numpy as np

    from ckptxform.quant.fp4 import E2M1_VALUES

    magnitudes = np.array(E2M1_VALUES[:8], dtype=np.float32)
    midpoints = (magnitudes[1:] + magnitudes[:-1]) / 2
    codes = np.searchsorted(midpoints, np.abs(x), side="right").astype(np.uint8)
    return codes | (np.signbit(x).astype(np.uint8) << 3)


def _packed(codes: np.ndarray) -> np.ndarray:
    from ckptxform.quant.fp4 import pack_e2m1

    return pack_e2m1(codes)


def _e4m3(x: np.ndarray) -> np.ndarray:
    import numpy as np

    from ckptxform.dtypes import numpy_dtype

    return np.clip(x, -_E4M3_MAX, _E4M3_MAX).astype(numpy_dtype("F8_E4M3"))


def _fp8_tensor(w: np.ndarray) -> dict[str, np.ndarray]:
    import numpy as np

    from ckptxform.dtypes import numpy_dtype

    scale = np.array([max(float(np.abs(w).max()), 1e-12) / _E4M3_MAX], dtype=np.float32)
    return {"weight": _e4m3(w / scale), "weight_scale": scale,
            "input_scale": np.array([0.0125], dtype=numpy_dtype("BF16"))}


def _fp8_channel(w: np.ndarray) -> dict[str, np.ndarray]:
    import numpy as np

    from ckptxform.dtypes import numpy_dtype

    amax = np.maximum(np.abs(w).max(axis=1, keepdims=True), np.float32(1e-12))
    scale = (amax / np.float32(_E4M3_MAX)).astype(numpy_dtype("BF16"))
    return {"weight": _e4m3(w / scale.astype(np.float32)), "weight_scale": scale}


def _nvfp4_parts(w: np.ndarray, modelopt: bool) -> dict[str, np.ndarray]:
    import numpy as np

    rows, cols = w.shape
    groups = w.reshape(rows, cols // 16, 16)
    amax = np.float32(max(float(np.abs(w).max()), 1e-12))
    global_ = amax / np.float32(_E2M1_MAX * _E4M3_MAX)  # ModelOpt's weight_scale_2
    scale = _e4m3(np.abs(groups).max(axis=2) / np.float32(_E2M1_MAX) / global_)
    per_group = scale.astype(np.float32) * global_
    per_group[per_group == 0] = 1.0
    codes = _packed(e2m1_codes((groups / per_group[:, :, None]).reshape(rows, cols)))
    if modelopt:
        return {"weight": codes, "weight_scale": scale, "weight_scale_2": np.array(global_, dtype=np.float32),
                "input_scale": np.array(0.0125, dtype=np.float32)}
    return {"weight_packed": codes, "weight_scale": scale,
            "weight_global_scale": np.array([1 / global_], dtype=np.float32)}


_QUANTIZERS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "fp8-tensor": _fp8_tensor, "fp8-channel": _fp8_channel,
    "nvfp4": lambda w: _nvfp4_parts(w, modelopt=False), "nvfp4-modelopt": lambda w: _nvfp4_parts(w, modelopt=True)}


def _fp8_group(strategy: str, targets: list[str]) -> dict[str, Any]:
    static = strategy == "tensor"
    return {"format": "float-quantized", "targets": targets, "output_activations": None,
            "input_activations": {"dynamic": not static, "num_bits": 8, "type": "float", "symmetric": True,
                                  "strategy": "tensor" if static else "token", "group_size": None},
            "weights": {"dynamic": False, "num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy,
                        "group_size": None}}


def _nvfp4_group(targets: list[str]) -> dict[str, Any]:
    return {"format": "nvfp4-pack-quantized", "targets": targets, "input_activations": None,
            "output_activations": None,
            "weights": {"dynamic": False, "num_bits": 4, "type": "float", "symmetric": True, "group_size": 16,
                        "strategy": "tensor_group", "scale_dtype": "torch.float8_e4m3fn"}}


def scaled_quantization_config(scheme: Scheme) -> dict[str, Any]:
    """The ``quantization_config`` llm-compressor (or ModelOpt's export) writes for ``scheme``."""
    if scheme == "nvfp4-modelopt":
        weights = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
        return {"config_groups": {"group_0": {"input_activations": weights, "weights": weights, "targets": ["Linear"]}},
                "ignore": ["lm_head", "model.embed_tokens"], "quant_algo": "NVFP4",
                "producer": {"name": "modelopt", "version": "0.47.0"}, "quant_method": "modelopt"}
    groups = {"fp8-tensor": {"group_0": _fp8_group("tensor", ["Linear"])},
              "fp8-channel": {"group_0": _fp8_group("channel", ["Linear"])},
              "nvfp4": {"group_0": _nvfp4_group(["Linear"])},
              "mixed": {"attention": _fp8_group("channel", ["re:.*self_attn.*"]),
                        "mlp": _nvfp4_group(["re:.*mlp.*"])}}[scheme]
    fmt = "mixed-precision" if scheme == "mixed" else next(iter(groups.values()))["format"]
    return {"config_groups": groups, "format": fmt, "ignore": ["lm_head"], "kv_cache_scheme": None,
            "quant_method": "compressed-tensors", "quantization_status": "compressed", "version": "0.20.1"}


def _read(path: Path) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file as numpy arrays (bf16 through ml_dtypes)."""
    import numpy as np

    from ckptxform.dtypes import numpy_dtype
    from ckptxform.sources.safetensors_header import read_header

    data = path.read_bytes()
    infos, _ = read_header(lambda at, n: data[at:at + n], file=path.name, file_size=len(data))
    return {i.key: np.frombuffer(data[i.offset:i.offset + i.nbytes], dtype=numpy_dtype(i.dtype)).reshape(i.shape)
            for i in infos}
