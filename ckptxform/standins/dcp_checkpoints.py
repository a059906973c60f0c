"""Stand-ins of trainer checkpoints saved by torch.distributed.checkpoint (DCP).

``build_torchtitan_llama`` writes what torchtitan's checkpointer writes for a Llama-3
model: its native keys (``layers.N.attention.qkv_linear.wq.weight``, 0.3; ``.attention.wq``
with ``layout="0.2"``) saved by torch's own ``dcp.save``, optionally beside the training
state torchtitan saves mid-run (``optimizer.*`` tensors, ``lr_scheduler``, ``dataloader``,
``train_state`` objects), and the ``hf_assets`` folder its ``convert_to_hf`` reads
(config.json, generation_config.json). One process writes one rank; the tests save real
2-rank FSDP2 checkpoints. Needs torch (``dcp.save``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from ckptxform.standins.hf_models import LM_TINY, LmDims, _decoder_config, _GENERATION
from ckptxform.standins.tensors import TensorSpec, meta_llama_specs, seeded_values, write_json


def torchtitan_llama_specs(d: LmDims, layout: Literal["0.2", "0.3"] = "0.3") -> list[TensorSpec]:
    """The tensors of torchtitan's Llama3Model, by its state-dict names."""
    return meta_llama_specs(vocab=d.vocab, hidden=d.hidden, heads=d.heads, kv_heads=d.kv_heads,
                            head_dim=d.head_dim, intermediate=d.intermediate, layers=d.layers, dtype=d.dtype,
                            head_key="lm_head.weight", qkv_prefix="qkv_linear." if layout == "0.3" else "")


def build_torchtitan_llama(root: str | Path, dims: LmDims = LM_TINY, *, seed: int = 0,
                           layout: Literal["0.2", "0.3"] = "0.3",
                           training_state: bool = False) -> dict[str, str]:
    """``root/checkpoint/step-10`` (DCP) and ``root/assets`` (config.json); returns the
    rule's sources, ``model`` and ``hf_assets``."""
    from ckptxform.ops.decode import require_torch

    torch = require_torch("the DCP stand-ins (torch.distributed.checkpoint.save)")
    import warnings

    import torch.distributed.checkpoint as dcp

    root = Path(root)
    state: dict[str, object] = {
        s.key: torch.from_numpy(seeded_values(s, seed).view("uint16")).view(torch.bfloat16)
        if s.dtype == "bfloat16" else torch.from_numpy(seeded_values(s, seed))
        for s in torchtitan_llama_specs(dims, layout)}
    if training_state:  # the entries torchtitan's CheckpointManager saves beside the model
        state["optimizer"] = {"state": {k: {"exp_avg": torch.zeros(v.shape), "step": torch.tensor(10.0)}
                                        for k, v in list(state.items())[:2]},
                              "param_groups": {"lr": 3e-4}}
        state["lr_scheduler"] = {"last_epoch": 10, "_step_count": 11}
        state["dataloader"] = {"world_size": 1, "dp_rank_0": b"\x00"}
        state["train_state"] = {"step": 10, "ntokens_seen": 40960}
    model = root / "checkpoint" / "step-10"
    with warnings.catch_warnings():  # "torch.distributed is disabled ... assuming a single process"
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(model))
    assets = root / "assets"
    assets.mkdir(parents=True, exist_ok=True)
    write_json(assets / "config.json", _decoder_config("LlamaForCausalLM", "llama", dims, tied=False,
                                                       rope_theta=500000.0, max_positions=131072,
                                                       head_dim=dims.head_dim, attention_bias=False,
                                                       mlp_bias=False))
    write_json(assets / "generation_config.json", _GENERATION)
    return {"model": str(model), "hf_assets": str(assets)}


