"""A bounded walk over a GGUF file's header before gguf-py parses it.

gguf-py's ``GGUFReader`` trusts the header's counts: an array claiming 2**62 items past
the end of the file loops for ever (each item past the end reads as zero bytes), an array
of arrays nested 100,000 deep recurses out of the stack, a tensor's dims overflow numpy's
uint64 product. This walk reads the same layout (llama.cpp's gguf.cpp: magic, version,
tensor and key/value counts, each key/value, each tensor info) with Python integers and
checks each count against the bytes left before anything is allocated or looped over,
so that every damaged header is one ``CheckpointFormatError`` naming the file, the
offset and what is wrong.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

from ckptxform.errors import CheckpointFormatError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
#: scalar value types (GGUFValueType) and their sizes in bytes; 8 is STRING, 9 ARRAY
SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY, UINT32 = 8, 9, 4
#: the fewest bytes a value of a type takes (a string or array: its 8-byte length, an array also its type)
MIN_SIZES = {**SCALAR_SIZES, STRING: 8, ARRAY: 12}
#: arrays of arrays deeper than this are refused (llama.cpp reads none; gguf-py recurses per level)
MAX_ARRAY_DEPTH = 16
#: GGML_MAX_DIMS
MAX_DIMS = 4
#: a key/value holds at least an empty key (8), its type (4) and a one-byte value
MIN_KV, MIN_TENSOR_INFO = 13, 24
DEFAULT_ALIGNMENT = 32


class HeaderPastEnd(CheckpointFormatError):
    """The header reads past the bytes given (``at`` the offset): truncated, or more is needed."""

    def __init__(self, message: str, *, at: int, path: str) -> None:
        super().__init__(message, path=path)
        self.at = at


@dataclass(frozen=True)
class TensorSpan:
    """Where a tensor's bytes are, as its header entry says."""

    name: str
    type_id: int
    dims: tuple[int, ...]
    offset: int  # from the start of the data section


@dataclass(frozen=True)
class GgufLayout:
    """What the walk found: the end of the header (start of the data, aligned), the tensors."""

    data_offset: int
    tensors: tuple[TensorSpan, ...]


class _Walk:
    def __init__(self, read: Callable[[int, int], bytes], size: int, label: str) -> None:
        self.read, self.size, self.label, self.at = read, size, label, 0
        self.order = "<"

    def fail(self, what: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{self.label}: not a readable GGUF file (byte {self.at}: {what}); "
                                     "re-download it", path=self.label)

    def take(self, count: int) -> bytes:
        data = self.read(self.at, self.at + count) if self.at + count <= self.size else b""
        if len(data) < count:
            raise HeaderPastEnd(f"{self.label}: not a readable GGUF file (its header needs byte {self.at + count}, "
                                f"past the file's {self.size}: truncated); re-download it",
                                at=self.at + count, path=self.label)
        self.at += count
        return data

    def uint(self, width: int) -> int:
        return int(struct.unpack(self.order + {4: "I", 8: "Q"}[width], self.take(width))[0])

    def count(self, what: str, least: int) -> int:
        """A count of items of at least ``least`` bytes each, checked against the bytes left."""
        n = self.uint(8)
        if n * least > self.size - self.at:
            raise self.fail(f"{what} says {n:,} items, but the {self.size - self.at:,} bytes left hold at most "
                            f"{(self.size - self.at) // least:,}")
        return n

    def string(self, what: str) -> bytes:
        return self.take(self.count(f"the length of {what}", 1))

    def text(self, what: str) -> str:
        raw = self.string(what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} is not UTF-8 ({exc.reason} at its byte {exc.start})") from None

    def value(self, type_id: int, key: str, depth: int = 0) -> int | None:
        """Skip one value of ``type_id``; a UINT32's value is returned (general.alignment)."""
        if type_id in SCALAR_SIZES:
            return self.uint(4) if type_id == UINT32 else (self.take(SCALAR_SIZES[type_id]) and None)
        if type_id == STRING:
            self.string(f"a string of {key!r}")
            return None
        if type_id != ARRAY:
            raise self.fail(f"{key!r} has value type {type_id}, which GGUF does not define (0-12)")
        if depth >= MAX_ARRAY_DEPTH:
            raise self.fail(f"{key!r} nests arrays more than {MAX_ARRAY_DEPTH} deep")
        item = self.uint(4)
        if item not in MIN_SIZES:
            raise self.fail(f"{key!r} is an array of value type {item}, which GGUF does not define (0-12)")
        n = self.count(f"the array {key!r}", MIN_SIZES[item])
        if item in SCALAR_SIZES:
            self.take(n * SCALAR_SIZES[item])
        else:
            for _ in range(n):
                self.value(item, key, depth + 1)
        return None


