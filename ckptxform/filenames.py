"""Names of the files ckptxform writes into an output directory, shared by the planner (which
keeps a rule's ``files`` off them) and the output part (which writes them); and of the files
that define what a checkpoint directory is, which a rule's ``files`` never copies."""

import re

#: the audit log, one JSON object per line
AUDIT_FILE = "ckptxform_audit.jsonl"
#: the model config a rule's ``config`` section writes (``output.config_file`` may rename it)
CONFIG_FILE = "config.json"

#: files whose presence makes a directory read as a kind of checkpoint (sources/kind.py and
#: the loaders look for them), and why: copied beside the output's weights, the output would
#: read as that kind, with none of its weights
DEFINING_FILES = {
    ".metadata": "the index of a PyTorch DCP checkpoint: the output would read as a DCP checkpoint with no weights",
    "metadata.json": "Megatron's marker of a torch_dist checkpoint: the output would read as one",
    "common.pt": "Megatron's run state of a torch_dist checkpoint: the output would read as one",
    "latest_checkpointed_iteration.txt": "Megatron's pointer to its latest iteration: the output would read as a "
                                         "Megatron save directory",
    "adapter_config.json": "a PEFT adapter's config: the output would read as an adapter",
}
_WEIGHT_INDEX = re.compile(r".*\.(safetensors|bin)\.index\.json")


def defining_file_reason(path: str) -> str | None:
    """Why the file at ``path`` (relative, ``/``-separated) defines what its directory is,
    or None: a checkpoint-kind marker (``DEFINING_FILES``) or a weight index."""
    name = path.rsplit("/", 1)[-1]
    if name in DEFINING_FILES:
        return DEFINING_FILES[name]
    if _WEIGHT_INDEX.fullmatch(name):
        return "the source's weight index, naming the source's shards: the output writes the index of its own"
    return None