def megatron_gpt_specs(d: LmDims, *, moe: bool = False) -> list[TensorSpec]:
    """The tensors megatron-core's GPTModel saves under torch_dist, by their sharded keys: a
    layer's stacked over dim 0 (and an MoE layer's experts over dim 1, SequentialMLP's layout)."""
    layers, qkv = d.layers, (d.heads + 2 * d.kv_heads) * d.head_dim

    def spec(key: str, shape: tuple[int, ...], fill: str = "linear") -> TensorSpec:
        return TensorSpec(key, shape, "float32", fill)

    specs = [spec("embedding.word_embeddings.weight", (d.vocab, d.hidden)),
             spec("decoder.final_layernorm.weight", (d.hidden,), "norm"),
             spec("output_layer.weight", (d.vocab, d.hidden)),
             spec("decoder.layers.self_attention.linear_qkv.weight", (layers, qkv, d.hidden)),
             spec("decoder.layers.self_attention.linear_qkv.layer_norm_weight", (layers, d.hidden), "norm"),
             spec("decoder.layers.self_attention.linear_proj.weight", (layers, d.hidden, d.hidden))]
    if not moe:
        return specs + [spec("decoder.layers.mlp.linear_fc1.weight", (layers, 2 * d.intermediate, d.hidden)),
                        spec("decoder.layers.mlp.linear_fc1.layer_norm_weight", (layers, d.hidden), "norm"),
                        spec("decoder.layers.mlp.linear_fc2.weight", (layers, d.hidden, d.intermediate))]
    e = d.experts
    return specs + [spec("decoder.layers.pre_mlp_layernorm.weight", (layers, d.hidden), "norm"),
                    spec("decoder.layers.mlp.router.weight", (layers, e, d.hidden)),
                    spec("decoder.layers.mlp.experts.experts.linear_fc1.weight",
                         (layers, e, 2 * d.intermediate, d.hidden)),
                    spec("decoder.layers.mlp.experts.experts.linear_fc2.weight",
                         (layers, e, d.hidden, d.intermediate))]


def build_megatron_gpt(root: str | Path, dims: LmDims = LM_TINY, *, seed: int = 0, moe: bool = False) -> dict[str, str]:
    """A Megatron-LM save directory in the torch_dist layout megatron-core's
    ``dist_checkpointing.save`` writes (tests/megatron_fixture.py saves a real one): the
    layers' tensors stacked over dim 0 under Megatron's names, ``_extra_state`` objects,
    ``metadata.json``, and the training ``args`` in ``common.pt``; one rank. ``moe``: every
    layer's MLP a mixture of ``dims.experts`` experts (top-2 softmax routing), Mixtral-style."""
    import argparse
    import json
    import warnings

    from ckptxform.ops.decode import require_torch

    torch = require_torch("the torch_dist stand-ins (torch.distributed.checkpoint.save)")
    import torch.distributed.checkpoint as dcp

    d = dims
    state: dict[str, object] = {s.key: torch.from_numpy(seeded_values(s, seed)) for s in megatron_gpt_specs(d, moe=moe)}
    state["decoder.layers.self_attention.linear_qkv._extra_state/shard_0_1"] = None
    iteration = Path(root) / "iter_0000010"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(iteration))
    (iteration / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                         "common_backend": "torch", "common_backend_version": 1}))
    experts = dict(num_experts=d.experts, moe_router_topk=2, moe_ffn_hidden_size=d.intermediate, moe_layer_freq=1,
                   moe_router_score_function="softmax", moe_router_pre_softmax=False,
                   moe_shared_expert_intermediate_size=None) if moe else dict(num_experts=None)
    args = argparse.Namespace(num_layers=d.layers, hidden_size=d.hidden, ffn_hidden_size=d.intermediate,
                              num_attention_heads=d.heads, num_query_groups=d.kv_heads, kv_channels=d.head_dim,
                              padded_vocab_size=d.vocab, max_position_embeddings=4096, norm_epsilon=1e-5,
                              rotary_base=500000, swiglu=True, normalization="RMSNorm",
                              untie_embeddings_and_output_weights=True, params_dtype=torch.float32, **experts)
    torch.save({"args": args, "iteration": 10, "checkpoint_version": 3.0}, iteration / "common.pt")
    (Path(root) / "latest_checkpointed_iteration.txt").write_text("10")
    return {"model": str(root)}
