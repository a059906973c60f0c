"""What the planner asks of each output tensor beyond its shape: can its key name a
tensor, can the cast it decodes be made exactly, and does a tensor tied to it match it."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from ...dtypes import cast_problem
from ...errors import quote
from ...sources.base import TensorInfo
from .recipes import BlockProgram, OutputPlan

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def key_problem(key: str) -> str | None:
    """Why ``key`` cannot name a tensor in a safetensors file (None when it can)."""
    if not key:
        return "it is empty"
    if key == "__metadata__":
        return "safetensors reserves '__metadata__' for the file's metadata"
    if _CONTROL.search(key):
        return "it contains a control character"
    if len(key) > 1024:
        return f"it is {len(key)} characters long, more than 1024"
    return None


def value_problem(out: OutputPlan) -> str | None:
    """Why the cast ``out`` decodes cannot be made exactly; None when it can, or when it
    moves bytes only. Decided here, never mid-apply (an op's own values: by its shape rule)."""
    if out.dtype != out.input_dtype:
        why = cast_problem(out.input_dtype, out.dtype)
        if why is not None:
            return (f"cast {out.input_dtype} -> {out.dtype} of {quote(out.key)} cannot be exact: {why}; "
                    f"drop the cast and keep {out.input_dtype}")
    return None


def tie_problem(source: str, info: TensorInfo, target: str, out: OutputPlan | None) -> str | None:
    """Why ``source``'s tensor ``info`` cannot be tied to output ``target`` (``out``, None when
    no rule writes it); None when it can: apply then checks that the bytes agree."""
    if out is None:
        return (f"{source}:{info.key} is to be tied to output {target!r}, which no rule writes; name an output "
                "key of this rule file")
    if (out.shape, out.dtype) != (info.shape, info.dtype):
        return (f"{source}:{info.key} is {info.dtype} {list(info.shape)} but output {target!r} is {out.dtype} "
                f"{list(out.shape)}; tied tensors must be identical")
    return None


#: the converted source's files a GGUF output's metadata is built from
GGUF_NEEDS = ("config.json", "tokenizer.model")


def ggml_type_of_output(output: Any) -> str | None:
    """The GGML type ``gguf_quantize`` gave an output tensor, or None when no such op made it."""
    recipe = output.recipe
    if isinstance(recipe, BlockProgram) and recipe.block.op.verb == "gguf_quantize" and output.dtype == output.input_dtype:
        return str(recipe.block.args["ggml_type"])
    return None


def gguf_source_problem(source: str | None, missing: list[str]) -> str:
    """Why a GGUF output cannot be written from ``source``, which lacks the files ``missing``."""
    if "config.json" in missing:
        return f"the source {source!r} has no config.json to build the GGUF metadata from"
    return (f"the source {source!r} has no tokenizer.model; this GGUF writer carries SentencePiece (llama) "
            "tokenizers only. A BPE tokenizer.json (Llama 3, Qwen2) needs llama.cpp's pre-tokenizer hash "
            "table: convert that model with convert_hf_to_gguf.py")


def gguf_output_problem(outputs: Iterable[OutputPlan], source: str | None, files: set[str]) -> tuple[str, str | None] | None:
    """Why the planned ``outputs`` cannot make a GGUF file from a source holding ``files``:
    (message, output key) or None. Checked at plan time so ``plan`` and ``rules --for`` say it."""
    missing = [name for name in GGUF_NEEDS if name not in files]
    if missing:
        return gguf_source_problem(source, missing), None
    for output in outputs:
        if ggml_type_of_output(output) is None:
            return (f"{output.rule}: output {output.key!r} is not made by gguf_quantize; in a gguf output every "
                    "tensor's ops end with gguf_quantize: {type: ...}"), output.key
    return None
