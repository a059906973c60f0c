"""A gpt-oss stand-in (openai/gpt-oss-20b, gpt-oss-120b): MXFP4 experts as the real repos
store them, everything else bfloat16.

Per layer ``model.layers.L.``: ``self_attn.{q,k,v,o}_proj.{weight,bias}``, ``self_attn.sinks``
[heads], ``mlp.router.{weight,bias}`` [E, H] / [E], the two norms, and the experts:
``mlp.experts.gate_up_proj_blocks`` uint8 [E, 2I, H/32, 16] with ``_scales`` [E, 2I, H/32]
(gate and up rows interleaved: row 2j gate, 2j+1 up), ``down_proj_blocks`` [E, H, I/32, 16]
with ``_scales`` [E, H, I/32], and their bf16 biases ``gate_up_proj_bias`` [E, 2I],
``down_proj_bias`` [E, H]. The config is gpt-oss-20b's with the widths of ``GptOssDims`` and
its ``quantization_config`` (``quant_method: mxfp4``); shards are named as the real ones
(``model-00000-of-00002.safetensors``: zero-based, the last number one less than the count).

The experts are quantized from seeded N(0, 0.02) weights the way OCP MX defines it: per
group of 32, the scale is ``2**(floor(log2(amax)) - 2)`` (e8m0 byte ``that + 127``) and each
value the nearest e2m1 code of ``w / scale`` (clamped to 6) with the sign of ``w``, so small
negative values are the code ``-0``, as a real quantizer leaves them. numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptxform.errors import UsageError
from ckptxform.quant.fp4 import E2M1_VALUES, pack_e2m1
from ckptxform.standins.shards import balanced_runs, write_sharded
from ckptxform.standins.tensors import (
    BuiltCheckpoint,
    derive_seed,
    numpy_dtype_named,
    write_json,
)

if TYPE_CHECKING:
    import numpy as np

__all__ = ["GPT_OSS_TINY", "GptOssDims", "build_gpt_oss", "mxfp4_quantized"]


@dataclass(frozen=True, kw_only=True)
class GptOssDims:
    """gpt-oss widths (config.json names in comments); hidden and intermediate are whole
    MXFP4 groups of 32."""

    hidden: int = 96            # hidden_size (3 groups)
    intermediate: int = 160     # intermediate_size (5 groups)
    layers: int = 2             # num_hidden_layers
    experts: int = 4            # num_local_experts
    experts_per_token: int = 2  # num_experts_per_tok
    heads: int = 4              # num_attention_heads
    kv_heads: int = 2           # num_key_value_heads
    head_dim: int = 16          # head_dim (not hidden / heads in gpt-oss: 64 of 2880 / 64)
    vocab: int = 320            # vocab_size

    def __post_init__(self) -> None:
        if self.hidden % 32 or self.intermediate % 32 or self.heads % self.kv_heads:
            raise UsageError(f"GptOssDims: hidden={self.hidden}, intermediate={self.intermediate} must be "
                             f"multiples of 32 (MXFP4 groups) and kv_heads={self.kv_heads} divide "
                             f"heads={self.heads}")


GPT_OSS_TINY = GptOssDims()


def mxfp4_quantized(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 blocks [..., G, 16], uint8 e8m0 scales [..., G]) of float32 ``w`` [..., 32 G]."""
    import numpy as np

    if w.shape[-1] % 32:
        raise UsageError(f"MXFP4 groups 32 values: the last dim ({w.shape[-1]}) is not a multiple of 32")
    groups = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32).astype(np.float32)
    amax = np.abs(groups).max(axis=-1)
    with np.errstate(divide="ignore"):
        exponent = np.where(amax > 0, np.floor(np.log2(amax)) - 2, -127)
    exponent = np.clip(exponent, -127, 127)
    magnitude = np.abs(groups) / np.ldexp(np.float32(1), exponent.astype(np.int32))[..., None]
    grid = np.array(E2M1_VALUES[:8], dtype=np.float32)
    code = np.searchsorted((grid[1:] + grid[:-1]) / 2, np.minimum(magnitude, 6.0)).astype(np.uint8)
    code |= np.signbit(groups).astype(np.uint8) << 3
    return pack_e2m1(code), (exponent + 127).astype(np.uint8)


