"""A real Megatron-Core torch_dist checkpoint for the tests, written by megatron-core itself.

``python tests/megatron_fixture.py OUT [--moe]`` builds megatron-core 0.16's GPTModel
(Llama-style: RMSNorm, SwiGLU, RoPE, GQA, untied output layer; with ``--moe`` every layer's
MLP is a mixture of experts, Mixtral-style: 4 experts, top-2 softmax routing, no shared
expert, megatron-core's SequentialMLP, the experts tensor-parallel like the dense MLP) at
tensor parallel size 2 on 2 gloo ranks on CPU and saves it as Megatron-LM's
``save_checkpoint`` lays a save out:
``OUT/latest_checkpointed_iteration.txt`` and ``OUT/iter_0000001/`` written by
``dist_checkpointing.save`` (the model's sharded state dict under ``model``; ``args``, the
iteration and the checkpoint version in common.pt). Rank 0 also writes ``OUT/tokens.pt``
and ``OUT/logits.pt``: megatron's own forward of the whole model on those tokens (the
TP=2 forward, gathered), the logits the converted model must give. Where Megatron-Bridge is
installed, both ranks then export the model with its ``stream_weights_megatron_to_hf``
(tests/megatron_bridge.py: LlamaBridge's registry for the dense model, Qwen3MoEBridge's for
the MoE one: Megatron-Bridge has no Mixtral bridge, and Qwen3-MoE's maps the same
SequentialMLP experts and router, to its HF names) and rank 0 writes
``OUT/bridge_hf.safetensors``; where it is not, ``OUT/bridge_absent.txt`` says why.

megatron-core's async file writer waits on CUDA (``torch.cuda.synchronize`` after its
host copies, a CUDA device for its failure flag): on a CPU build there is nothing to wait
for, so those two calls are stood in for here, as is the CUDA RNG tracker's fork around the
(eval: inactive) attention dropout of the reference forward. megatron-core 0.16.1's MoE router
tests ``te_general_gemm is not None`` where its import of TransformerEngine failed and left
the name undefined: it is set to None, the value that test expects without TransformerEngine.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any

from two_ranks import spawn_two

import torch

DIMS = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
        "ffn_hidden_size": 96, "padded_vocab_size": 160, "max_position_embeddings": 64,
        "norm_epsilon": 1e-5, "rotary_base": 10000}

#: the MoE fields of Megatron-LM's args (--num-experts is saved as num_experts) and their
#: TransformerConfig names
MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 48}
MOE_CONFIG = {"num_moe_experts": MOE["num_experts"], "moe_router_topk": MOE["moe_router_topk"],
              "moe_ffn_hidden_size": MOE["moe_ffn_hidden_size"], "moe_grouped_gemm": False,
              "moe_token_dispatcher_type": "allgather", "moe_router_load_balancing_type": "aux_loss",
              "moe_aux_loss_coeff": 0.0}


def _args(moe: bool) -> argparse.Namespace:
    """What Megatron-LM's argparse saves (the fields a converter reads, and a few it does not)."""
    experts = {**MOE, "moe_layer_freq": 1, "moe_shared_expert_intermediate_size": None,
               "moe_router_pre_softmax": False, "moe_router_score_function": "softmax",
               "moe_router_topk_scaling_factor": None, "moe_router_enable_expert_bias": False,
               "moe_grouped_gemm": False} if moe else {"num_experts": None}
    return argparse.Namespace(**DIMS, **experts, kv_channels=DIMS["hidden_size"] // DIMS["num_attention_heads"],
                              group_query_attention=True, swiglu=True, normalization="RMSNorm",
                              untie_embeddings_and_output_weights=True, position_embedding_type="rope",
                              add_bias_linear=False, params_dtype=torch.float32, tensor_model_parallel_size=2,
                              seq_length=32, micro_batch_size=1, tokenizer_type="NullTokenizer")


def _rank(rank: int, out: str, moe: bool) -> None:

    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.core.transformer.moe import moe_utils

    if not moe_utils.HAVE_TE:  # its `except ImportError` leaves te_general_gemm undefined
        moe_utils.te_general_gemm = None
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    torch.manual_seed(0)
    d = DIMS
    config = TransformerConfig(
        num_layers=d["num_layers"], hidden_size=d["hidden_size"], num_attention_heads=d["num_attention_heads"],
        num_query_groups=d["num_query_groups"], ffn_hidden_size=d["ffn_hidden_size"], use_cpu_initialization=True,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, normalization="RMSNorm",
        layernorm_epsilon=d["norm_epsilon"], add_bias_linear=False, params_dtype=torch.float32,
        tensor_model_parallel_size=2, **(MOE_CONFIG if moe else {}))
    spec = get_gpt_layer_local_spec(num_experts=MOE["num_experts"] if moe else None, moe_grouped_gemm=False,
                                    normalization="RMSNorm")
    model = GPTModel(config=config, transformer_layer_spec=spec,
                     vocab_size=d["padded_vocab_size"], max_sequence_length=d["max_position_embeddings"],
                     position_embedding_type="rope", rotary_base=d["rotary_base"],
                     share_embeddings_and_output_weights=False)
    with torch.no_grad():  # non-trivial norm weights: a swapped norm must show in the logits
        for name, param in model.named_parameters():
            if "layernorm" in name or "layer_norm" in name:
                param.uniform_(0.5, 1.5)
            elif "router" in name:  # decisive routing: a near-tie would pick experts by rounding
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(7)))
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
    state: dict[str, Any] = {"model": model.sharded_state_dict(), "args": _args(moe), "iteration": 1,
                             "checkpoint_version": 3.0}
    dist_checkpointing.save(state, iteration)
    if rank == 0:
        torch.save(tokens, os.path.join(out, "tokens.pt"))
        torch.save(logits, os.path.join(out, "logits.pt"))
        with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("1")
    _bridge_export(rank, out, model, moe)


def _bridge_export(rank: int, out: str, model: Any, moe: bool) -> None:
    """Megatron-Bridge's export of ``model`` (both ranks take part), written by rank 0."""
    from megatron_bridge import export, load

    try:
        if moe:
            (module,) = load("models.qwen.qwen3_moe_bridge")
            bridge, hf_keys = module.Qwen3MoEBridge(), None  # HF Qwen3-MoE keys differ: every mapping
        else:
            (module,) = load("models.llama.llama_bridge")
            bridge, hf_keys = module.LlamaBridge(), _llama_keys()
    except ImportError as e:
        if rank == 0:
            with open(os.path.join(out, "bridge_absent.txt"), "w") as f:
                f.write(str(e))
        return
    weights = export(bridge, model, hf_keys)
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(out, "bridge_hf.safetensors"))


def _llama_keys() -> list[str]:
    """The tensor names of transformers' LlamaForCausalLM of these dimensions (an HF checkpoint's keys)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    d = DIMS
    config = LlamaConfig(hidden_size=d["hidden_size"], intermediate_size=d["ffn_hidden_size"],
                         num_hidden_layers=d["num_layers"], num_attention_heads=d["num_attention_heads"],
                         num_key_value_heads=d["num_query_groups"], vocab_size=d["padded_vocab_size"])
    with torch.device("meta"):
        return list(LlamaForCausalLM(config).state_dict())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--moe", action="store_true", help="every layer's MLP a mixture of experts")
    cli = parser.parse_args()
    spawn_two(functools.partial(_rank, moe=cli.moe), cli.out)
