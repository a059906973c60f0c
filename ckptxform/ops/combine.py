"""combine: an output computed from several tensors by an expression (tensor_expr.py).

``x`` is the op's input (the chain's tensor); ``inputs`` names more tensors by templated
key (``{X}`` is the rule's variable), of the same source or another one::

    - combine:
        inputs:
          A: {source: adapter, key: '{X}.lora_A.weight'}
          B: {source: adapter, key: '{X}.lora_B.weight'}
        expr: 'x + (B @ A) * ${source.adapter.config.lora_scaling.{X}}'
        compute: float32          # default; float64 too
        # dtype: bfloat16         # the output's; default x's
        # absent: keep            # every input missing: x passes unchanged

Checked at plan time: every name is ``x`` or an input, every input exists (or all are
absent under ``absent: keep``; a half set is an error naming the missing one), every
input is a float tensor, the shapes fit (broadcast, ``@``, ``.T``), each error naming the
input and the rule's FILE:LINE.

Rounding: each input is widened exactly to the compute dtype, the whole expression is
computed there (a ``${...}`` scalar rounded to it, as torch does with a Python float), and
the result is rounded once, to nearest even, to the output dtype. Apply makes the output
a band of rows at a time; ``@`` is torch's (the same bytes as torch's whole-tensor product
wherever the property test measured it: bands are 64-row multiples, the last one
overlapping the one before rather than shorter), so combine needs torch at apply.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from math import prod
from typing import Any, ClassVar, Literal

from ..dtypes import USER_DTYPES
from .base import Accepts, Block, BlockOp, Context, InputTensor, NoInverse, Value, View
from .tensor_expr import ExprError, Slice, bind, evaluate, parse, shape_of

_FLOATS = frozenset({"BF16", "F16", "F32", "F64"})
_FLOAT_NAMES = sorted(k for k, v in USER_DTYPES.items() if v in _FLOATS)
_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
#: rows of one band: a multiple of this (torch's product of a band of rows gives the
#: whole product's bytes for bands this tall; see the module docstring)
BAND_ROWS = 64
_VARIABLE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


class Combine(BlockOp):
    verb = "combine"
    description = ("Compute the output from x (the input) and more tensors named by templated key (inputs), by an "
                   "expression of + - * / @ .T and ${...} scalars, in float32 (compute), rounded once to dtype.")
    schema: ClassVar[dict[str, Any]] = {
        "type": "object", "additionalProperties": False, "required": ["expr"],
        "properties": {
            "expr": {"type": "string", "minLength": 1,
                     "description": "x (the input), input names, numbers, ${...}, + - * / @ .T and parentheses"},
            "inputs": {"type": "object", "propertyNames": {"pattern": _NAME, "not": {"const": "x"}},
                       "additionalProperties": {
                           "type": "object", "additionalProperties": False, "required": ["key"],
                           "properties": {"key": {"type": "string", "minLength": 1,
                                                  "description": "the tensor's key; {VAR} is the rule's variable"},
                                          "source": {"type": "string", "minLength": 1,
                                                     "description": "default: the source of x"}}}},
            "compute": {"enum": ["float32", "float64"], "description": "the dtype the expression is computed in"},
            "dtype": {"enum": _FLOAT_NAMES, "description": "the output's dtype (default: x's)"},
            "absent": {"enum": ["error", "keep"],
                       "description": "keep: when every input is missing, x passes unchanged (default: error)"}}}
    accepts = Accepts(dtypes=_FLOATS)
    yields: ClassVar[Literal["view", "block", "either"]] = "either"
    action = "combined"

    def sources(self, args: Any) -> tuple[str, ...]:
        inputs = args.get("inputs") if isinstance(args, dict) else None
        if not isinstance(inputs, dict):
            return ()
        return tuple(dict.fromkeys(s["source"] for s in inputs.values()
                                   if isinstance(s, dict) and isinstance(s.get("source"), str)))

    def map(self, args: Any, ctx: Context, value: View) -> Value:
        try:
            parsed = parse(args["expr"])
        except ExprError as err:
            raise ctx.error(f"combine.expr: {err}") from None
        declared: dict[str, dict[str, str]] = dict(args.get("inputs") or {})
        used = parsed.names()
        for name in used:
            if name != "x" and name not in declared:
                raise ctx.error(f"combine.expr names {name!r}, which is neither x (the op's input) nor one of "
                                f"inputs ({', '.join(declared) or 'none declared'}); declare it under inputs")
        for name in declared:
            if name not in used:
                raise ctx.error(f"combine.inputs.{name} is never used in expr {args['expr']!r}; use it or remove it")
        origin = ctx.tensor_of(value)
        places = {name: self._place(ctx, name, spec, origin) for name, spec in declared.items()}
        missing = [name for name, (source, key) in places.items() if not ctx.has_tensor(source, key)]
        if missing:
            if args.get("absent") == "keep" and len(missing) == len(declared):
                return value
            name = missing[0]
            source, key = places[name]
            present = [n for n in declared if n not in missing]
            beside = f", while {', '.join(f'{n} ({places[n][1]!r})' for n in present)} exists" if present else ""
            raise ctx.error(f"combine input {name}: source {source!r} has no tensor {key!r}{beside}; "
                            + ("a set of inputs is used whole or not at all" if present else
                               "correct inputs.{name}.key, or add absent: keep to pass such tensors unchanged"
                               .replace("{name}", name)), key=key)
        names = ["x", *declared]
        views: list[View] = [value]
        for name in declared:
            source, key = places[name]
            view, _ = ctx.other_tensor(source, key, f"combine input {name}")
            views.append(view)
        for name, view in zip(names, views):
            if view.dtype not in _FLOATS:
                what = "x (the op's input)" if name == "x" else f"input {name} ({places[name][1]!r})"
                raise ctx.error(f"combine: {what} is {view.dtype}; combine computes on float tensors "
                                "(BF16, F16, F32, F64)")
        try:
            tree = bind(parsed, names.index, lambda text: ctx.number(text, f"combine.expr {text}"))
            shape = shape_of(tree, [v.shape for v in views], names)
        except ExprError as err:
            raise ctx.error(f"combine.expr {args['expr']!r}: {err}") from None
        if not any(n in used for n in names):
            raise ctx.error(f"combine.expr {args['expr']!r} names no tensor; write a constant with add")
        for name in declared:
            source, key = places[name]
            ctx.lend(source, key, "inputs", f"input {name} of combine {args['expr']!r} ({ctx.label})")
        compute = USER_DTYPES[args.get("compute", "float32")]
        out = USER_DTYPES[args["dtype"]] if "dtype" in args else value.dtype
        return Block(self, {"expr": tree, "names": tuple(names), "compute": compute, "dtype": out,
                            "what": ctx.label}, tuple(views), shape, out)

    @staticmethod
    def _place(ctx: Context, name: str, spec: dict[str, str], origin: tuple[str, str, bool] | None) -> tuple[str, str]:
        """(source, key) of input ``name``: its templated key filled from the rule's binding."""
        source = spec.get("source") or (origin[0] if origin is not None else None)
        if source is None:
            raise ctx.error(f"combine.inputs.{name}: x reads no source tensor, so the input's source must be "
                            "given (source: NAME)")
        try:
            key = _VARIABLE.sub(lambda m: ctx.bound(m.group(1)), spec["key"])
        except KeyError as err:
            raise ctx.error(f"combine.inputs.{name}.key {spec['key']!r} names {{{err.args[0]}}}, a variable the "
                            "rule's key does not bind") from None
        return source, key

    def inverse(self, args: Any) -> tuple[str, Any]:
        raise NoInverse("combine computes its output from several tensors; there is no op that takes them apart")

    def describe(self, args: Any) -> str:
        return f"combine {args['expr']}"

    def blocks(self, block: Block, inputs: Sequence[InputTensor], chunk_bytes: int,
               rows: range | None = None) -> Iterator[bytes | memoryview]:
        from .decode import require_torch, tensor_bytes

        torch = require_torch("the combine op")
        compute = getattr(torch, {"F32": "float32", "F64": "float64"}[block.args["compute"]])
        out = getattr(torch, {"BF16": "bfloat16", "F16": "float16", "F32": "float32",
                              "F64": "float64"}[block.args["dtype"]])
        tree, shapes = block.args["expr"], [i.view.shape for i in inputs]
        if not block.shape:
            yield tensor_bytes(_evaluated(tree, shapes, inputs, None, compute, torch).to(out).reshape(()))
            return
        total = block.shape[0]
        wanted = rows if rows is not None else range(total)
        row_bytes = max(1, prod(block.shape[1:]) * 8)
        band = max(BAND_ROWS, chunk_bytes // row_bytes // BAND_ROWS * BAND_ROWS)
        whole: dict[int, Any] = {}
        for first in range(wanted.start, wanted.stop, band):
            stop = min(first + band, wanted.stop)
            # a band as tall as the others, ending at the last row, rather than a short one
            lo = max(0, min(first, total - band))
            hi = min(total, lo + band)
            value = _evaluated(tree, shapes, inputs, (0, lo, hi), compute, torch, whole)
            value = value.broadcast_to((hi - lo, *block.shape[1:]))[first - lo:stop - lo]
            yield tensor_bytes(value.to(out).contiguous())


def _evaluated(tree: Any, shapes: list[tuple[int, ...]], inputs: Sequence[InputTensor], sl: Slice, compute: Any,
               torch: Any, whole: dict[int, Any] | None = None) -> Any:
    """Slice ``sl`` of the expression's value, in ``compute``; inputs read whole are kept in
    ``whole`` for the next band."""
    cache = whole if whole is not None else {}

    def leaf(i: int, s: Slice) -> Any:
        view = inputs[i].view
        if s is not None and s[0] == 0 and i not in cache:
            return _decoded(inputs[i], s[1] * view.row_nbytes, (s[2] - s[1]) * view.row_nbytes,
                            (s[2] - s[1], *view.shape[1:]), compute, torch)
        if i not in cache:
            cache[i] = _decoded(inputs[i], 0, view.nbytes, view.shape, compute, torch)
        value = cache[i]
        return value if s is None else value.narrow(s[0], s[1], s[2] - s[1])

    result = evaluate(tree, shapes, leaf, sl, torch)
    return result if isinstance(result, torch.Tensor) else torch.tensor(result, dtype=compute)


def _decoded(source: InputTensor, start: int, length: int, shape: tuple[int, ...], compute: Any, torch: Any) -> Any:
    dtype = getattr(torch, {"BF16": "bfloat16", "F16": "float16", "F32": "float32",
                            "F64": "float64"}[source.view.dtype])
    raw = bytearray(source.read(start, length)) if length else bytearray()
    values = torch.frombuffer(raw, dtype=dtype) if length else torch.empty(0, dtype=dtype)
    return values.reshape(shape).to(compute)