def build_gpt_oss(out_dir: str | Path, dims: GptOssDims = GPT_OSS_TINY, *, seed: int = 0,
                  num_shards: int = 3) -> BuiltCheckpoint:
    """The gpt-oss checkpoint of ``dims`` under ``out_dir``, with an index.

    Example::

        built = build_gpt_oss(tmp_path / "gpt-oss-20b")
        built.shapes["model.layers.0.mlp.experts.gate_up_proj_blocks"]  # (4, 320, 3, 16)
    """
    d, out = dims, Path(out_dir)
    first = [_plain("model.embed_tokens.weight", (d.vocab, d.hidden), seed)]
    last = [_plain("model.norm.weight", (d.hidden,), seed, norm=True),
            _plain("lm_head.weight", (d.vocab, d.hidden), seed)]
    modules = [*first, *(m for n in range(d.layers) for m in _layer(f"model.layers.{n}.", d, seed)), *last]
    names = [f"model-{i:05d}-of-{num_shards - 1:05d}.safetensors" for i in range(num_shards)]
    written = write_sharded(out, names, modules, lambda sizes: balanced_runs(sizes, num_shards))
    write_json(out / "config.json", gpt_oss_config(d))
    return BuiltCheckpoint(path=out, dims=d, target_ids=None, keys=tuple(sorted(written.weight_map)),  # type: ignore[arg-type]
                           shapes=written.shapes, dtypes=written.dtypes,
                           files=tuple(sorted(["config.json", "model.safetensors.index.json", *names])))


_Module = tuple[list[tuple[str, int]], Any]


def _plain(key: str, shape: tuple[int, ...], seed: int, *, norm: bool = False) -> _Module:
    """One bf16 tensor: N(0, 0.02), or near 1 for a norm."""
    import numpy as np

    def make() -> dict[str, np.ndarray]:
        values = np.random.default_rng(derive_seed(seed, key)).standard_normal(shape, dtype=np.float32)
        return {key: ((1.0 + 0.05 * values) if norm else 0.02 * values).astype(numpy_dtype_named("bfloat16"))}
    return [(key, 2 * _numel(shape))], make


def _experts(key: str, shape: tuple[int, int, int], seed: int) -> _Module:
    """``key``_blocks and ``key``_scales of a [E, rows, cols] weight quantized to MXFP4."""
    import numpy as np

    experts, rows, cols = shape

    def make() -> dict[str, np.ndarray]:
        w = np.float32(0.02) * np.random.default_rng(derive_seed(seed, key)).standard_normal(shape, dtype=np.float32)
        blocks, scales = mxfp4_quantized(w)
        return {f"{key}_blocks": blocks, f"{key}_scales": scales}
    return [(f"{key}_blocks", experts * rows * cols // 2), (f"{key}_scales", experts * rows * cols // 32)], make


def _layer(p: str, d: GptOssDims, seed: int) -> list[_Module]:
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    a = f"{p}self_attn."
    return [
        _plain(f"{p}input_layernorm.weight", (d.hidden,), seed, norm=True),
        _plain(f"{a}q_proj.weight", (q, d.hidden), seed), _plain(f"{a}q_proj.bias", (q,), seed),
        _plain(f"{a}k_proj.weight", (kv, d.hidden), seed), _plain(f"{a}k_proj.bias", (kv,), seed),
        _plain(f"{a}v_proj.weight", (kv, d.hidden), seed), _plain(f"{a}v_proj.bias", (kv,), seed),
        _plain(f"{a}o_proj.weight", (d.hidden, q), seed), _plain(f"{a}o_proj.bias", (d.hidden,), seed),
        _plain(f"{a}sinks", (d.heads,), seed),
        _plain(f"{p}post_attention_layernorm.weight", (d.hidden,), seed, norm=True),
        _plain(f"{p}mlp.router.weight", (d.experts, d.hidden), seed), _plain(f"{p}mlp.router.bias", (d.experts,), seed),
        _experts(f"{p}mlp.experts.gate_up_proj", (d.experts, 2 * d.intermediate, d.hidden), seed),
        _plain(f"{p}mlp.experts.gate_up_proj_bias", (d.experts, 2 * d.intermediate), seed),
        _experts(f"{p}mlp.experts.down_proj", (d.experts, d.hidden, d.intermediate), seed),
        _plain(f"{p}mlp.experts.down_proj_bias", (d.experts, d.hidden), seed),
    ]


def gpt_oss_config(d: GptOssDims) -> dict[str, Any]:
    """openai/gpt-oss-20b's config.json with the widths of ``d``."""
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
        "attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02, "initial_context_length": 4096,
        "hidden_size": d.hidden, "intermediate_size": d.intermediate, "num_hidden_layers": d.layers,
        "num_local_experts": d.experts, "num_experts_per_tok": d.experts_per_token,
        "experts_per_token": d.experts_per_token, "num_attention_heads": d.heads, "num_key_value_heads": d.kv_heads,
        "head_dim": d.head_dim, "vocab_size": d.vocab, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
        "layer_types": ["sliding_attention" if n % 2 == 0 else "full_attention" for n in range(d.layers)],
        "sliding_window": 128, "rope_theta": 150000,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                         "rope_type": "yarn", "truncate": False},
        "swiglu_limit": 7.0, "router_aux_loss_coef": 0.9, "output_router_logits": False, "tie_word_embeddings": False,
        "use_cache": True, "pad_token_id": d.vocab - 1, "eos_token_id": d.vocab - 2, "torch_dtype": "bfloat16",
        "transformers_version": "4.55.0.dev0",
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
    }


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
