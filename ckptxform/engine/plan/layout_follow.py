"""The output's files when the rule does not say (no ``output.max_shard_size``,
``file_name`` or ``shards``): those of the converted source.

A release converted tensor by tensor comes out sharded as it came in, as the conversion
scripts shipped with such releases write it (DeepSeek's ``fp8_cast_bf16.py``): each output
tensor goes into the file made from the source file that holds the first tensor of the
converted source it is made from, and an output made from none (a constant, another
source's tensor) into the last file. The files are named as ``save_pretrained`` names
them (``model-00001-of-00064.safetensors`` and an index; ``model.safetensors`` for one),
numbered in the source's file order, and a source file no output comes from has no file.

A converted source that is not a set of Hugging Face weight files (a DCP or Megatron save,
model-parallel shards, a GGUF), or has none, is packed as ``save_pretrained`` packs:
shards of at most 50 GB (transformers 5's default) in plan order.
"""

from __future__ import annotations

from array import array

from ...sources.model_parallel import ModelParallelCheckpoint
from .layout import KeyScan, compact_ranks
from .opened import OpenSources
from .planner import Plan

#: ``save_pretrained``'s ``max_shard_size`` (transformers 5: "50GB", decimal as its own parse)
SAVE_PRETRAINED_SHARD_SIZE = 50 * 10**9
#: the weight files a ``save_pretrained`` (or ``torch.save``) model is sharded in
_HF_WEIGHT_FILES = (".safetensors", ".bin")


def source_file_groups(plan: Plan, sources: OpenSources) -> tuple[list[range | array], bool] | None:  # type: ignore[type-arg]
    """The ranks of ``plan.outputs`` grouped by the converted source's file each is made
    from, in that source's file order (see the module's docstring; a group is a range
    when its ranks are one run, else ``array('I')``), and whether the outputs' keys came in
    order (``KeyScan``); None when the converted source is not Hugging Face weight files,
    and then the caller packs."""
    name = plan.rules.convert
    ckpt = sources.checkpoints.get(name) if name is not None else None
    if ckpt is None or isinstance(ckpt, ModelParallelCheckpoint) or not ckpt.files \
            or not all(f.endswith(_HF_WEIGHT_FILES) for f in ckpt.files):
        return None
    order = {file: n for n, file in enumerate(ckpt.files)}
    last = len(ckpt.files) - 1
    scan = KeyScan()
    groups: dict[int, array] = {}  # type: ignore[type-arg]
    for rank, output in enumerate(plan.outputs):
        scan.see(output)
        home = last
        for ref in output.recipe.inputs:
            if ref.source == name and ref.shard is None:
                home = order.get(ckpt.file_of(ref.key), last)  # from the index: no header read
                break
        groups.setdefault(home, array("I")).append(rank)
    return [compact_ranks(groups[n]) for n in sorted(groups)] or [range(0)], scan.finish(plan.outputs)
