"""llama.cpp's GGUF files as a source: one ``.gguf`` file, or a split set
(``NAME-00001-of-00003.gguf`` ..), indexed from its header with gguf-py's ``GGUFReader``
(memory-mapped: only the header's pages are touched) and read by byte range like a
safetensors file.

What the planner sees of each tensor (a plain ``TensorInfo``; the checkpoint's
``ggml_types`` and ``logical_shapes`` say the rest):
  - F32, F16, BF16 (and the integer types): their safetensors dtype and the logical shape,
    transformers' order (GGUF lists dims innermost first: reversed);
  - a block format (Q8_0, Q4_K, IQ2_XS, ...): ``U8`` bytes ``[*outer dims, row bytes]``,
    ``ggml_type`` naming the format; ``dequant_gguf`` decodes it.
The source's config (what a rule's ``${config.…}`` reads) is the metadata, nested at its
dots (``llama.attention.head_count`` is ``config.llama.attention.head_count``), plus
``gguf_tensor_types`` (tensor -> format), ``gguf_tensor_shapes`` (tensor -> logical shape)
and ``gguf_tied_embeddings``: true when the model has no ``output.weight`` (llama.cpp's name
of the output head in every architecture), the head then being ``token_embd.weight``, as
transformers' GGUF loader decides ``tie_word_embeddings``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptxform.errors import CheckpointFormatError, CkptxformError, SourceNotFoundError
from ckptxform.sources.base import TensorInfo
from ckptxform.sources.gguf_header import GgufLayout, HeaderPastEnd, walk_gguf_header
from ckptxform.sources.local import LocalCheckpoint, _unreadable
from ckptxform.sources.pins import FilePin, pin_path

#: llama.cpp's gguf-split names: NAME-00001-of-00003.gguf
SPLIT_NAME = re.compile(r"(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")
#: GGUF element types that are plain arrays, as safetensors names
PLAIN_DTYPES = {"F32": "F32", "F16": "F16", "BF16": "BF16", "F64": "F64", "I8": "I8", "I16": "I16",
                "I32": "I32", "I64": "I64"}
TYPES_KEY = "gguf_tensor_types"
SHAPES_KEY = "gguf_tensor_shapes"
TIED_KEY = "gguf_tied_embeddings"
#: llama.cpp's output head (LLM_TENSOR_OUTPUT); absent when the embeddings are tied
OUTPUT_HEAD = "output.weight"


@dataclass(frozen=True)
class GgufTensor:
    """A GGUF tensor: ``info`` as stored (``U8`` rows of blocks for a block format),
    ``ggml_type`` its GGUF type name, ``logical_shape`` the shape of its values."""

    info: TensorInfo
    ggml_type: str
    logical_shape: tuple[int, ...]


def is_gguf(path: Path) -> bool:
    """Whether ``path`` is a ``.gguf`` file or a directory holding some (names only)."""
    if path.is_dir():
        return any(p.name.endswith(".gguf") for p in path.iterdir())
    return path.name.endswith(".gguf")


def gguf_files(path: Path) -> tuple[Path, list[str]]:
    """The directory and the ``.gguf`` file names of the checkpoint at ``path``: the file
    itself, every part of its split set, or the one model (or split set) of a directory."""
    if path.is_dir():
        root, firsts = path, first_parts(sorted(p.name for p in path.iterdir()))
        if len(firsts) != 1:
            raise SourceNotFoundError(f"{path}: holds {len(firsts)} GGUF models ({', '.join(firsts) or 'none'}); "
                                      "give the .gguf file (the first part of a split set) itself", path=str(path))
        first = firsts[0]
    else:
        root, first = path.parent, path.name
    parts = split_parts(first)
    missing = [p for p in parts if not (root / p).is_file()]
    if missing:
        raise SourceNotFoundError(f"{root / first}: part of a split set of {len(parts)} files, but "
                                  f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not beside it; "
                                  "download every part", path=str(root / missing[0]))
    return root, parts


def open_gguf(path: str | Path, *, name: str | None = None) -> GgufCheckpoint:
    """Index the GGUF model at ``path`` (a file, the first part of a split set, or a directory)."""
    try:
        root, files = gguf_files(Path(path))
        pins: dict[str, FilePin] = {file: pin_path(root / file) for file in files}
        metadata, tensors = gguf_index([(file, *read_gguf_header(root / file, file)) for file in files], str(root))
        return GgufCheckpoint(location=str(path), name=name, root=root, tensors=tensors, files=tuple(files),
                              pins=pins, gguf_metadata=metadata)
    except CkptxformError as err:
        err.source = err.source or name
        raise
    except OSError as exc:
        raise _unreadable(exc, path, source=name) from None


def read_gguf_header(path: Path, file: str, *, label: str | None = None,
                     prefix: int | None = None) -> tuple[dict[str, Any], list[GgufTensor]] | None:
    """The metadata key/values and the tensors of one GGUF file, read with gguf-py.

    ``label`` names the file in messages (default: ``path``). ``prefix``: only the file's
    first ``prefix`` bytes are real (a Hub file's header read by range into a sparse copy);
    None is returned when the header does not end within them (read more and ask again)."""
    from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFValueType

    label = label or str(path)
    size = path.stat().st_size
    try:
        layout = _walk_header(path, size, label, size if prefix is None else prefix)
    except HeaderPastEnd:
        if prefix is not None and prefix < size:
            return None  # the header goes on past the bytes fetched so far
        raise
    if prefix is not None and layout.data_offset > prefix and prefix < size:
        return None
    try:  # the walk bounds every count; what is left is gguf-py's own checks
        reader = GGUFReader(path)
        fields: dict[str, Any] = {}
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):  # the reader's own header fields (version, counts)
                continue
            value = field.contents()
            if field.types and field.types[0] == GGUFValueType.ARRAY and not isinstance(value, list):
                value = [value]
            fields[key] = value
    except (ValueError, IndexError, KeyError, OverflowError) as exc:  # gguf-py's words for a bad file
        raise CheckpointFormatError(f"{label}: not a readable GGUF file ({exc}); re-download it",
                                    path=label) from None
    infos = []
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        logical = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if kind in PLAIN_DTYPES:
            dtype, stored = PLAIN_DTYPES[kind], logical
        else:
            block, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
            if not logical or logical[-1] % block:
                raise CheckpointFormatError(f"{label}: tensor {tensor.name!r} {list(logical)} of {kind}: its rows "
                                            f"are not whole blocks of {block}", path=label, key=tensor.name)
            dtype, stored = "U8", (*logical[:-1], logical[-1] // block * type_size)
        if tensor.data_offset + tensor.n_bytes > size:
            raise CheckpointFormatError(f"{label}: tensor {tensor.name!r} ends at byte "
                                        f"{tensor.data_offset + tensor.n_bytes}, past the file's {size}; "
                                        "it is truncated (re-download it)", path=label, key=tensor.name)
        info = TensorInfo(key=tensor.name, dtype=dtype, shape=stored, file=file, offset=int(tensor.data_offset),
                          nbytes=int(tensor.n_bytes))
        infos.append(GgufTensor(info, kind, logical))
    infos.sort(key=lambda t: t.info.offset)
    return fields, infos


def _walk_header(path: Path, size: int, label: str, readable: int) -> GgufLayout:
    """The bounded walk over ``path``'s header (its first ``readable`` bytes are real)."""
    import mmap

    from gguf import GGML_QUANT_SIZES

    blocks = {int(kind): sizes for kind, sizes in GGML_QUANT_SIZES.items()}
    if size == 0:
        raise CheckpointFormatError(f"{label}: not a readable GGUF file (it is empty); re-download it", path=label)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
        return walk_gguf_header(lambda start, stop: view[start:min(stop, readable)], size, label, blocks)


def read_gguf_prefix(read: Callable[[int, int], bytes], size: int, file: str, label: str,
                     first: int = 256 * 1024) -> tuple[dict[str, Any], list[GgufTensor]]:
    """A GGUF file's header from its first bytes only, ``read(start, stop)`` giving them
    (a Hub file's byte ranges): ``first`` bytes (a header without a tokenizer fits; a
    128k-token vocabulary takes ~8 MB), then four times as many until the header ends
    within them. gguf-py reads them from a sparse file of the file's size (the tensor data
    is never fetched nor written to disk)."""
    import tempfile

    have = b""
    with tempfile.TemporaryDirectory(prefix="ckptxform-gguf-") as tmp:
        sparse = Path(tmp) / "header.gguf"
        with open(sparse, "wb") as f:
            f.truncate(size)
        want = min(first, size)
        while True:
            have += read(len(have), want)
            with open(sparse, "r+b") as f:
                f.write(have)
            parsed = read_gguf_header(sparse, file, label=label, prefix=len(have))
            if parsed is not None:
                return parsed
            want = min(4 * want, size)


def gguf_config(metadata: Mapping[str, Any], types: Mapping[str, str],
                shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """A GGUF model's config as rules read it: the metadata nested at its dots, each
    tensor's type and logical shape, and whether the embeddings are tied."""
    return {**nested(metadata), TYPES_KEY: dict(types), SHAPES_KEY: {k: list(v) for k, v in shapes.items()},
            TIED_KEY: OUTPUT_HEAD not in types}


def tokenizer_notes(metadata: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The audit's ``metadata`` record of a GGUF's tokenizer (``tokenizer.*`` keys), which
    no rule converts to HF tokenizer files."""
    keys = sorted(k for k in metadata if k.startswith("tokenizer."))
    if not keys:
        return []
    return [{"event": "metadata", "action": "not carried", "keys": keys,
             "reason": "the GGUF's tokenizer is not converted to tokenizer.json (a rule's config may set its "
                       "bos/eos/pad ids); AutoTokenizer.from_pretrained(DIR, gguf_file=FILE) builds one"}]


def split_parts(first: str) -> list[str]:
    """The file names of the split set whose first part is ``first`` (``[first]`` when it
    is not a split name); a later part is refused: give the first."""
    split = SPLIT_NAME.fullmatch(first)
    if split is None:
        return [first]
    count = int(split["count"])
    return [f"{split['stem']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def first_parts(names: list[str]) -> list[str]:
    """The GGUF models among ``names``: single files and the first parts of split sets."""
    return [n for n in names if n.endswith(".gguf")
            and (not SPLIT_NAME.fullmatch(n) or SPLIT_NAME.fullmatch(n)["no"] == "00001")]


def gguf_index(parts: list[tuple[str, dict[str, Any], list[GgufTensor]]], label: str
               ) -> tuple[dict[str, Any], dict[str, GgufTensor]]:
    """The metadata (the first part's) and the tensors of a model's parts ``(file, fields,
    tensors)``, each part checked to be the one its name says, no tensor in two parts."""
    tensors: dict[str, GgufTensor] = {}
    for i, (file, fields, infos) in enumerate(parts):
        _check_split(f"{label}/{file}" if label else file, fields, i, len(parts))
        for tensor in infos:
            key = tensor.info.key
            if key in tensors:
                raise CheckpointFormatError(f"{label}/{file}: tensor {key!r} is also in {tensors[key].info.file}; "
                                            "the split set is inconsistent", path=file, key=key)
            tensors[key] = tensor
    return (parts[0][1] if parts else {}), tensors


def nested(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """GGUF's dotted keys as nested objects (``a.b.c: 1`` -> ``{"a": {"b": {"c": 1}}}``); a
    key that is also another's prefix keeps its value under ``""``."""
    out: dict[str, Any] = {}
    for key, value in metadata.items():
        *parents, last = key.split(".")
        node = out
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                child = node[part] = {"": child}
            node = child
        if isinstance(node.get(last), dict):
            node[last][""] = value
        else:
            node[last] = value
    return out


class GgufCheckpoint(LocalCheckpoint):
    """A local GGUF model (one file or a split set); bytes read like a safetensors file's."""

    def __init__(self, *, location: str, name: str | None, root: Path, tensors: Mapping[str, GgufTensor],
                 files: tuple[str, ...], pins: Mapping[str, FilePin], gguf_metadata: Mapping[str, Any]) -> None:
        super().__init__(location=location, name=name, root=root, tensors={k: t.info for k, t in tensors.items()},
                         files=files, metadata={}, bin_tensors={}, pins=pins)
        #: each tensor's GGUF type name and the shape of its values (transformers' order)
        self.ggml_types = {k: t.ggml_type for k, t in tensors.items()}
        self.logical_shapes = {k: t.logical_shape for k, t in tensors.items()}
        #: the metadata key/values of the first file, as gguf-py reads them (dotted keys)
        self.gguf_metadata = dict(gguf_metadata)

    def config(self, name: str = "config.json") -> dict[str, Any] | None:
        if name != "config.json":
            return super().config(name)
        return gguf_config(self.gguf_metadata, self.ggml_types, self.logical_shapes)

    def raw_header(self, file: str) -> bytes:
        return super(LocalCheckpoint, self).raw_header(file)

    def audit_notes(self) -> list[dict[str, Any]]:
        return tokenizer_notes(self.gguf_metadata)


def _check_split(path: str, fields: Mapping[str, Any], index: int, count: int) -> None:
    """A split part must say it is part ``index`` of ``count`` (llama.cpp's split.* keys)."""
    if count == 1 and "split.count" not in fields:
        return
    no, total = fields.get("split.no"), fields.get("split.count")
    if (no, total) != (index, count):
        raise CheckpointFormatError(f"{path}: its split.no/split.count say part {no} of {total}, but its name makes "
                                    f"it part {index} of {count}; the split set is mixed up (re-download it)",
                                    path=str(path))
