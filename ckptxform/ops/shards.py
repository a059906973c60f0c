"""concat_shards: one tensor of a model-parallel checkpoint, its pieces in every shard file
concatenated (Meta's consolidated.NN.pth: ``sources/model_parallel.py``).

Nothing is decoded. Along dim 0 the pieces are runs one after another (a byte program).
Along an inner dim every output row is the pieces' rows side by side: as byte runs that
would be a run per row and shard (10 million for Llama-2-70B's wo, w2 and embedding), so
it is a block op instead, which reads a block of rows of every piece (one range each) and
interleaves them. On a source that is not split across files it is the identity, so one
rule converts MP=1 and MP=8 alike.

The whole size along the split dim (``size``, or the whole ``shape``) is checked against
the pieces: a source with fewer shard files than the size implies is refused, naming the
missing files. ``shape`` lets the pieces say which dim they split (null: not known), for
tensors split along different dims by different versions of a model (Llama 1/2 split the
embedding's columns, Llama 3 its rows).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from math import prod
from typing import Any

from .base import Accepts, Block, BlockOp, Context, InputTensor, Value, View
from .layout import _DIM, _EXPR, _dim, concat_views

Integer = Callable[[Any, str], int]


class ConcatShards(BlockOp):
    verb = "concat_shards"
    accepts = Accepts(min_rank=1)
    yields = "either"  # along dim 0 byte runs, along an inner dim a block op
    description = ("The tensor's pieces in every model-parallel shard file (consolidated.NN.pth), concatenated "
                   "along dim (its whole size, optional, checked: missing shard files are named), or along the "
                   "dim where they fall short of the whole shape [EXPR|null, ...]; first op of a chain; the "
                   "identity on a source that is one file.")
    schema = {"type": "object", "additionalProperties": False,
              "oneOf": [{"required": ["dim"]}, {"required": ["shape"]}],
              "properties": {"dim": _DIM, "size": _EXPR,
                             "shape": {"type": "array", "minItems": 1, "items": {"oneOf": [_EXPR, {"type": "null"}]}}}}

    def map(self, args: Any, ctx: Context, value: View) -> Value:
        shards = ctx.shards(value)
        dim, whole = split_dim(args, lambda v, what: ctx.integer(v, what), value.shape, len(shards.views), ctx)
        count, piece = len(shards.views), value.shape[dim]
        if whole is not None:
            said = args.get("size") if "dim" in args else args["shape"][dim]
            said = f" ({said})" if isinstance(said, str) else ""
            if piece == 0 or whole % piece:
                raise ctx.error(f"concat_shards: {shards.key!r} is {piece} along dim {dim} in each shard file, and "
                                f"the whole tensor has {whole}{said}, which is not a whole number of such pieces")
            need = whole // piece
            if need != count:
                files = ", ".join(shards.files[:4]) + (", ..." if count > 4 else "")
                why = (shards.missing(need) if need > count
                       else f"{count - need} more than the whole tensor needs; give only one checkpoint's shards")
                raise ctx.error(f"concat_shards: {shards.key!r} is {piece} along dim {dim} in each of its {count} "
                                f"shard file{'s' if count != 1 else ''} ({files}), {piece * count} in all, but the "
                                f"whole tensor has {whole}{said}: the checkpoint has {need} shards, and {why}",
                                key=shards.key)
        if count == 1:
            return value
        if dim == 0:
            return concat_views(list(shards.views), dim, value.dtype)
        shape = (*value.shape[:dim], piece * count, *value.shape[dim + 1:])
        return Block(self, {"dim": dim}, shards.views, shape, value.dtype)

    def blocks(self, block: Block, inputs: Sequence[InputTensor], chunk_bytes: int,
               rows: range | None = None) -> Iterator[bytes | memoryview]:
        import numpy as np

        dim, wanted = block.args["dim"], rows if rows is not None else range(block.shape[0])
        widths = [i.view.row_nbytes for i in inputs]
        outer = prod(block.shape[1:dim])  # the pieces' runs within one row
        step = max(1, chunk_bytes // max(1, sum(widths)))
        for first in range(wanted.start, wanted.stop, step):
            n = min(step, wanted.stop - first)
            pieces = [np.frombuffer(i.read(first * w, n * w), np.uint8).reshape(n, outer, w // max(1, outer))
                      for i, w in zip(inputs, widths)]
            yield memoryview(np.concatenate(pieces, axis=2)).cast("B")

    def inverse(self, args: Any) -> None:
        return None  # the inverse writes one whole tensor: an MP=1 checkpoint, nothing to split

    def describe(self, args: Any) -> str:
        return "concat_shards " + " ".join(f"{k}={json.dumps(v)}" for k, v in args.items())


def split_dim(args: Any, integer: Integer, shape: tuple[int, ...], count: int, ctx: Context) -> tuple[int, int | None]:
    """(the dim the pieces of ``shape`` are concatenated along, the whole size along it or None)."""
    if "dim" in args:
        dim = _dim(ctx, args["dim"], shape, "concat_shards")
        return dim, (integer(args["size"], "concat_shards.size") if "size" in args else None)
    if "size" in args:
        raise ctx.error("concat_shards: size goes with dim; with shape, the shape gives the whole size")
    want: Sequence[Any] = args["shape"]
    if len(want) != len(shape):
        raise ctx.error(f"concat_shards: shape {list(want)} has {len(want)} dims, and the tensor's pieces have "
                        f"shape {list(shape)}")
    whole = [None if w is None else integer(w, f"concat_shards.shape[{i}]") for i, w in enumerate(want)]
    short = [d for d, (w, s) in enumerate(zip(whole, shape)) if w is not None and w != s]
    unknown = [d for d, w in enumerate(whole) if w is None]
    if len(short) == 1:
        return short[0], whole[short[0]]
    if not short and (len(unknown) == 1 or count == 1):
        return (unknown or [0])[0], None
    shown = [w if w is not None else "null" for w in whole]
    why = ("differ from it in dims " + ", ".join(map(str, short)) if short
           else "already have it" if not unknown else "match it in every known dim, so the split dim is not known")
    raise ctx.error(f"concat_shards: the pieces (shape {list(shape)} in each of {count} shards) {why}; the "
                    f"shape {shown} must tell one split dim (or give dim)")
