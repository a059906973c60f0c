"""View ops: reshape, strided split (deinterleave) and interleave, per-head split and merge.

None decodes a value. ``reshape`` relabels the shape: a tensor of a chain is always in
row-major byte order (a transpose writes its output in order), so any reshape that keeps
the element count is a pure re-indexing and moves no byte. The rest move bytes:

- ``deinterleave {into: P, dim: d}``: part ``i`` of ``n`` (the values of ``P`` that ``to``
  enumerates) is ``t[..., i::n, ...]`` along ``d`` (gpt-oss's gate/up columns: ``[:, ::2]``
  gate, ``[:, 1::2]`` up); ``interleave {over: P, dim: d}`` is its inverse.
- ``split_heads {into: P, heads: h}``: rows ``[h, n, head_dim]`` -> ``n`` tensors of rows
  ``[h, head_dim]`` (GPT-NeoX/Pythia and Bloom store q, k, v per head: ``query_key_value``
  rows are head 0's q, k, v, then head 1's ...); ``merge_heads {over: P, heads: h}`` is its
  inverse.

Along dim 0 each output row is a run of the input (a byte program, as every row
permutation); along an inner dim elements move one by one, so the op is a block op that
moves them as unsigned integers of their size, a bounded block of rows at a time (one
input row at least).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from math import prod
from typing import Any

from .base import (
    Accepts,
    Block,
    BlockOp,
    Context,
    InputTensor,
    NoInverse,
    OpDef,
    Value,
    View,
    join_runs,
)
from .layout import _EXPR, _VAR, _dim
from .transpose import _UINT

_SHAPE = {"type": "array", "items": {"oneOf": [{"type": "integer", "minimum": -1},
                                              {"type": "string", "pattern": r"^\$\{.*\}$"}]}}


def _schema(var_key: str, other: str, fragment: dict[str, Any]) -> dict[str, Any]:
    """The arguments of a split (``into``) or reduce (``over``) op and one more, both required."""
    return {"type": "object", "additionalProperties": False, "required": [var_key, other],
            "properties": {var_key: _VAR, other: fragment}}


def _names(ctx: Context, verb: str, var: str, names: tuple[str, ...] | None) -> tuple[str, ...]:
    if names is None:
        raise ctx.error(f"{verb} into {var}: 'to' must enumerate {var} ({{{var}:a,b,...}}) to name the parts")
    return names


def _alike(ctx: Context, verb: str, args: Any, members: list[tuple[str, View]]) -> View:
    """The first member, once every member has its shape and dtype."""
    if len({(v.shape, v.dtype) for _, v in members}) > 1:
        listing = ", ".join(f"{name}: {v.dtype} {list(v.shape)}" for name, v in members)
        raise ctx.error(f"{verb} over {args['over']}: the tensors differ in shape or dtype ({listing})")
    return members[0][1]


class Reshape(OpDef):
    verb = "reshape"
    description = ("A new shape of the same elements (one dim may be -1); moves no byte. `from` (the shape "
                   "it takes, checked) lets `ckptxform invert` write the reshape back.")
    schema = {"oneOf": [_SHAPE, {"type": "object", "additionalProperties": False, "required": ["shape"],
                                 "properties": {"shape": _SHAPE, "from": _SHAPE}}]}

    def map(self, args: Any, ctx: Context, value: View) -> Value:
        given = args if isinstance(args, dict) else {"shape": args}
        count = prod(value.shape)
        if "from" in given:
            want = _dims(ctx, given["from"], "reshape.from", count)
            if want != value.shape:
                raise ctx.error(f"reshape: from is {list(want)} but the tensor has shape {list(value.shape)}")
        shape = _dims(ctx, given["shape"], "reshape.shape", count)
        if prod(shape) != count:
            raise ctx.error(f"reshape to {list(shape)} makes {prod(shape):,} elements, and the tensor (shape "
                            f"{list(value.shape)}) has {count:,}: a reshape keeps every element")
        return View(shape, value.dtype, value.runs)

    def inverse(self, args: Any) -> tuple[str, Any]:
        if not isinstance(args, dict) or "from" not in args:
            raise NoInverse("it has no from, so the inverse cannot know the shape to restore; write "
                            "reshape: {shape: [...], from: [...]} (from is checked at plan time)")
        return "reshape", {"shape": args["from"], "from": args["shape"]}

    def describe(self, args: Any) -> str:
        return f"reshape {list(args['shape'] if isinstance(args, dict) else args)}"


def _dims(ctx: Context, raw: list[Any], what: str, count: int) -> tuple[int, ...]:
    """The dims of a shape argument, its one -1 (if any) filled in from ``count``."""
    dims = [ctx.integer(d, what) for d in raw]
    free = [i for i, d in enumerate(dims) if d == -1]
    if len(free) > 1 or any(d < -1 for d in dims):
        raise ctx.error(f"{what} {dims}: sizes are at least 0, and at most one is -1 (the size the others leave)")
    if free:
        known = prod(d for d in dims if d != -1)
        if known == 0 or count % known:
            raise ctx.error(f"{what} {dims}: {count:,} elements do not fill the other dims ({known:,} elements "
                            "each) a whole number of times")
        dims[free[0]] = count // known
    return tuple(dims)


def _geometry(shape: tuple[int, ...], dim: int) -> tuple[int, int, int]:
    """(slices before ``dim`` within a row of dim 0, size of ``dim``, elements after it)."""
    return prod(shape[1:dim]), shape[dim], prod(shape[dim + 1:])


class _Strided(BlockOp):
    """A strided split or interleave: runs of rows along dim 0, elements moved otherwise."""

    accepts = Accepts(min_rank=1)
    yields = "either"

    def _block_dim(self, ctx: Context, value: View) -> None:
        if value.itemsize not in _UINT:
            raise ctx.error(f"{self.verb}: {value.dtype} elements are not whole bytes")


class Deinterleave(_Strided):
    verb = "deinterleave"
    kind = "split"
    description = ("Strided split along dim: part i of n (the enumeration of `to`) is [..., i::n, ...] "
                   "(interleaved gate/up -> gate, up).")
    schema = _schema("into", "dim", {"type": "integer"})

    def split(self, args: Any, ctx: Context, value: View, names: tuple[str, ...] | None) -> list[tuple[str, Value]]:
        var = args["into"]
        dim = _dim(ctx, args["dim"], value.shape, f"deinterleave into {var}")
        names = _names(ctx, self.verb, var, names)
        parts, size = len(names), value.shape[dim]
        if size % parts:
            raise ctx.error(f"deinterleave into {var}: dim {dim} ({size}) does not split into {parts} "
                            f"interleaved parts ({', '.join(names)})")
        shape = value.shape[:dim] + (size // parts,) + value.shape[dim + 1:]
        if not value.nbytes:  # a header's claim alone: no bytes to list runs of
            return [(name, View(shape, value.dtype, ())) for name in names]
        if dim == 0:
            return [(name, value.rows(range(i, size, parts), shape)) for i, name in enumerate(names)]
        self._block_dim(ctx, value)
        return [(name, Block(self, {"dim": dim, "parts": parts, "part": i}, (value,), shape, value.dtype))
                for i, name in enumerate(names)]

    def inverse(self, args: Any) -> tuple[str, Any]:
        return "interleave", {"over": args["into"], "dim": args["dim"]}

    def blocks(self, block: Block, inputs: Sequence[InputTensor], chunk_bytes: int,
               rows: range | None = None) -> Iterator[bytes | memoryview]:
        import numpy as np

        (source,) = inputs
        view, dim, parts, part = source.view, block.args["dim"], block.args["parts"], block.args["part"]
        mid, size, tail = _geometry(view.shape, dim)
        for first, count in _row_blocks(view, rows, chunk_bytes):
            tile = np.frombuffer(source.read(first * view.row_nbytes, count * view.row_nbytes),
                                 dtype=_UINT[view.itemsize]).reshape(count, mid, size, tail)
            yield tile[:, :, part::parts, :].tobytes()


class Interleave(_Strided):
    verb = "interleave"
    kind = "reduce"
    description = ("Along dim, the members' elements in turn: index j*n + i is member i's index j "
                   "(gate, up -> interleaved gate/up); the inverse of deinterleave.")
    schema = _schema("over", "dim", {"type": "integer"})

    def reduce(self, args: Any, ctx: Context, members: list[tuple[str, View]]) -> Value:
        first = _alike(ctx, self.verb, args, members)
        dim = _dim(ctx, args["dim"], first.shape, f"interleave over {args['over']}")
        parts = len(members)
        shape = first.shape[:dim] + (first.shape[dim] * parts,) + first.shape[dim + 1:]
        views = [v for _, v in members]
        if not first.nbytes:  # a header's claim alone: no bytes to list runs of
            return View(shape, first.dtype, ())
        if dim == 0:
            width = first.row_nbytes
            runs = join_runs(v.slice(j * width, width) for j in range(first.shape[0]) for v in views)
            return View(shape, first.dtype, runs)
        self._block_dim(ctx, first)
        return Block(self, {"dim": dim}, tuple(views), shape, first.dtype)

    def inverse(self, args: Any) -> tuple[str, Any]:
        return "deinterleave", {"into": args["over"], "dim": args["dim"]}

    def blocks(self, block: Block, inputs: Sequence[InputTensor], chunk_bytes: int,
               rows: range | None = None) -> Iterator[bytes | memoryview]:
        import numpy as np

        view, dim = inputs[0].view, block.args["dim"]
        mid, size, tail = _geometry(view.shape, dim)
        for first, count in _row_blocks(view, rows, chunk_bytes // len(inputs)):
            tiles = [np.frombuffer(m.read(first * view.row_nbytes, count * view.row_nbytes),
                                   dtype=_UINT[view.itemsize]).reshape(count, mid, size, tail) for m in inputs]
            yield np.stack(tiles, axis=3).tobytes()


def _row_blocks(view: View, rows: range | None, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """(first row, count) of the input's dim-0 blocks making output rows ``rows`` (all when
    None): about ``chunk_bytes`` of rows each, one row at least."""
    wanted = rows if rows is not None else range(view.shape[0])
    step = max(1, chunk_bytes // max(1, view.row_nbytes))
    for first in range(wanted.start, wanted.stop, step):
        yield first, min(step, wanted.stop - first)


def _heads(ctx: Context, verb: str, args: Any, rows: int, parts: int) -> int:
    """Rows per head and part (head_dim), refused when the rows are not [heads, parts, head_dim]."""
    heads = ctx.integer(args["heads"], f"{verb}.heads")
    if heads <= 0 or rows % (heads * parts):
        raise ctx.error(f"{verb}: {rows} rows are not {heads} heads of {parts} equal parts")
    return rows // (heads * parts)


class SplitHeads(OpDef):
    verb = "split_heads"
    kind = "split"
    accepts = Accepts(min_rank=1)
    description = ("Rows [heads, n, head_dim] -> n tensors of rows [heads, head_dim] (GPT-NeoX/Bloom per-head "
                   "query_key_value -> q, k, v).")
    schema = _schema("into", "heads", _EXPR)

    def split(self, args: Any, ctx: Context, value: View, names: tuple[str, ...] | None) -> list[tuple[str, Value]]:
        names = _names(ctx, self.verb, args["into"], names)
        rows, parts = value.shape[0], len(names)
        head_dim = _heads(ctx, self.verb, args, rows, parts)
        heads = rows // (parts * head_dim) if head_dim else 0
        shape = (rows // parts, *value.shape[1:])
        if not value.nbytes:  # a header's claim alone: no bytes to list runs of
            return [(name, View(shape, value.dtype, ())) for name in names]
        width = head_dim * value.row_nbytes
        return [(name, View(shape, value.dtype, join_runs(value.slice((h * parts + p) * width, width)
                                                          for h in range(heads))))
                for p, name in enumerate(names)]

    def inverse(self, args: Any) -> tuple[str, Any]:
        return "merge_heads", {"over": args["into"], "heads": args["heads"]}

    def describe(self, args: Any) -> str:
        return f"split_heads into {args['into']} heads={args['heads']}"


class MergeHeads(OpDef):
    verb = "merge_heads"
    kind = "reduce"
    accepts = Accepts(min_rank=1)
    description = ("n tensors of rows [heads, head_dim] -> rows [heads, n, head_dim], in the enumeration's order "
                   "(the inverse of split_heads).")
    schema = _schema("over", "heads", _EXPR)

    def reduce(self, args: Any, ctx: Context, members: list[tuple[str, View]]) -> Value:
        first = _alike(ctx, self.verb, args, members)
        head_dim = _heads(ctx, self.verb, args, first.shape[0], 1)
        if not first.nbytes:  # a header's claim alone: no bytes to list runs of
            return View((first.shape[0] * len(members), *first.shape[1:]), first.dtype, ())
        heads = first.shape[0] // head_dim if head_dim else 0
        width = head_dim * first.row_nbytes
        runs = join_runs(v.slice(h * width, width) for h in range(heads) for _, v in members)
        return View((first.shape[0] * len(members), *first.shape[1:]), first.dtype, runs)

    def inverse(self, args: Any) -> tuple[str, Any]:
        return "split_heads", {"into": args["over"], "heads": args["heads"]}

    def describe(self, args: Any) -> str:
        return f"merge_heads over {args['over']} heads={args['heads']}"
