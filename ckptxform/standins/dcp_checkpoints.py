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
from ckptxform.standins.tensors import TensorSpec, seeded_values, write_json


def torchtitan_llama_specs(d: LmDims, layout: Literal["0.2", "0.3"] = "0.3") -> list[TensorSpec]:
    """The tensors of torchtitan's Llama3Model, by its state-dict names."""
    qkv = "qkv_linear." if layout == "0.3" else ""
    specs = [TensorSpec("tok_embeddings.weight", (d.vocab, d.hidden), d.dtype, "linear"),
             TensorSpec("norm.weight", (d.hidden,), d.dtype, "norm"),
             TensorSpec("lm_head.weight", (d.vocab, d.hidden), d.dtype, "linear")]
    for n in range(d.layers):
        a, f = f"layers.{n}.attention.", f"layers.{n}.feed_forward."
        specs += [TensorSpec(f"{a}{qkv}wq.weight", (d.heads * d.head_dim, d.hidden), d.dtype, "linear"),
                  TensorSpec(f"{a}{qkv}wk.weight", (d.kv_heads * d.head_dim, d.hidden), d.dtype, "linear"),
                  TensorSpec(f"{a}{qkv}wv.weight", (d.kv_heads * d.head_dim, d.hidden), d.dtype, "linear"),
                  TensorSpec(f"{a}wo.weight", (d.hidden, d.heads * d.head_dim), d.dtype, "linear"),
                  TensorSpec(f"{f}w1.weight", (d.intermediate, d.hidden), d.dtype, "linear"),
                  TensorSpec(f"{f}w2.weight", (d.hidden, d.intermediate), d.dtype, "linear"),
                  TensorSpec(f"{f}w3.weight", (d.intermediate, d.hidden), d.dtype, "linear"),
                  TensorSpec(f"layers.{n}.attention_norm.weight", (d.hidden,), d.dtype, "norm"),
                  TensorSpec(f"layers.{n}.ffn_norm.weight", (d.hidden,), d.dtype, "norm")]
    return specs


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
