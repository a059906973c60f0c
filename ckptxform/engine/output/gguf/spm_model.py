"""The pieces of a SentencePiece ``tokenizer.model`` (a serialized ``ModelProto``), read
without the sentencepiece library: field 1 of the model is each piece, whose fields are
1 the text, 2 the score (float32) and 3 the type (NORMAL when absent)."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ....errors import CheckpointFormatError

#: sentencepiece's ModelProto.SentencePiece.Type
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


@dataclass(frozen=True)
class Piece:
    text: str
    score: float
    type: int


def _varint(data: bytes, pos: int, what: str) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise CheckpointFormatError(f"{what}: not a SentencePiece model (a varint runs past the end)")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _fields(data: bytes, what: str) -> list[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of one protobuf message, in order."""
    out: list[tuple[int, int, int | bytes]] = []
    pos = 0
    while pos < len(data):
        tag, pos = _varint(data, pos, what)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = _varint(data, pos, what)
            out.append((number, wire, value))
        elif wire == 2:
            length, pos = _varint(data, pos, what)
            if pos + length > len(data):
                raise CheckpointFormatError(f"{what}: not a SentencePiece model (a field runs past the end)")
            out.append((number, wire, data[pos:pos + length]))
            pos += length
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            if pos + size > len(data):
                raise CheckpointFormatError(f"{what}: not a SentencePiece model (a field runs past the end)")
            out.append((number, wire, data[pos:pos + size]))
            pos += size
        else:
            raise CheckpointFormatError(f"{what}: not a SentencePiece model (protobuf wire type {wire})")
    return out


def read_pieces(data: bytes, what: str) -> list[Piece]:
    """The pieces of a serialized ModelProto, by id; ``what`` names the file in errors."""
    pieces = []
    for number, wire, value in _fields(data, what):
        if number != 1 or wire != 2:
            continue
        text, score, kind = None, 0.0, NORMAL
        assert isinstance(value, bytes)
        for sub, sub_wire, sub_value in _fields(value, what):
            if sub == 1 and sub_wire == 2:
                assert isinstance(sub_value, bytes)
                try:
                    text = sub_value.decode("utf-8")
                except UnicodeDecodeError:
                    raise CheckpointFormatError(f"{what}: piece {len(pieces)} is not UTF-8") from None
            elif sub == 2 and sub_wire == 5:
                score = struct.unpack("<f", sub_value)[0]  # type: ignore[arg-type]
            elif sub == 3 and sub_wire == 0:
                kind = int(sub_value)  # type: ignore[arg-type]
        if text is None:
            raise CheckpointFormatError(f"{what}: piece {len(pieces)} has no text; not a SentencePiece model")
        pieces.append(Piece(text, score, kind))
    if not pieces:
        raise CheckpointFormatError(f"{what}: no pieces; not a SentencePiece model")
    return pieces


def write_model(pieces: list[Piece]) -> bytes:
    """A ModelProto holding ``pieces`` (and a normalizer spec adding the dummy prefix, as
    Llama's has): what the stand-ins ship as tokenizer.model."""
    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            byte = n & 0x7F
            n >>= 7
            out.append(byte | (0x80 if n else 0))
            if not n:
                return bytes(out)

    def field(number: int, payload: bytes) -> bytes:
        return varint(number << 3 | 2) + varint(len(payload)) + payload

    body = b""
    for p in pieces:
        text = p.text.encode("utf-8")
        piece = field(1, text) + varint(2 << 3 | 5) + struct.pack("<f", p.score)
        if p.type != NORMAL:
            piece += varint(3 << 3) + varint(p.type)
        body += field(1, piece)
    # trainer_spec: model_type BPE (2), byte_fallback; normalizer_spec: identity, add_dummy_prefix
    trainer = varint(3 << 3) + varint(2) + varint(35 << 3) + varint(1)
    normalizer = field(1, b"identity") + varint(3 << 3) + varint(1)
    return body + field(2, trainer) + field(3, normalizer)
