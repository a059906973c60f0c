"""The DCP scenario of bench.py: a torchtitan-layout Llama checkpoint of a given size saved
by torch's ``dcp.save`` as 2 ranks (every tensor split between the rank files by dim 0,
as FSDP2 saves it), converted to HF by torchtitan_llama_to_hf, against ``cp -r`` of the
directory and the naive path: torch's own ``dcp_to_torch_save`` (the whole checkpoint into
one .pt) followed by a load, the renames and RoPE permutes of to_hf, and a safetensors save.

Each half is a real single-process ``dcp.save``; their metadata is joined as a 2-rank
save's is (the half of each tensor a chunk at its offset, in its own ``__R_0.distcp``),
so a 2 GB checkpoint is built without a process group and never whole in memory.
"""

from __future__ import annotations

import json
import pickle
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

NAIVE = '''
import json, sys, torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
src, assets, out = sys.argv[1:4]
dcp_to_torch_save(src, out + ".pt")
state = torch.load(out + ".pt", weights_only=True)
cfg = json.load(open(assets + "/config.json"))
def permute(w, n):
    return w.view(n, w.shape[0] // n // 2, 2, w.shape[1]).transpose(1, 2).reshape(w.shape).clone()
names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
         "lm_head.weight": "lm_head.weight"}
part = {"attention.qkv_linear.wq": "self_attn.q_proj", "attention.qkv_linear.wk": "self_attn.k_proj",
        "attention.qkv_linear.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
        "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj", "feed_forward.w3": "mlp.up_proj",
        "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
hf = {}
for key, value in state.items():
    if key in names:
        hf[names[key]] = value
        continue
    _, n, rest = key.split(".", 2)
    name, _ = rest.rsplit(".", 1)
    if name == "attention.qkv_linear.wq":
        value = permute(value, cfg["num_attention_heads"])
    if name == "attention.qkv_linear.wk":
        value = permute(value, cfg["num_key_value_heads"])
    hf[f"model.layers.{n}.{part[name]}.weight"] = value.contiguous()
import os
os.makedirs(out, exist_ok=True)
save_file(hf, out + "/model.safetensors")
os.remove(out + ".pt")
'''


def dims_for(size: int) -> dict[str, int]:
    """Llama-like widths whose bf16 checkpoint is about ``size`` bytes (8 layers)."""
    vocab = 32000 if size >= 10**8 else 1024  # a smoke run's few MB
    hidden = 512
    while 2 * (8 * 12.5 * hidden * hidden + 2 * vocab * hidden) < size:
        hidden += 512
    return {"hidden": hidden, "heads": hidden // 128, "kv_heads": hidden // 512, "layers": 8,
            "intermediate": hidden * 3, "vocab": vocab}


def build(root: Path, size: int) -> dict[str, Path]:
    """``root/ckpt`` (DCP, 2 rank files) and ``root/assets`` (config.json)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    from ckptxform.standins.dcp_checkpoints import torchtitan_llama_specs
    from ckptxform.standins.hf_models import LmDims, _decoder_config

    d = dims_for(size)
    dims = LmDims(hidden=d["hidden"], heads=d["heads"], kv_heads=d["kv_heads"], layers=d["layers"],
                  intermediate=d["intermediate"], vocab=d["vocab"])
    specs = torchtitan_llama_specs(dims)
    gen = torch.Generator().manual_seed(0)
    ckpt = root / "ckpt"
    for rank in (0, 1):
        halves = {}
        for spec in specs:
            rows = spec.shape[0]
            first = (rows + 1) // 2
            count = first if rank == 0 else rows - first
            halves[spec.key] = torch.randn((count, *spec.shape[1:]), generator=gen).to(torch.bfloat16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(halves, checkpoint_id=str(root / f"rank{rank}"))
        del halves
    meta = pickle.loads((root / "rank0" / ".metadata").read_bytes())
    other = pickle.loads((root / "rank1" / ".metadata").read_bytes())
    shutil.move(str(root / "rank0"), str(ckpt))
    shutil.move(str(root / "rank1" / "__0_0.distcp"), str(ckpt / "__1_0.distcp"))
    for spec in specs:
        item = meta.state_dict_metadata[spec.key]
        first = (spec.shape[0] + 1) // 2
        offsets = [first] + [0] * (len(spec.shape) - 1)
        item.size = torch.Size(spec.shape)
        item.chunks.append(ChunkStorageMetadata(torch.Size(offsets), other.state_dict_metadata[spec.key].size))
        info = next(v for k, v in other.storage_data.items() if k.fqn == spec.key)
        info.relative_path = "__1_0.distcp"
        meta.storage_data[MetadataIndex(spec.key, offsets)] = info
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
    shutil.rmtree(root / "rank1")
    assets = root / "assets"
    assets.mkdir(parents=True, exist_ok=True)
    (assets / "config.json").write_text(json.dumps(_decoder_config(
        "LlamaForCausalLM", "llama", dims, tied=False, rope_theta=500000.0, max_positions=8192,
        head_dim=dims.head_dim)))
    return {"ckpt": ckpt, "assets": assets}


def contenders(work: Path, src: dict[str, Path], py: str, rule: Path) -> dict[str, Callable[[Path], list[str]]]:
    naive = work / "naive_dcp.py"
    naive.write_text(NAIVE)
    return {
        "cp -r dcp": lambda out: ["cp", "-r", str(src["ckpt"]), str(out)],
        "naive dcp_to_torch_save + convert": lambda out: [py, str(naive), str(src["ckpt"]), str(src["assets"]),
                                                          str(out)],
        "ckptxform torchtitan_llama_to_hf": lambda out: [
            py, "-m", "ckptxform", "-q", "apply", str(rule), f"--source=model={src['ckpt']}",
            f"--source=hf_assets={src['assets']}", "--out", str(out), "--no-fsync"],
    }
