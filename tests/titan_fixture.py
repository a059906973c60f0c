"""Real torchtitan checkpoints for the DCP tests, written by the libraries themselves.

``python tests/titan_fixture.py OUT`` builds torchtitan 0.3's Llama3Model (GQA, a vocabulary
that 2 ranks split unevenly), shards it with FSDP2 (``fully_shard`` per block, then the
root, as torchtitan's parallelize does) on 2 gloo ranks on CPU and saves with torch's
``dcp.save``, the model's state dict taken by torchtitan's ``ModelWrapper``: ``OUT/model``
(separate wq/wk/wv projections, ``fuse_qkv=False``: every tensor chunked across the two
rank files) and ``OUT/step-1`` (torchtitan 0.3's default fused ``wqkv``, which its
state-dict hook splits into replicated wq/wk/wv) after one real training step (AdamW), laid out as
torchtitan's CheckpointManager saves mid-run: the model's keys at the top, the optimizer's
flattened state under ``optimizer``, and ``lr_scheduler``, ``dataloader``, ``train_state``.

torchtitan imports its MoE expert-parallel Triton kernels at import time; triton is a GPU
compiler and none of it runs here, so ``install_kernel_stub`` stands in for that one module.
The model attends with torchtitan's own ScaledDotProductAttention (its flex backend has no
backward on CPU).
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

from two_ranks import spawn_two

DIMS = {"dim": 64, "n_heads": 4, "n_kv_heads": 2, "n_layers": 2, "vocab": 161, "hidden": 96,
        "theta": 500000.0, "eps": 1e-5}


def install_kernel_stub() -> None:
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    if name in sys.modules:
        return
    stub = types.ModuleType(name)

    def missing(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)

        def unavailable(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError(f"{name}.{attr} needs triton and a GPU")
        return unavailable

    stub.__getattr__ = missing  # type: ignore[method-assign]
    sys.modules[name] = stub


def model_config(d: dict[str, Any] = DIMS, *, fuse_qkv: bool = True) -> Any:
    install_kernel_stub()
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config

    dim, heads = d["dim"], d["n_heads"]
    rope = ComplexRoPE.Config(dim=dim // heads, max_seq_len=64, theta=d["theta"], scaling="none")
    layers = [llama3.Llama3TransformerBlock.Config(
        attention_norm=RMSNorm.Config(normalized_shape=dim, eps=d["eps"], param_init=llama3._NORM_INIT),
        ffn_norm=RMSNorm.Config(normalized_shape=dim, eps=d["eps"], param_init=llama3._NORM_INIT),
        attention=make_gqa_config(dim=dim, n_heads=heads, n_kv_heads=d["n_kv_heads"],
                                  wqkv_param_init=llama3._LINEAR_INIT, wo_param_init=llama3._depth_init(n),
                                  inner_attention=ScaledDotProductAttention.Config(), fuse_qkv=fuse_qkv, rope=rope),
        feed_forward=make_ffn_config(dim=dim, hidden_dim=d["hidden"], w1_param_init=llama3._LINEAR_INIT,
                                     w2w3_param_init=llama3._depth_init(n)))
        for n in range(d["n_layers"])]
    return llama3.Llama3Model.Config(
        dim=dim, vocab_size=d["vocab"],
        tok_embeddings=Embedding.Config(num_embeddings=d["vocab"], embedding_dim=dim,
                                        param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, eps=d["eps"], param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=d["vocab"], param_init=llama3._output_linear_init(dim)),
        layers=layers)


def build_model(seed: int = 0, *, fuse_qkv: bool = True) -> Any:
    import torch

    torch.manual_seed(seed)
    model = model_config(fuse_qkv=fuse_qkv).build()
    model.init_states()
    return model


def hf_config(d: dict[str, Any] = DIMS) -> dict[str, Any]:
    """The config.json torchtitan's hf_assets folder would hold for this model."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d["dim"],
            "intermediate_size": d["hidden"], "num_attention_heads": d["n_heads"],
            "num_key_value_heads": d["n_kv_heads"], "num_hidden_layers": d["n_layers"], "vocab_size": d["vocab"],
            "head_dim": d["dim"] // d["n_heads"], "hidden_act": "silu", "rms_norm_eps": d["eps"],
            "max_position_embeddings": 64, "rope_parameters": {"rope_type": "default", "rope_theta": d["theta"]},
            "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "dtype": "float32"}


def _sharded(*, fuse_qkv: bool) -> Any:
    from torch.distributed.fsdp import fully_shard

    model = build_model(fuse_qkv=fuse_qkv)
    for block in model.layers.values():
        fully_shard(block)
    return fully_shard(model)


def _rank(rank: int, out: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torchtitan.components.checkpointer.base import ModelWrapper

    dcp.save(ModelWrapper(_sharded(fuse_qkv=False)).state_dict(), checkpoint_id=os.path.join(out, "model"))
    model = _sharded(fuse_qkv=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    tokens = torch.randint(0, DIMS["vocab"], (2, 9), generator=torch.Generator().manual_seed(rank))
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, DIMS["vocab"]), tokens[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    scheduler.step()
    state: dict[str, Any] = dict(ModelWrapper(model).state_dict())
    state["optimizer"] = get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    state["lr_scheduler"] = scheduler.state_dict()
    state["dataloader"] = {f"dp_rank_{rank}": b"sampler state"}
    state["train_state"] = {"step": 1, "ntokens_seen": int(tokens.numel())}
    dcp.save(state, checkpoint_id=os.path.join(out, "step-1"))


if __name__ == "__main__":
    spawn_two(_rank, sys.argv[1])
