"""add, multiply, divide: one constant applied to every value of a float tensor.

What zero-centred RMSNorm weights need (Gemma stores ``w`` for ``x * (1 + w)``; Llama,
GGUF and Megatron store ``w + 1``: ``add: 1``) and what folds a constant scale into a
weight (Gemma's embedding normalizer: ``multiply: {value: '${sqrt(config.hidden_size)}',
round_value_to: tensor}``). Each value is computed in float32 (float64 for F64
tensors) from the tensor's dtype and rounded to nearest even once, to the tensor's
dtype: bit for bit torch's ``(w.float() + c).to(w.dtype)``. The constant is a number or a
``${...}`` expression (``sqrt``, ``**``, float literals), rounded to float32 first, or
first to ``round_value_to`` where the model does that (Gemma's normalizer is a bf16
tensor).

Inverses: ``add c`` <-> ``add -c``, ``multiply c`` <-> ``divide c``. Rounding after each
op loses the low bits (in bfloat16, ``0.001 + 1 - 1`` is 0), so ``invert`` refuses them
unless the op says ``inverse_lossy: accept``. A finite value the op makes inf (an
overflow) is an error at apply, naming the tensor and the index.

A block op on numpy (bfloat16 widened and rounded by its bits), a bounded block of rows
at a time.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

from ..dtypes import USER_DTYPES, numpy_dtype
from ..errors import CheckpointFormatError
from .base import Accepts, Block, BlockOp, Context, InputTensor, NoInverse, Value, View

_NUMBER = {"oneOf": [{"type": "number"}, {"type": "string", "pattern": r"^\$\{.*\}$"}]}
_FLOATS = frozenset({"BF16", "F16", "F32", "F64"})
_SCHEMA = {"oneOf": [_NUMBER, {
    "type": "object", "additionalProperties": False, "required": ["value"],
    "properties": {
        "value": _NUMBER,
        "round_value_to": {"enum": ["tensor", *sorted(k for k, v in USER_DTYPES.items() if v in _FLOATS)],
                           "description": "round the constant to this dtype first (tensor: the tensor's own), "
                                          "as a model that stores it as a tensor does"},
        "inverse_lossy": {"const": "accept",
                          "description": "let `ckptxform invert` write the opposite op, which gives the values "
                                         "back only to within one rounding"}}}]}


def _args(args: Any) -> dict[str, Any]:
    """The arguments as a mapping (``add: 1`` is ``add: {value: 1}``)."""
    return dict(args) if isinstance(args, dict) else {"value": args}


class _Affine(BlockOp):
    schema = _SCHEMA
    accepts = Accepts(dtypes=_FLOATS)
    #: the numpy ufunc name of the op, and the verb undoing it
    ufunc: ClassVar[str]
    inverse_verb: ClassVar[str]

    def map(self, args: Any, ctx: Context, value: View) -> Value:
        given = _args(args)
        constant = float(ctx.number(given["value"], f"{self.verb}.value"))
        compute = "F64" if value.dtype == "F64" else "F32"
        rounded = _rounded(constant, given.get("round_value_to"), value.dtype, compute)
        if self.verb == "divide" and rounded == 0:
            raise ctx.error(f"divide by {given['value']!r}: the constant is 0 in {compute}; nothing can be "
                            "divided by it")
        return Block(self, {"value": rounded, "compute": compute, "what": ctx.label},
                     (value,), value.shape, value.dtype)

    def inverse(self, args: Any) -> tuple[str, Any]:
        given = _args(args)
        if given.get("inverse_lossy") != "accept":
            example = "0.001 + 1 - 1 is 0" if self.verb == "add" else "1.359375 * 3 / 3 is 1.3515625"
            raise NoInverse(f"{self.verb} rounds each value to the tensor's dtype, so the opposite op gives it "
                            f"back only to within one rounding (in bfloat16, {example}); add inverse_lossy: accept "
                            "to the op if that is close enough")
        if self.verb == "add":
            value = given["value"]
            if isinstance(value, str) and " ?? " in value:
                raise NoInverse(f"{value} has a default, which cannot be negated; write the inverse add by hand")
            given["value"] = -value if not isinstance(value, str) else "${-(" + value[2:-1] + ")}"
        return self.inverse_verb, given

    def describe(self, args: Any) -> str:
        given = _args(args)
        rounding = f" (rounded to {_spelled(given['round_value_to'])} first)" if "round_value_to" in given else ""
        return f"{self.verb} {given['value']}{rounding}"

    def blocks(self, block: Block, inputs: Sequence[InputTensor], chunk_bytes: int,
               rows: range | None = None) -> Iterator[bytes | memoryview]:
        import numpy as np  # here, not at the top: byte-level runs never import numpy

        from ..quant.numpy_kernels import rounded_array

        (source,) = inputs
        view = source.view
        row = view.row_nbytes if view.shape else view.itemsize
        total = view.shape[0] if view.shape else 1
        wanted = rows if rows is not None else range(total)
        step = max(1, chunk_bytes // max(1, row))
        compute = numpy_dtype(block.args["compute"])
        constant = compute.type(block.args["value"])
        ufunc = getattr(np, self.ufunc)
        for first in range(wanted.start, wanted.stop, step):
            count = min(step, wanted.stop - first)
            raw = source.read(first * row, count * row)
            values = _widened(raw, view.dtype, compute)
            with np.errstate(all="ignore"):  # an overflow is found below, naming its index
                ufunc(values, constant, out=values)
                out = rounded_array(values, view.dtype) if view.dtype != "F64" else values
            if not _all_finite(out, view.dtype):
                _refuse_overflow(_widened(raw, view.dtype, compute), out, first * (row // view.itemsize), view,
                                 block.args["what"])
            yield np.ascontiguousarray(out).tobytes()


def _widened(raw: bytes | memoryview, dtype: str, compute: Any) -> Any:
    """The values of ``raw`` in ``compute`` (float32, or float64 for F64), exactly, in a new
    array (bfloat16 widened by a shift of its bits: ml_dtypes' cast is 5x slower)."""
    import numpy as np

    if dtype == "BF16":
        return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(raw, dtype=numpy_dtype(dtype)).astype(compute)


def _spelled(to: str) -> str:
    return "the tensor's dtype" if to == "tensor" else to


def _rounded(constant: float, to: str | None, tensor_dtype: str, compute: str) -> float:
    """The constant as the computation uses it: rounded to ``to`` (``tensor``: the tensor's
    dtype) through float32 as torch rounds a Python float, then to ``compute``."""
    import numpy as np

    value = np.float64(constant)
    if to is not None:
        target = tensor_dtype if to == "tensor" else USER_DTYPES[to]
        value = value.astype(np.float32).astype(numpy_dtype(target)) if target != "F64" else value
    return float(value.astype(numpy_dtype(compute)))


def _all_finite(out: Any, dtype: str) -> bool:
    """No inf or NaN in ``out`` (bfloat16 as its uint16 bits: the exponent all ones)."""
    import numpy as np

    if dtype == "BF16":
        return not np.any((out & np.uint16(0x7F80)) == np.uint16(0x7F80))
    return bool(np.isfinite(out).all())


def _refuse_overflow(before: Any, out: Any, first: int, view: View, what: str) -> None:
    """An input value the op made non-finite: an error naming its index (NaN and inf of
    the source stay what they are)."""
    import numpy as np

    after = (out.astype(np.uint32) << 16).view(np.float32) if view.dtype == "BF16" else out
    bad = np.flatnonzero(np.isfinite(before) & ~np.isfinite(after))
    if not len(bad):
        return
    index = [int(i) for i in np.unravel_index(first + int(bad[0]), view.shape)] if view.shape else []
    raise CheckpointFormatError(f"{what}: {before[bad[0]]!s} becomes {after[bad[0]]!s} at {index}: the result "
                                f"overflows {view.dtype}; cast to a wider dtype first, or use a smaller constant")


class Add(_Affine):
    verb = "add"
    ufunc = "add"
    inverse_verb = "add"
    description = ("Add a constant (number or ${...}) to every value, in float32, rounded once to the tensor's "
                   "dtype (Gemma RMSNorm w -> w + 1).")


class Multiply(_Affine):
    verb = "multiply"
    ufunc = "multiply"
    inverse_verb = "divide"
    description = ("Multiply every value by a constant (number or ${...}), in float32, rounded once to the "
                   "tensor's dtype (a scale folded into a weight).")


class Divide(_Affine):
    verb = "divide"
    ufunc = "divide"
    inverse_verb = "multiply"
    description = "Divide every value by a constant (the inverse of multiply), in float32, rounded once."
