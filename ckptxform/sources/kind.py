"""Which kind of checkpoint a local path is, from its file names and small metadata files
alone (no weight file is opened): what ``ckptxform inspect`` says first.

>>> CheckpointKind("dcp", "x", "").label
'torch.distributed.checkpoint (DCP)'
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ckptxform.errors import SourceNotFoundError
from ckptxform.fileio import read_small_file
from ckptxform.sources.strict_json import parse_json_object

LABELS = {
    "safetensors": "safetensors",
    "bin": "PyTorch .bin/.pt/.pth (pickled state dict)",
    "dcp": "torch.distributed.checkpoint (DCP)",
    "torch_dist": "Megatron-Core torch_dist (DCP + metadata.json, common.pt)",
    "megatron": "Megatron-LM save directory",
    "consolidated": "Meta consolidated.NN.pth (model-parallel shards)",
    "gguf": "GGUF (llama.cpp)",
    "assets": "config and tokenizer files, no weights",
    "peft_adapter": "PEFT LoRA adapter (adapter_config.json + adapter_model)",
    "unknown": "no checkpoint found",
}
_CONSOLIDATED = re.compile(r"consolidated\.(\d\d)\.pth")


@dataclass(frozen=True)
class CheckpointKind:
    kind: str
    path: str
    #: what else was found (rank files, the iteration a Megatron save points at)
    detail: str

    @property
    def label(self) -> str:
        return LABELS[self.kind]


def detect_kind(path: Path) -> CheckpointKind:
    """The kind of the checkpoint at local ``path`` (a directory or a weight file)."""
    if not path.is_dir():
        if path.name.endswith(".gguf"):
            return CheckpointKind("gguf", str(path), "")
        suffix = ".safetensors" if path.name.endswith((".safetensors", ".safetensors.index.json")) else None
        return CheckpointKind("safetensors" if suffix else "bin", str(path), "")
    names = {p.name for p in path.iterdir()}
    if "adapter_config.json" in names:
        return CheckpointKind("peft_adapter", str(path), "")
    if ".metadata" in names:
        ranks = sorted(n for n in names if n.endswith(".distcp"))
        detail = f"{len(ranks)} .distcp file(s)"
        if "metadata.json" in names and _backend(path / "metadata.json") == "torch_dist":
            return CheckpointKind("torch_dist", str(path), detail + (", common.pt" if "common.pt" in names else ""))
        return CheckpointKind("dcp", str(path), detail)
    if "latest_checkpointed_iteration.txt" in names:
        latest = read_small_file(path / "latest_checkpointed_iteration.txt", 64, what="a Megatron iteration file")
        return CheckpointKind("megatron", str(path), f"latest iteration {latest.decode(errors='replace').strip()!r}")
    shards = sorted(n for n in names if _CONSOLIDATED.fullmatch(n))
    if shards:
        return CheckpointKind("consolidated", str(path), f"MP={len(shards)}" +
                              (", params.json" if "params.json" in names else ""))
    if any(n.endswith(".safetensors") for n in names):
        return CheckpointKind("safetensors", str(path), "")
    ggufs = sorted(n for n in names if n.endswith(".gguf"))
    if ggufs:
        return CheckpointKind("gguf", str(path), f"{len(ggufs)} .gguf file(s)")
    if any(n.endswith((".bin", ".pt", ".pth")) for n in names):
        return CheckpointKind("bin", str(path), "")
    if "config.json" in names:
        return CheckpointKind("assets", str(path), "")
    return CheckpointKind("unknown", str(path), "")


def megatron_iteration(path: Path) -> Path:
    """The iteration directory a Megatron-LM save directory's latest_checkpointed_iteration.txt
    names: ``iter_0001000`` for ``1000``, ``release`` for ``release``."""
    text = read_small_file(path / "latest_checkpointed_iteration.txt", 64, what="a Megatron iteration file")
    latest = text.decode(errors="replace").strip()
    name = "release" if latest == "release" else f"iter_{int(latest):07d}" if latest.isascii() and latest.isdigit() else None
    if name is None or not (path / name).is_dir():
        raise SourceNotFoundError(f"{path / 'latest_checkpointed_iteration.txt'}: names iteration {latest!r}, but "
                                  f"{path / (name or '?')} is not there; give the iteration directory itself",
                                  path=str(path))
    return path / name


def _backend(path: Path) -> str | None:
    """The ``sharded_backend`` Megatron's metadata.json names; a damaged one is refused (read
    as plain DCP it would lose the checkpoint's common.pt)."""
    try:
        blob = read_small_file(path, 1 << 20, what="a metadata.json")
    except OSError:
        return None
    data = parse_json_object(blob, str(path), what="Megatron's metadata.json",
                             fix="it names the backend that saved the checkpoint ({\"sharded_backend\": "
                                 "\"torch_dist\"}); re-copy it from the checkpoint")
    return data.get("sharded_backend")
