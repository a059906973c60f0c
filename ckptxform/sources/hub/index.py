"""A Hub repo's small JSON files (config.json), read strictly. (Its tensor index, which
reads a shard's header only when one of its tensors is looked up, is
``ckptxform.sources.lazy_index``: local sharded checkpoints share it.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckptxform.sources.strict_json import parse_json_object

__all__ = ["load_json"]


def load_json(path: Path, label: str) -> dict[str, Any]:
    """A repo's ``config.json``, read strictly (duplicate keys and NaN refused)."""
    return parse_json_object(path.read_bytes(), label, what="config", fix="re-upload it")
