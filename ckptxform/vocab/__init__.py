"""Draft vocabularies: the maps (``maps``), their checks (``checks``) and ``vocab-diff`` (``diff``)."""

from .maps import Alignment, Encoding, VocabMap, vocab_map_from_bytes

__all__ = ["Alignment", "Encoding", "VocabMap", "vocab_map_from_bytes"]
