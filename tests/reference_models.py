"""Tiny random models built with transformers, saved as the checkpoints users have.

The structural rule library (tests/test_structural_library*.py) is checked against these:
each builder makes a real transformers model of a given family with every parameter drawn
from a seeded generator (so a misplaced row shows in the bytes and in the logits) and
saves it the way that family's checkpoints are published: legacy per-expert MoE files as
``save_pretrained()`` writes them, Phi-3 with its fused projections, GPT-2 in the layout
of ``openai-community/gpt2`` (no ``transformer.`` prefix, causal-mask buffers), a tied
Llama without ``lm_head.weight``, and Meta/Mistral consolidated files with ``params.json``.
transformers is imported inside the builders: importing this module is cheap, and the
engine itself never imports transformers.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

#: the rule files the structural library tests cover (test_rule_library covers the rest)
STRUCTURAL_RULES = ("gpt2_conv1d_to_linear.yaml", "hf_llama_to_meta.yaml",
                    "meta_llama_to_hf.yaml", "mixtral_legacy_to_fused.yaml",
                    "phi3_to_llama.yaml", "qwen2_moe_legacy_to_fused.yaml",
                    "tie_embeddings.yaml", "untie_embeddings.yaml")
#: whole-model rules checked against transformers in test files of their own (no inverse)
OWN_REFERENCE_RULES = ("gemma_to_llama.yaml", "llava_to_text.yaml", "gguf_to_hf.yaml", "gguf_qwen2_to_hf.yaml",
                       "hf_to_gguf_bf16.yaml", "hf_to_gguf_f16.yaml", "hf_to_gguf_q8_0.yaml",
                       "qwen2_to_llama.yaml", "peft_lora_merge.yaml", "peft_lora_merge_fp8_block.yaml",
                       "mistral_to_hf.yaml")

#: MoE forward: the plain loop over experts (the grouped-mm kernel needs 16-byte strides,
#: which odd tiny sizes do not have)
EXPERTS = "eager"

#: the token ids every logits comparison feeds the models (batch 2, length 7)
TOKENS = ((3, 17, 5, 29, 11, 2, 40), (1, 8, 33, 8, 21, 47, 0))


@dataclass(frozen=True)
class Dims:
    """The sizes of one tiny model; ``experts``/``shared`` only for MoE families."""

    hidden: int = 24
    heads: int = 4
    kv_heads: int = 2
    layers: int = 2
    intermediate: int = 20
    vocab: int = 50
    experts: int = 3
    shared: int = 0
    head_dim: int | None = None

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads


@dataclass(frozen=True)
class Built:
    """A saved checkpoint (``path``: its directory, or its file for .pth/single files)
    and the transformers model it holds (``None`` for Meta layouts)."""

    path: Path
    model: Any = None
    params: Mapping[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------- transformers models


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Draw every parameter from a seeded generator: norm scales near 1, the rest
    N(0, 0.1) (biases too, so a bias that is not carried over shows)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            module, _, leaf = name.rpartition(".")
            module = module.rpartition(".")[2]
            is_scale = leaf == "weight" and ("norm" in module or module.startswith("ln_"))
            centre = 1.0 if param.ndim == 1 and is_scale else 0.0
            param.copy_((centre + 0.1 * noise).to(param.dtype))
    return model.eval()


def _config(family: str, dims: Dims, **extra: Any) -> Any:
    import transformers

    common: dict[str, Any] = dict(vocab_size=dims.vocab, hidden_size=dims.hidden,
                                  num_hidden_layers=dims.layers,
                                  num_attention_heads=dims.heads,
                                  num_key_value_heads=dims.kv_heads,
                                  intermediate_size=dims.intermediate,
                                  bos_token_id=0, eos_token_id=1, pad_token_id=None)
    if dims.head_dim is not None:
        common["head_dim"] = dims.head_dim
    if family == "mixtral":
        return transformers.MixtralConfig(**common, num_local_experts=dims.experts,
                                          num_experts_per_tok=2, **extra)
    if family in ("qwen2_moe", "qwen3_moe"):
        moe = dict(num_experts=dims.experts, num_experts_per_tok=2,
                   moe_intermediate_size=dims.intermediate - 4)
        if family == "qwen2_moe":
            moe["shared_expert_intermediate_size"] = dims.shared
            return transformers.Qwen2MoeConfig(**common, **moe, **extra)
        return transformers.Qwen3MoeConfig(**common, **moe, **extra)
    if family == "deepseek_v3":  # MLA attention; layer 0 dense, shared experts after
        return transformers.DeepseekV3Config(
            **common, n_routed_experts=dims.experts, n_shared_experts=1, num_experts_per_tok=2,
            moe_intermediate_size=dims.intermediate - 4, n_group=1, topk_group=1,
            first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=6, **extra)
    if family == "phi3":
        return transformers.Phi3Config(**common, **extra)
    if family == "llama":
        return transformers.LlamaConfig(**common, **extra)
    raise ValueError(f"no tiny config for {family!r}")


_CLASSES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
            "phi3": "Phi3ForCausalLM",
            "llama": "LlamaForCausalLM"}


def build_hf(root: Path, family: str, dims: Dims, *, seed: int,
             shard_size: str | None = None, dtype: torch.dtype = torch.float32,
             **extra: Any) -> Built:
    """A random ``family`` model saved with ``save_pretrained()`` (for MoE families that
    is the legacy per-expert layout); sharded when ``shard_size`` is given."""
    import transformers

    config = _config(family, dims, **extra)
    config._experts_implementation = EXPERTS
    model = getattr(transformers, _CLASSES[family])(config).to(dtype)
    randomize(model, seed)
    _save(model, root, shard_size)
    save_tokenizer(root, dims.vocab)
    return Built(root, model)


def _save(model: Any, root: Path, shard_size: str | None, **options: Any) -> None:
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(root, **kwargs, **options)


def save_tokenizer(root: Path, vocab: int) -> None:
    """A word-level tokenizer over tokens ``t0``..``t{vocab-1}`` with a chat template,
    saved as transformers saves one (tokenizer.json, tokenizer_config.json,
    chat_template.jinja): the files a whole-model rule must carry into its output."""
    import tokenizers
    import transformers

    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=words, bos_token="t0",
                                                eos_token="t1", unk_token="t0")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(root)


def transformers_fused(legacy: Path, out: Path, family: str) -> Path:
    """What transformers itself writes for the fused MoE layout: the legacy files loaded
    by transformers and saved with ``save_original_format=False``."""
    import transformers

    model = getattr(transformers, _CLASSES[family]).from_pretrained(
        legacy, dtype="auto", experts_implementation=EXPERTS)
    model.save_pretrained(out, save_original_format=False)
    return out


def load_strict(cls_name: str, path: Path) -> Any:
    """Load ``path`` with transformers, failing on any missing, unexpected or mis-shaped
    key (what a user loading our output relies on)."""
    import transformers

    # Without a config.json transformers would build the class's full-size default model.
    assert (path / "config.json").is_file(), f"{path}: no config.json"
    model, info = getattr(transformers, cls_name).from_pretrained(
        path, dtype="auto", output_loading_info=True, experts_implementation=EXPERTS)
    problems = {k: v for k, v in info.items() if v and k != "error_msgs"} | (
        {"error_msgs": info["error_msgs"]} if info.get("error_msgs") else {})
    assert not problems, f"{path}: {problems}"
    return model.eval()


def logits(model: Any, tokens: tuple[tuple[int, ...], ...] = TOKENS) -> torch.Tensor:
    """Logits computed in float32 (a copy of a lower-precision model: ``model`` stays as
    it is, so it can still be saved in its own dtype)."""
    if any(p.dtype != torch.float32 for p in model.parameters()):
        model = copy.deepcopy(model).float()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float()


# ------------------------------------------------------------------------------- GPT-2


def build_gpt2(root: Path, *, hidden: int, heads: int, layers: int, vocab: int, seed: int,
               positions: int = 16) -> Built:
    """GPT-2 as ``openai-community/gpt2`` publishes it: Conv1D weights [in, out], keys
    without the ``transformer.`` prefix, and each layer's causal-mask buffer ``attn.bias``."""
    import transformers

    config = transformers.GPT2Config(vocab_size=vocab, n_embd=hidden, n_head=heads,
                                     n_layer=layers, n_positions=positions,
                                     bos_token_id=0, eos_token_id=1)
    model = randomize(transformers.GPT2LMHeadModel(config), seed)
    state = {k.removeprefix("transformer."): v.contiguous() for k, v in
             model.state_dict().items() if k != "lm_head.weight"}  # tied to wte
    mask = torch.tril(torch.ones(positions, positions, dtype=torch.bool))
    for layer in range(layers):
        state[f"h.{layer}.attn.bias"] = mask.view(1, 1, positions, positions).clone()
    root.mkdir(parents=True)
    save_file(state, root / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(root)
    save_tokenizer(root, vocab)
    return Built(root, model)


# ----------------------------------------------------------------------- Meta / Mistral


def meta_ffn_size(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """The feed-forward width Meta's ``FeedForward`` derives from ``params.json``."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def build_meta(root: Path, *, dim: int, n_heads: int, n_kv_heads: int, n_layers: int,
               vocab: int, seed: int, file_name: str = "consolidated.safetensors",
               multiple_of: int = 8, ffn_dim_multiplier: float | None = 1.3,
               dtype: torch.dtype = torch.bfloat16) -> Built:
    """A Meta/Mistral consolidated checkpoint: ``params.json`` and Meta's key names, in
    ``consolidated.safetensors`` or a pickled ``consolidated.00.pth``. ``path`` is the
    weights file; ``params`` what params.json holds."""
    params: dict[str, Any] = {"dim": dim, "n_layers": n_layers, "n_heads": n_heads,
                              "n_kv_heads": n_kv_heads, "vocab_size": vocab,
                              "multiple_of": multiple_of,
                              "ffn_dim_multiplier": ffn_dim_multiplier,
                              "norm_eps": 1e-5, "rope_theta": 500000.0}
    head = dim // n_heads
    ffn = meta_ffn_size(dim, multiple_of, ffn_dim_multiplier)
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape: int, centre: float = 0.0) -> torch.Tensor:
        return (centre + 0.1 * torch.randn(shape, generator=gen)).to(dtype)

    state = {"tok_embeddings.weight": draw(vocab, dim), "norm.weight": draw(dim, centre=1.0),
             "output.weight": draw(vocab, dim)}
    for n in range(n_layers):
        state |= {f"layers.{n}.attention.wq.weight": draw(n_heads * head, dim),
                  f"layers.{n}.attention.wk.weight": draw(n_kv_heads * head, dim),
                  f"layers.{n}.attention.wv.weight": draw(n_kv_heads * head, dim),
                  f"layers.{n}.attention.wo.weight": draw(dim, n_heads * head),
                  f"layers.{n}.feed_forward.w1.weight": draw(ffn, dim),
                  f"layers.{n}.feed_forward.w2.weight": draw(dim, ffn),
                  f"layers.{n}.feed_forward.w3.weight": draw(ffn, dim),
                  f"layers.{n}.attention_norm.weight": draw(dim, centre=1.0),
                  f"layers.{n}.ffn_norm.weight": draw(dim, centre=1.0)}
    root.mkdir(parents=True)
    if file_name.endswith(".pth"):
        torch.save(state, root / file_name)
    else:
        save_file(state, root / file_name)
    (root / "params.json").write_text(json.dumps(params, indent=2))
    return Built(root / file_name, None, params)


def meta_keys(n_layers: int) -> set[str]:
    """The state-dict keys of Meta's reference ``Transformer`` (llama/model.py)."""
    layer = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
             "attention.wo.weight", "feed_forward.w1.weight", "feed_forward.w2.weight",
             "feed_forward.w3.weight", "attention_norm.weight", "ffn_norm.weight")
    return {"tok_embeddings.weight", "norm.weight", "output.weight"} | {
        f"layers.{n}.{name}" for n in range(n_layers) for name in layer}


def meta_forward(state: Mapping[str, torch.Tensor], params: Mapping[str, Any],
                 tokens: tuple[tuple[int, ...], ...] = TOKENS) -> torch.Tensor:
    """Logits of Meta's reference Llama (llama/model.py semantics) in float32: RoPE on
    interleaved (even, odd) pairs as complex numbers, k/v heads repeated for GQA, causal
    attention, RMSNorm, SwiGLU. Written from Meta's definition, not from transformers."""
    w = {k: v.float() for k, v in state.items()}
    dim, n_heads, n_kv = params["dim"], params["n_heads"], params["n_kv_heads"]
    head, eps = dim // n_heads, params["norm_eps"]
    ids = torch.tensor(tokens)
    batch, seq = ids.shape
    freqs = 1.0 / (params["rope_theta"] ** (torch.arange(0, head, 2).float() / head))
    cis = torch.polar(torch.ones(seq, head // 2), torch.outer(torch.arange(seq).float(), freqs))

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def rotate(x: torch.Tensor) -> torch.Tensor:  # x [batch, seq, heads, head]
        pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], head // 2, 2))
        return torch.view_as_real(pairs * cis.view(1, seq, 1, head // 2)).flatten(3)

    mask = torch.full((seq, seq), float("-inf")).triu(1)
    h = w["tok_embeddings.weight"][ids]
    for n in range(params["n_layers"]):
        p = f"layers.{n}."
        x = norm(h, w[p + "attention_norm.weight"])
        q = rotate((x @ w[p + "attention.wq.weight"].T).view(batch, seq, n_heads, head))
        k = rotate((x @ w[p + "attention.wk.weight"].T).view(batch, seq, n_kv, head))
        v = (x @ w[p + "attention.wv.weight"].T).view(batch, seq, n_kv, head)
        k, v = (t.repeat_interleave(n_heads // n_kv, dim=2) for t in (k, v))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(2, 3) / math.sqrt(head) + mask
        attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, n_heads * head)
        h = h + attn @ w[p + "attention.wo.weight"].T
        x = norm(h, w[p + "ffn_norm.weight"])
        gate = torch.nn.functional.silu(x @ w[p + "feed_forward.w1.weight"].T)
        h = h + (gate * (x @ w[p + "feed_forward.w3.weight"].T)) @ w[p + "feed_forward.w2.weight"].T
    return norm(h, w["norm.weight"]) @ w["output.weight"].T


# ------------------------------------------------------------------------------ reading


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint: a directory's *.safetensors (any sharding) or one
    .safetensors/.pth file."""
    if path.suffix == ".pth":
        return dict(torch.load(path, weights_only=True, map_location="cpu"))
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, "pt") as f:
            out |= {key: f.get_tensor(key) for key in f.keys()}
    return out


def tensor_bytes(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """key -> (dtype, shape, raw bytes): what "byte-identical checkpoints" compares, so
    shard boundaries and file metadata do not matter but every value bit does."""
    return {key: (str(t.dtype), tuple(t.shape), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            for key, t in read_tensors(path).items()}


class _ConcatQKV(torch.nn.Module):
    """Stands where GPT-2's fused c_attn was: cat(q_proj(x), k_proj(x), v_proj(x))."""

    def __init__(self, *parts: torch.nn.Linear) -> None:
        super().__init__()
        # Held outside the module tree: the Linear layers are the attention's own
        # q_proj/k_proj/v_proj, so their keys are exactly the converted checkpoint's.
        object.__setattr__(self, "parts", parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def gpt2_with_linear_layers(config: Any) -> Any:
    """transformers' GPT-2 with every Conv1D swapped for nn.Linear and c_attn for separate
    q/k/v_proj: the module tree the gpt2_conv1d_to_linear layout is a state dict of (no
    transformers class holds that layout), running transformers' own GPT-2 forward."""
    import transformers

    model = transformers.GPT2LMHeadModel(config)
    hidden, inner = config.n_embd, config.n_inner or 4 * config.n_embd
    for block in model.transformer.h:
        attn, mlp = block.attn, block.mlp
        attn.q_proj, attn.k_proj, attn.v_proj = (torch.nn.Linear(hidden, hidden) for _ in range(3))
        attn.c_attn = _ConcatQKV(attn.q_proj, attn.k_proj, attn.v_proj)
        attn.c_proj = torch.nn.Linear(hidden, hidden)
        mlp.c_fc, mlp.c_proj = torch.nn.Linear(hidden, inner), torch.nn.Linear(inner, hidden)
    return model.eval()


def transformers_write_model(shards: list[Mapping[str, torch.Tensor]], params: Mapping[str, Any],
                             llama_version: str = "2") -> dict[str, torch.Tensor]:
    """The HF tensors transformers' Meta converter makes from ``shards`` (its
    ``convert_llama_weights_to_hf.py`` ``write_model``, huggingface/transformers at
    01cc9cd9, with ``num_shards=len(shards)``). Restated, not imported: transformers 5.x
    wheels no longer ship the script. Only its tensor logic is restated, line for line
    (views per shard, cat, its ``permute``); tokenizer and config writing are left out."""
    num_shards = len(shards)
    params = params.get("model", params)
    n_layers, n_heads, dim = params["n_layers"], params["n_heads"], params["dim"]
    n_heads_per_shard = n_heads // num_shards
    dims_per_head = dim // n_heads
    if params.get("n_kv_heads", None) is not None:
        num_key_value_heads = params["n_kv_heads"]
        num_key_value_heads_per_shard = num_key_value_heads // num_shards
        key_value_dim = dims_per_head * num_key_value_heads
    else:
        num_key_value_heads = n_heads
        num_key_value_heads_per_shard = n_heads_per_shard
        key_value_dim = dim

    def permute(w: torch.Tensor, n_heads: int, dim1: int = dim, dim2: int = dim) -> torch.Tensor:
        return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)

    out: dict[str, torch.Tensor] = {}
    if num_shards == 1:
        loaded = shards[0]
        for i in range(n_layers):
            p, q = f"layers.{i}.", f"model.layers.{i}."
            out |= {f"{q}self_attn.q_proj.weight": permute(loaded[f"{p}attention.wq.weight"], n_heads=n_heads),
                    f"{q}self_attn.k_proj.weight": permute(loaded[f"{p}attention.wk.weight"],
                                                           n_heads=num_key_value_heads, dim1=key_value_dim),
                    f"{q}self_attn.v_proj.weight": loaded[f"{p}attention.wv.weight"],
                    f"{q}self_attn.o_proj.weight": loaded[f"{p}attention.wo.weight"],
                    f"{q}mlp.gate_proj.weight": loaded[f"{p}feed_forward.w1.weight"],
                    f"{q}mlp.down_proj.weight": loaded[f"{p}feed_forward.w2.weight"],
                    f"{q}mlp.up_proj.weight": loaded[f"{p}feed_forward.w3.weight"],
                    f"{q}input_layernorm.weight": loaded[f"{p}attention_norm.weight"],
                    f"{q}post_attention_layernorm.weight": loaded[f"{p}ffn_norm.weight"]}
        return out | {"model.embed_tokens.weight": loaded["tok_embeddings.weight"],
                      "model.norm.weight": loaded["norm.weight"], "lm_head.weight": loaded["output.weight"]}
    loaded = shards
    for i in range(n_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        out[f"{q}input_layernorm.weight"] = loaded[0][f"{p}attention_norm.weight"].clone()
        out[f"{q}post_attention_layernorm.weight"] = loaded[0][f"{p}ffn_norm.weight"].clone()
        out[f"{q}self_attn.q_proj.weight"] = permute(torch.cat(
            [loaded[s][f"{p}attention.wq.weight"].view(n_heads_per_shard, dims_per_head, dim)
             for s in range(len(loaded))], dim=0).reshape(dim, dim), n_heads=n_heads)
        out[f"{q}self_attn.k_proj.weight"] = permute(torch.cat(
            [loaded[s][f"{p}attention.wk.weight"].view(num_key_value_heads_per_shard, dims_per_head, dim)
             for s in range(len(loaded))], dim=0).reshape(key_value_dim, dim),
            num_key_value_heads, key_value_dim, dim)
        out[f"{q}self_attn.v_proj.weight"] = torch.cat(
            [loaded[s][f"{p}attention.wv.weight"].view(num_key_value_heads_per_shard, dims_per_head, dim)
             for s in range(len(loaded))], dim=0).reshape(key_value_dim, dim)
        out[f"{q}self_attn.o_proj.weight"] = torch.cat([x[f"{p}attention.wo.weight"] for x in loaded], dim=1)
        out[f"{q}mlp.gate_proj.weight"] = torch.cat([x[f"{p}feed_forward.w1.weight"] for x in loaded], dim=0)
        out[f"{q}mlp.down_proj.weight"] = torch.cat([x[f"{p}feed_forward.w2.weight"] for x in loaded], dim=1)
        out[f"{q}mlp.up_proj.weight"] = torch.cat([x[f"{p}feed_forward.w3.weight"] for x in loaded], dim=0)
    concat_dim = 0 if llama_version in ["3", "3.1"] else 1
    return out | {"model.norm.weight": loaded[0]["norm.weight"],
                  "model.embed_tokens.weight": torch.cat([x["tok_embeddings.weight"] for x in loaded], dim=concat_dim),
                  "lm_head.weight": torch.cat([x["output.weight"] for x in loaded], dim=0)}
