"""Raw tensor bytes <-> torch values, for the programs that decode (imports torch lazily)."""

from __future__ import annotations

from typing import Any


def tensor_bytes(tensor: Any) -> bytes:
    """The raw bytes of a CPU tensor (without numpy, which torch does not require)."""
    import ctypes

    tensor = tensor.contiguous()
    return ctypes.string_at(tensor.data_ptr(), tensor.numel() * tensor.element_size())


def cast_bytes(raw: bytes | bytearray | memoryview, src: str, dst: str) -> bytes:
    """Elementwise dtype conversion of raw little-endian tensor bytes."""
    import torch

    from ..dtypes import torch_dtype

    values = torch.frombuffer(bytearray(raw), dtype=torch_dtype(src))
    return tensor_bytes(values.to(torch_dtype(dst)))