def walk_gguf_header(read: Callable[[int, int], bytes], size: int, label: str,
                     block_sizes: dict[int, tuple[int, int]]) -> GgufLayout:
    """Check the header of the GGUF file of ``size`` bytes that ``read(start, stop)`` reads.

    ``block_sizes``: tensor type id -> (values per block, bytes per block) (gguf-py's
    GGML_QUANT_SIZES). Raises ``CheckpointFormatError`` (``HeaderPastEnd`` when the header
    runs past ``size``) naming ``label``."""
    w = _Walk(read, size, label)
    if w.take(4) != MAGIC:
        raise w.fail("no GGUF magic")
    version = w.uint(4)
    if version & 0xFFFF == 0:  # written on a big-endian machine, as gguf-py detects it
        w.order, version = ">", struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in VERSIONS:
        raise w.fail(f"GGUF version {version}, not one of {', '.join(map(str, VERSIONS))}")
    tensor_count, kv_count = w.uint(8), w.count("the key/value count", MIN_KV)
    alignment = DEFAULT_ALIGNMENT
    for _ in range(kv_count):
        key = w.text("a key")
        type_id = w.uint(4)
        value = w.value(type_id, key)
        if key == "general.alignment":
            if type_id != UINT32 or not value or value & (value - 1):
                raise w.fail(f"general.alignment must be a UINT32 power of two, not type {type_id} value {value}")
            alignment = value
    if tensor_count * MIN_TENSOR_INFO > size - w.at:
        raise w.fail(f"the tensor count says {tensor_count:,} tensors, but the {size - w.at:,} bytes left hold "
                     f"at most {(size - w.at) // MIN_TENSOR_INFO:,} tensor entries")
    spans = [_tensor_info(w, block_sizes, alignment) for _ in range(tensor_count)]
    data_offset = -(-w.at // alignment) * alignment
    for span in spans:
        _check_span(w, span, block_sizes, data_offset)
    return GgufLayout(data_offset, tuple(spans))


def _tensor_info(w: _Walk, block_sizes: dict[int, tuple[int, int]], alignment: int) -> TensorSpan:
    name = w.text("a tensor name")
    n_dims = w.uint(4)
    if not 0 < n_dims <= MAX_DIMS:
        raise w.fail(f"tensor {name!r} has {n_dims} dimensions (GGUF allows 1-{MAX_DIMS})")
    dims = tuple(w.uint(8) for _ in range(n_dims))
    type_id = w.uint(4)
    if type_id not in block_sizes:
        raise w.fail(f"tensor {name!r} has type id {type_id}, which is no GGML type this gguf-py knows")
    offset = w.uint(8)
    if offset % alignment:
        raise w.fail(f"tensor {name!r} starts at data offset {offset}, not a multiple of the alignment {alignment}")
    return TensorSpan(name, type_id, dims, offset)


def _check_span(w: _Walk, span: TensorSpan, block_sizes: dict[int, tuple[int, int]], data_offset: int) -> None:
    block, type_size = block_sizes[span.type_id]
    if span.dims[0] % block:
        raise w.fail(f"tensor {span.name!r} has rows of {span.dims[0]} values, not whole blocks of {block}")
    count = 1
    for d in span.dims:
        count *= d
    end = data_offset + span.offset + count // block * type_size
    if end > w.size:
        raise CheckpointFormatError(f"{w.label}: tensor {span.name!r} ends at byte {end}, past the file's "
                                    f"{w.size}; it is truncated (re-download it)", path=w.label, key=span.name)
