"""A GGUF output's layout: the header (magic, metadata key/values, tensor infos, padding)
built from the plan with gguf-py's writer, and every tensor's aligned offset after it.

The tensor infos come from the plan: each output's GGML type is the one its chain's last
op, ``gguf_quantize``, chose (a tensor made any other way is refused before a byte is
written). The key/values are built from the converted source's small files (config.json,
the tokenizer files, the model card), copied into a temporary folder named like the
source (gguf-py's ``Metadata`` derives ``general.name`` from it, as for the converter).
"""

from __future__ import annotations

import io
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ....errors import PlanError, SourceNotFoundError
from ...plan.layout import OutputLayout, OutputTensorSpec, ShardLayout
from ...plan.output_checks import GGUF_NEEDS, ggml_type_of_output, gguf_source_problem

if TYPE_CHECKING:
    from ...plan.opened import OpenSources
    from ...plan.planner import Plan

#: the files the metadata is built from, when the source has them
SMALL_FILES = ("config.json", "tokenizer.model", "tokenizer.json", "tokenizer_config.json", "added_tokens.json",
               "special_tokens_map.json", "generation_config.json", "README.md")
#: general.file_type for each output.gguf.file_type (llama.cpp's LlamaFileType)
FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0"}


def plan_gguf_layout(plan: Plan, sources: OpenSources) -> OutputLayout:
    """The one-file layout of a ``format: gguf`` output."""
    spec = plan.rules.output.gguf
    assert spec is not None and plan.rules.convert is not None  # the loader's checks
    ckpt = sources.checkpoints[plan.rules.convert]
    with tempfile.TemporaryDirectory(prefix="ckptxform-gguf-") as tmp:
        folder = Path(tmp) / _source_name(ckpt.location)
        folder.mkdir()
        have = set(ckpt.list_files())
        for name in SMALL_FILES:
            if name in have:
                shutil.copyfile(ckpt.file_path(name), folder / name)
        header, placed = _header(plan, folder, spec)
    file = plan.rules.output.file_name
    alignment = 32
    offsets, offset = [], 0
    for out_spec in placed:
        offsets.append(len(header) + offset)
        offset += -(-out_spec.nbytes // alignment) * alignment
    return OutputLayout(shards=(ShardLayout.of(file=file, header=header, specs=placed, offsets=offsets,
                                               data_nbytes=offset),),
                        index_file=None)


def _source_name(location: str) -> str:
    """The folder or repo name of a source location (what the converter calls the model)."""
    name = location.removeprefix("hf://").split("@")[0].rstrip("/").rsplit("/", 1)[-1]
    return name if name not in ("", ".", "..") else "model"


def _header(plan: Plan, folder: Path, spec: Any) -> tuple[bytes, list[OutputTensorSpec]]:
    import gguf
    import numpy as np

    from .llama import add_llama_hparams, llama_hparams
    from .spm_vocab import add_spm_tokenizer

    label = f"{plan.rules.path}: output.gguf"
    missing = [name for name in GGUF_NEEDS if not (folder / name).is_file()]
    if missing:  # planned from another copy of the source; plan checked this one
        raise SourceNotFoundError(f"{label}: {gguf_source_problem(plan.rules.convert, missing)}")
    import json

    config = json.loads((folder / "config.json").read_text("utf-8"))
    hparams = llama_hparams(config, label)
    writer = gguf.GGUFWriter(path=None, arch=spec.architecture)
    placed = []
    for output in plan.outputs:
        ggml_type = ggml_type_of_output(output)
        if ggml_type is None:
            raise PlanError(f"{output.rule}: output {output.key!r} is not made by gguf_quantize; in a gguf output "
                            "every tensor's ops end with gguf_quantize: {type: ...}", key=output.key)
        np_dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}.get(ggml_type, np.uint8)
        writer.add_tensor_info(output.key, output.shape, np.dtype(np_dtype), output.nbytes,
                               raw_dtype=gguf.GGMLQuantizationType[ggml_type])
        placed.append(OutputTensorSpec(output.key, output.dtype, output.shape))
    total, shared, expert, count = writer.get_total_parameter_count()
    writer.add_type(gguf.GGUFType.MODEL)
    metadata = gguf.Metadata.load(None, folder, spec.name, total)
    if metadata.name is None:
        metadata.name = folder.name
    if metadata.size_label is None and total > 0:
        metadata.size_label = gguf.size_label(total, shared, expert, count)
    metadata.set_gguf_meta_model(writer)
    add_llama_hparams(writer, hparams, int(gguf.LlamaFileType[FILE_TYPES[spec.file_type]]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_spm_tokenizer(writer, folder, hparams.get("vocab_size"))
    return _serialized(writer), placed


def _serialized(writer: Any) -> bytes:
    """Everything gguf-py writes before the tensor data, padded to its alignment."""
    from gguf.gguf_writer import WriterState

    buffer = io.BytesIO()
    writer.fout = [buffer]
    writer.state = WriterState.EMPTY
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.write_padding(buffer, buffer.tell())
    writer.fout = None
    return buffer.getvalue()
