"""The ops of a rule's ``ops:`` chain, one definition each, registered by verb.

Adding a verb: write its ``OpDef`` (schema, kind, what it accepts and yields, shape rule,
inverse, wording, and for a block op its ``blocks`` program, which must make any range of
rows or say ``row_sliced = False``) in a module of this package and list it in ``OPS``; the
loader, planner, executor, ``invert`` and the audit take it from here. A package outside
ckptxform adds a verb the same way, through the entry-point group ``ckptxform.ops``
(``registry.py``; the README shows how). The schema file
holds the same fragments for editors (tests/test_ops_registry.py keeps them in step).
"""

from __future__ import annotations

from typing import Any

from .affine import Add, Divide, Multiply
from .combine import Combine
from .base import Block, BlockOp, Context, NoInverse, OpDef, Run, Step, Value, View
from .dequant import DequantFp8Block, DequantInt4
from .dequant_awq_gptq import DequantAwq, DequantGptq
from .repack_awq_gptq import RepackAwq, RepackGptq
from .dequant_gguf import DequantGguf
from .dequant_mxfp4 import DequantMxfp4
from .dequant_scaled import DequantScaled
from .gguf_quantize import GgufQuantize
from .layout import (
    Concat,
    QkvDeinterleave,
    QkvInterleave,
    RopePermute,
    RopeUnpermute,
    Split,
    Stack,
    Unstack,
)
from .quantize import QuantizeFp8Block, QuantizeFp8Channel, QuantizeNvfp4
from .quantize_int4 import QuantizeW4A16
from .resize import ResizeRows
from .rows import PermuteRows
from .shards import ConcatShards
from .transpose import TRANSPOSE
from .views import Deinterleave, Interleave, MergeHeads, Reshape, SplitHeads

from .registry import OpRegistry

#: every verb: the built-in ops below, then plug-ins (entry points ``ckptxform.ops``)
OPS = OpRegistry({op.verb: op for op in (
    Stack(), Unstack(), Concat(), Split(), TRANSPOSE, RopePermute(), RopeUnpermute(), QkvInterleave(),
    QkvDeinterleave(), ResizeRows(), DequantFp8Block(), DequantInt4(), PermuteRows(),
    DequantMxfp4(),
    Add(), Multiply(), Divide(), Reshape(), Deinterleave(), Interleave(), SplitHeads(), MergeHeads(),
    QuantizeFp8Block(), QuantizeFp8Channel(), QuantizeNvfp4(),
    ConcatShards(),
    DequantScaled(),
    Combine(),
    DequantGguf(),
    GgufQuantize(),
    QuantizeW4A16(),
    DequantAwq(), DequantGptq(), RepackAwq(), RepackGptq(),
)})


def ops_schema() -> dict[str, Any]:
    """The JSON Schema of one item of ``ops:`` (a one-key mapping), from the registry."""
    return {"type": "object", "minProperties": 1, "maxProperties": 1, "additionalProperties": False,
            "description": "One op: a one-key mapping from its verb to its arguments.",
            "properties": {verb: op_schema(op) for verb, op in sorted(OPS.builtins.items())}}


def op_schema(op: OpDef) -> dict[str, Any]:
    """The schema fragment of one op's arguments, with its description (editors show it)."""
    return {**op.schema, "description": op.description}


__all__ = ["OPS", "Block", "BlockOp", "Context", "NoInverse", "OpDef", "Run", "Step", "Value", "View",
           "op_schema", "ops_schema"]
