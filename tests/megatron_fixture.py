"""A real Megatron-Core torch_dist checkpoint for the tests, written by megatron-core itself.

``python tests/megatron_fixture.py OUT`` builds megatron-core 0.16's GPTModel (Llama-style:
RMSNorm, SwiGLU, RoPE, GQA, untied output layer) at tensor parallel size 2 on 2 gloo ranks
on CPU and saves it as Megatron-LM's ``save_checkpoint`` lays a save out:
``OUT/latest_checkpointed_iteration.txt`` and ``OUT/iter_0000001/`` written by
``dist_checkpointing.save`` (the model's sharded state dict under ``model``; ``args``, the
iteration and the checkpoint version in common.pt). Rank 0 also writes ``OUT/tokens.pt``
and ``OUT/logits.pt``: megatron's own forward of the whole model on those tokens (the
TP=2 forward, gathered), the logits the converted model must give.

megatron-core's async file writer waits on CUDA (``torch.cuda.synchronize`` after its
host copies, a CUDA device for its failure flag): on a CPU build there is nothing to wait
for, so those two calls are stood in for here, as is the CUDA RNG tracker's fork around the
(eval: inactive) attention dropout of the reference forward.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from two_ranks import spawn_two

import torch

DIMS = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
        "ffn_hidden_size": 96, "padded_vocab_size": 160, "max_position_embeddings": 64,
        "norm_epsilon": 1e-5, "rotary_base": 10000}


def _args() -> argparse.Namespace:
    """What Megatron-LM's argparse saves (the fields a converter reads, and a few it does not)."""
    return argparse.Namespace(**DIMS, kv_channels=DIMS["hidden_size"] // DIMS["num_attention_heads"],
                              group_query_attention=True, swiglu=True, normalization="RMSNorm",
                              untie_embeddings_and_output_weights=True, position_embedding_type="rope",
                              add_bias_linear=False, params_dtype=torch.float32, tensor_model_parallel_size=2,
                              seq_length=32, micro_batch_size=1, tokenizer_type="NullTokenizer")


def _rank(rank: int, out: str) -> None:

    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    torch.manual_seed(0)
    d = DIMS
    config = TransformerConfig(
        num_layers=d["num_layers"], hidden_size=d["hidden_size"], num_attention_heads=d["num_attention_heads"],
        num_query_groups=d["num_query_groups"], ffn_hidden_size=d["ffn_hidden_size"], use_cpu_initialization=True,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, normalization="RMSNorm",
        layernorm_epsilon=d["norm_epsilon"], add_bias_linear=False, params_dtype=torch.float32,
        tensor_model_parallel_size=2)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=d["padded_vocab_size"], max_sequence_length=d["max_position_embeddings"],
                     position_embedding_type="rope", rotary_base=d["rotary_base"],
                     share_embeddings_and_output_weights=False)
    with torch.no_grad():  # non-trivial norm weights: a swapped norm must show in the logits
        for name, param in model.named_parameters():
            if "layernorm" in name or "layer_norm" in name:
                param.uniform_(0.5, 1.5)
    model.eval()
    import contextlib

    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    # the CUDA RNG tracker forks a CUDA generator around dropout; eval has no dropout
    get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    tokens = torch.randint(0, d["padded_vocab_size"], (1, 12), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(12)[None]
    with torch.no_grad():
        mask = torch.triu(torch.ones(1, 1, 12, 12), diagonal=1).bool()  # True: not attended
        logits = model(tokens, positions, mask)  # this rank's vocabulary columns
        logits = gather_from_tensor_model_parallel_region(logits)
    iteration = os.path.join(out, "iter_0000001")
    os.makedirs(iteration, exist_ok=True)
    state: dict[str, Any] = {"model": model.sharded_state_dict(), "args": _args(), "iteration": 1,
                             "checkpoint_version": 3.0}
    dist_checkpointing.save(state, iteration)
    if rank == 0:
        torch.save(tokens, os.path.join(out, "tokens.pt"))
        torch.save(logits, os.path.join(out, "logits.pt"))
        with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("1")


if __name__ == "__main__":
    spawn_two(_rank, sys.argv[1])
