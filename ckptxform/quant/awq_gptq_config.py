"""What an AutoAWQ or GPTQ checkpoint's ``quantization_config`` says, read as their loaders
read it (transformers' ``AwqConfig`` and ``GPTQConfig``, AutoAWQ, auto-gptq), and the shapes
its tensors must then have.

- AutoAWQ (``quant_method: awq``): ``bits`` 4, ``group_size``, ``zero_point`` (true: the GEMM
  checkpoints carry ``qzeros``), ``version`` ``gemm`` (GEMV, Marlin and ExLlama layouts are
  other formats), ``modules_to_not_convert``.
- GPTQ (``quant_method: gptq``): ``bits`` 4, ``group_size`` (-1: one group the row's width),
  ``desc_act``, ``sym``, ``checkpoint_format`` ``gptq`` (v1: zero points stored less one;
  ``gptq_v2`` stores them as they are and is refused rather than read wrong).

Every problem is a ``QuantizationConfigError`` naming the config's path and field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import QuantizationConfigError
from .schemes import Found


def _positive(q: dict[str, Any], path: str, field: str, default: Any, allow_minus_one: bool = False) -> int:
    value = q.get(field, default)
    if isinstance(value, bool) or not isinstance(value, int) or not (value > 0 or (allow_minus_one and value == -1)):
        raise QuantizationConfigError(f"{path}.{field} is {value!r}, not a positive integer"
                                      + (" (or -1)" if allow_minus_one else ""))
    return value


def _bits(q: dict[str, Any], path: str) -> None:
    bits = q.get("bits", q.get("w_bit", 4))
    if bits != 4:
        raise QuantizationConfigError(f"{path}.bits is {bits!r}; only 4-bit checkpoints are supported")


@dataclass(frozen=True)
class AwqConfig:
    """AutoAWQ GEMM: ``group_size`` input rows per scale and zero point."""

    path: str
    group_size: int
    not_converted: tuple[str, ...]

    @classmethod
    def parse(cls, found: Found) -> AwqConfig:
        q, path = found.require_method("awq", "AutoAWQ GEMM checkpoints")
        _bits(q, path)
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise QuantizationConfigError(f"{path}.version is {q.get('version')!r}; only AutoAWQ's 'gemm' layout is "
                                          "supported (GEMV, Marlin and ExLlama checkpoints pack otherwise)")
        if q.get("zero_point", True) is not True:
            raise QuantizationConfigError(f"{path}.zero_point is {q.get('zero_point')!r}; AutoAWQ GEMM checkpoints "
                                          "carry qzeros (zero_point: true), and this one says they do not")
        group = _positive(q, path, "group_size", q.get("q_group_size", 128))
        skip = q.get("modules_to_not_convert") or []
        if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
            raise QuantizationConfigError(f"{path}.modules_to_not_convert is {skip!r}, not a list of names")
        return cls(path, group, tuple(skip))

    def converted(self, module: str) -> bool:
        """Whether ``module`` is quantized (not named by ``modules_to_not_convert``, which
        AutoAWQ and transformers match as a part of the name)."""
        return not any(m in module for m in self.not_converted)

    def problem(self, qweight: tuple[int, ...], qzeros: tuple[int, ...], scales: tuple[int, ...]) -> str | None:
        """Why the three shapes are not one module of this config, or None."""
        if len(qweight) != 2 or len(qzeros) != 2 or len(scales) != 2:
            return "each must be 2-D"
        rows, words = qweight
        groups = -(-rows // self.group_size)
        want = ((groups, words), (groups, words * 8))
        if rows % self.group_size or (qzeros, scales) != want:
            return (f"group_size {self.group_size} ({self.path}) and qweight [in={rows}, out/8={words}] need in a "
                    f"multiple of {self.group_size}, qzeros {list(want[0])} and scales {list(want[1])}")
        return None


@dataclass(frozen=True)
class GptqConfig:
    """GPTQ v1: ``group_size`` (0: the row's width), ``desc_act``, ``sym``."""

    path: str
    group_size: int
    desc_act: bool
    sym: bool

    @classmethod
    def parse(cls, found: Found) -> GptqConfig:
        q, path = found.require_method("gptq", "GPTQ checkpoints")
        _bits(q, path)
        fmt = q.get("checkpoint_format", "gptq")
        if fmt != "gptq":
            raise QuantizationConfigError(f"{path}.checkpoint_format is {fmt!r}; only 'gptq' (v1: zero points stored "
                                          "less one) is supported; save the model in the v1 format")
        group = _positive(q, path, "group_size", 128, allow_minus_one=True)
        for field in ("desc_act", "sym"):
            if not isinstance(q.get(field, field == "sym"), bool):
                raise QuantizationConfigError(f"{path}.{field} is {q.get(field)!r}, not true or false")
        return cls(path, 0 if group == -1 else group, bool(q.get("desc_act", False)), bool(q.get("sym", True)))

    def groups(self, rows: int) -> int:
        return 1 if self.group_size == 0 else -(-rows // self.group_size)

    def group_of(self, rows: int) -> int:
        """Rows a group spans for a weight of ``rows`` input rows."""
        return self.group_size or rows

    def problem(self, qweight: tuple[int, ...], qzeros: tuple[int, ...], scales: tuple[int, ...],
                g_idx: tuple[int, ...] | None) -> str | None:
        """Why the shapes are not one module of this config, or None."""
        if len(qweight) != 2 or len(qzeros) != 2 or len(scales) != 2:
            return "each must be 2-D"
        words, cols = qweight
        rows = words * 8
        groups = self.groups(rows)
        want = ((groups, -(-cols // 8)), (groups, cols))
        if cols % 8 or (qzeros, scales) != want:
            return (f"group_size {self.group_size or -1} ({self.path}) and qweight [in/8={words}, out={cols}] need out "
                    f"a multiple of 8, qzeros {list(want[0])} and scales {list(want[1])}")
        if g_idx is not None and g_idx != (rows,):
            return f"g_idx must be [{rows}] (one group index per input row)"
        return None
