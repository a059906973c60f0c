"""Tensors over the byte buffers the kernels are given, without a copy: what the torch
dequant kernels and the torch quantize kernels share (a leaf: it imports neither)."""

from __future__ import annotations

import warnings
from typing import Any

import torch

Buffer = bytes | bytearray | memoryview


def as_tensor(raw: Buffer, dtype: Any) -> torch.Tensor:
    """A 1-D tensor over ``raw`` without a copy. The kernels never write to their inputs, so
    a read-only buffer (``bytes`` from a source) is used as it is."""
    if not len(raw):
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(raw, dtype=dtype)
