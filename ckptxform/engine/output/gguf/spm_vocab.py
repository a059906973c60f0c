"""The tokenizer metadata llama.cpp's converter writes for a SentencePiece (``llama``)
vocabulary: tokens, scores and token types from ``tokenizer.model``, overridden by
``added_tokens.json`` and ``tokenizer_config.json``'s ``added_tokens_decoder``, padded
to the config's ``vocab_size`` with ``[PADn]``; then gguf-py's own ``SpecialVocab``
(bos/eos/unk/pad ids, add_bos/add_eos, the chat template, from the same files)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ....errors import CheckpointFormatError
from .spm_model import BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED, USER_DEFINED, read_pieces


def looks_special(text: str) -> bool:
    """An added token llama.cpp marks CONTROL although its file does not say special."""
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<｜") and text.endswith("｜>"))
            or (text.startswith("<unused") and text.endswith(">")))


def spm_vocab(folder: Path, vocab_size: int | None) -> tuple[list[bytes], list[float], list[int]]:
    """Tokens, scores and types of the SentencePiece vocabulary in ``folder``."""
    path = folder / "tokenizer.model"
    pieces = read_pieces(path.read_bytes(), str(path))
    size = vocab_size or len(pieces)
    tokens = [f"[PAD{i}]".encode() for i in range(size)]
    scores = [-10000.0] * size
    types = [UNUSED] * size
    for i, piece in enumerate(pieces[:size]):
        tokens[i] = piece.text.encode("utf-8")
        scores[i] = piece.score
        types[i] = piece.type if piece.type in (UNKNOWN, CONTROL, UNUSED, BYTE) else NORMAL
    added = _json(folder / "added_tokens.json")
    for text, token_id in (added or {}).items():
        if isinstance(token_id, int) and token_id < size:
            tokens[token_id], scores[token_id], types[token_id] = text.encode("utf-8"), -1000.0, USER_DEFINED
    config = _json(folder / "tokenizer_config.json") or {}
    for token_id, data in (config.get("added_tokens_decoder") or {}).items():
        index = int(token_id)
        if index >= size:
            continue
        text: str = data["content"]
        if data.get("special") or looks_special(text):
            types[index] = CONTROL
        else:
            text = text.replace("\u2581", " ")  # llama.cpp pre-normalizes user-defined spaces
            types[index] = USER_DEFINED
        scores[index], tokens[index] = -1000.0, text.encode("utf-8")
    return tokens, scores, types


def add_spm_tokenizer(writer: Any, folder: Path, vocab_size: int | None) -> None:
    """Write the tokenizer key/values of ``folder``'s SentencePiece model into ``writer``."""
    import gguf

    tokens, scores, types = spm_vocab(folder, vocab_size)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, n_vocab=len(tokens)).add_to_gguf(writer)


def _json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text("utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointFormatError(f"{path}: not JSON ({err})", path=str(path)) from None
