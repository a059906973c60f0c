"""Layout ops: stack / unstack, concat / split, and row permutations (RoPE, resize).

Each rewrites a ``View``: the output is byte runs of the inputs, streamed (or copied in
the kernel) without decoding a value.
"""

from __future__ import annotations

from typing import Any

from .base import Accepts, Context, IndexNames, NoInverse, OpDef, Value, View, join_runs, outer_inner

_EXPR = {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": r"^\$\{.*\}$"}]}
_VAR = {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"}
_DIM = {"type": "integer"}


def _counted(var_key: str) -> dict[str, Any]:
    """The schema of stack/unstack: the variable and an optional count."""
    return {"type": "object", "additionalProperties": False, "required": [var_key],
            "properties": {var_key: _VAR, "count": _EXPR}}


def _dim(ctx: Context, dim: int, shape: tuple[int, ...], what: str) -> int:
    rank = len(shape)
    if not -rank <= dim < rank:
        raise ctx.error(f"{what}: dim {dim} is outside a tensor of shape {list(shape)}")
    return dim % rank


def _same_dtype(ctx: Context, verb: str, members: list[tuple[str, View]]) -> str:
    dtypes = sorted({v.dtype for _, v in members})
    if len(dtypes) > 1:
        listing = ", ".join(f"{name}: {v.dtype}" for name, v in members)
        raise ctx.error(f"{verb}: the tensors have different dtypes ({listing}); cast them first")
    return dtypes[0]


class Stack(OpDef):
    verb = "stack"
    kind = "reduce"
    description = "New dim 0 over a template variable, in natural index order (expert 10 after 9)."
    schema = _counted("over")

    def expected(self, args: Any, ctx: Context) -> IndexNames | None:
        if "count" not in args:
            return None
        count = ctx.integer(args["count"], "stack.count")
        if count < 0:
            raise ctx.error(f"stack over {args['over']}: count {args['count']!r} is {count}, a negative number "
                            "of members; fix the count (or the config field it reads)")
        return IndexNames(count)

    def reduce(self, args: Any, ctx: Context, members: list[tuple[str, View]]) -> Value:
        shapes = {v.shape for _, v in members}
        if len(shapes) > 1:
            listing = ", ".join(f"{name}: {list(v.shape)}" for name, v in members)
            raise ctx.error(f"stack over {args['over']}: the tensors have different shapes ({listing})")
        dtype = _same_dtype(ctx, "stack", members)
        return View((len(members), *members[0][1].shape), dtype, join_runs(v.runs for _, v in members))

    def inverse(self, args: Any) -> tuple[str, Any]:
        # The forward checked the count; the unstack reads it from dim 0 (a count from
        # the forward source's shapes or config would not resolve on the inverse's).
        return "unstack", {"into": args["over"]}


class Unstack(OpDef):
    verb = "unstack"
    kind = "split"
    description = "Dim 0 into one tensor per index (never squeezes other size-1 dims)."
    accepts = Accepts(min_rank=1)
    schema = _counted("into")

    def split(self, args: Any, ctx: Context, value: View, names: tuple[str, ...] | None) -> list[tuple[str, Value]]:
        if not value.shape:
            raise ctx.error("unstack: a scalar has no dim 0 to unstack")
        count = value.shape[0]
        if "count" in args:
            want = ctx.integer(args["count"], "unstack.count")
            if want != count:
                raise ctx.error(f"unstack: count is {want} but dim 0 of the tensor is {count}")
        if count and not value.nbytes:
            # a header's dim 0 alone would make that many outputs, each of no bytes
            raise ctx.error(f"unstack: dim 0 of the tensor (shape {list(value.shape)}) is {count:,} but it holds "
                            "no bytes: there is nothing to unstack")
        per = value.row_nbytes
        return [(str(i), View(value.shape[1:], value.dtype, tuple(value.slice(i * per, per))))
                for i in range(count)]

    def inverse(self, args: Any) -> tuple[str, Any]:
        return "stack", {"over": args["into"], **({"count": args["count"]} if "count" in args else {})}


def concat_views(views: list[View], dim: int, dtype: str) -> View:
    outer, _ = outer_inner(views[0].shape, dim, 1)
    chunks = [outer_inner(v.shape, dim, v.itemsize)[1] for v in views]
    runs = join_runs(v.slice(o * c, c) for o in range(outer) for v, c in zip(views, chunks))
    shape = list(views[0].shape)
    shape[dim] = sum(v.shape[dim] for v in views)
    return View(tuple(shape), dtype, runs)


class Concat(OpDef):
    verb = "concat"
    kind = "reduce"
    accepts = Accepts(min_rank=1)
    description = ("Along dim, in the enumeration's listed order; sizes (optional: a list, or 'equal') "
                   "are checked, and let `ckptxform invert` write the split back.")
    schema = {"type": "object", "additionalProperties": False, "required": ["over", "dim"],
              "properties": {"over": _VAR, "dim": _DIM, "sizes": {"oneOf": [
                  {"type": "array", "items": _EXPR, "minItems": 1},
                  {"const": "equal", "description": "every part has the same size along dim (gate and up)"}]}}}

    def reduce(self, args: Any, ctx: Context, members: list[tuple[str, View]]) -> Value:
        first = members[0][1].shape
        dim = _dim(ctx, args["dim"], first, f"concat over {args['over']}")
        for name, v in members:
            if len(v.shape) != len(first) or v.shape[:dim] + v.shape[dim + 1:] != first[:dim] + first[dim + 1:]:
                listing = ", ".join(f"{n}: {list(m.shape)}" for n, m in members)
                raise ctx.error(f"concat over {args['over']} along dim {dim}: shapes differ outside dim {dim} "
                                f"({listing})")
        got = [v.shape[dim] for _, v in members]
        if args.get("sizes") == "equal":
            if len(set(got)) > 1:
                raise ctx.error(f"concat over {args['over']}: sizes: equal, but the tensors have {got} "
                                f"along dim {dim}")
        elif "sizes" in args:
            want = [ctx.integer(s, "concat.sizes") for s in args["sizes"]]
            if want != got:
                raise ctx.error(f"concat over {args['over']}: sizes are {want} but the tensors have {got} "
                                f"along dim {dim}")
        return concat_views([v for _, v in members], dim, _same_dtype(ctx, "concat", members))

    def inverse(self, args: Any) -> tuple[str, Any]:
        if "sizes" not in args:
            raise NoInverse("it has no sizes, so the inverse split cannot know where to cut; add "
                            "sizes: [...] (or sizes: equal) to the concat (they are checked at plan time)")
        if args["sizes"] == "equal":
            return "split", {"into": args["over"], "dim": args["dim"]}
        return "split", {"into": args["over"], "dim": args["dim"], "sizes": args["sizes"]}


class Split(OpDef):
    verb = "split"
    kind = "split"
    accepts = Accepts(min_rank=1)
    description = "Along dim by sizes (equal parts, one per enumeration value, when omitted)."
    schema = {"type": "object", "additionalProperties": False, "required": ["into", "dim"],
              "properties": {"into": _VAR, "dim": _DIM, "sizes": {"type": "array", "items": _EXPR, "minItems": 1}}}

    def split(self, args: Any, ctx: Context, value: View, names: tuple[str, ...] | None) -> list[tuple[str, Value]]:
        var = args["into"]
        dim = _dim(ctx, args["dim"], value.shape, f"split into {var}")
        total = value.shape[dim]
        if names is None:
            raise ctx.error(f"split into {var}: 'to' must enumerate {var} ({{{var}:a,b,...}}) to name the parts")
        if "sizes" in args:
            sizes = [ctx.integer(s, "split.sizes") for s in args["sizes"]]
            if len(sizes) != len(names):
                raise ctx.error(f"split into {var}: {len(sizes)} sizes for {len(names)} parts ({', '.join(names)})")
            if sum(sizes) != total:
                raise ctx.error(f"split into {var}: sizes {sizes} add up to {sum(sizes)} but dim {dim} of the "
                                f"tensor (shape {list(value.shape)}) is {total}")
        else:
            if total % len(names):
                raise ctx.error(f"split into {var}: dim {dim} ({total}) does not split into {len(names)} equal "
                                "parts; give sizes")
            sizes = [total // len(names)] * len(names)
        outer, whole = outer_inner(value.shape, dim, value.itemsize)
        inner = whole // total if total else 0
        out: list[tuple[str, Value]] = []
        offset = 0
        for name, size in zip(names, sizes):
            shape = list(value.shape)
            shape[dim] = size
            runs = join_runs(value.slice(o * whole + offset * inner, size * inner) for o in range(outer))
            out.append((name, View(tuple(shape), value.dtype, runs)))
            offset += size
        return out

    def inverse(self, args: Any) -> tuple[str, Any]:
        return "concat", {"over": args["into"], "dim": args["dim"], **({"sizes": args["sizes"]} if "sizes" in args else {})}


def rope_order(rows: int, heads: int, inverse: bool) -> list[int]:
    """Source row of each output row of the RoPE permute (Meta -> HF: within each head, the
    interleaved pairs (2i, 2i+1) become halves: row h*hd + t*hd/2 + i <- h*hd + 2i + t)."""
    hd = rows // heads
    half = hd // 2
    order = [0] * rows
    for h in range(heads):
        for i in range(half):
            for t in range(2):
                interleaved, halves = h * hd + 2 * i + t, h * hd + t * half + i
                if inverse:
                    order[interleaved] = halves
                else:
                    order[halves] = interleaved
    return order


class _RowOrder(OpDef):
    """A row permutation with a named inverse (a byte program: rows are runs)."""

    inverse_verb: str
    accepts = Accepts(min_rank=1)

    def inverse(self, args: Any) -> tuple[str, Any]:
        return self.inverse_verb, args

    def describe(self, args: Any) -> str:
        return f"{self.verb} " + " ".join(f"{k}={v}" for k, v in args.items())


class RopePermute(_RowOrder):
    verb = "rope_permute"
    inverse_verb = "rope_unpermute"
    description = ("Meta/Mistral -> HF row order of q or k: view(n, hd//2, 2, in).transpose(1, 2); "
                   "give heads (for k: the kv-head count) or head_dim (the same for q and k).")
    schema = {"type": "object", "additionalProperties": False, "oneOf": [{"required": ["heads"]},
                                                                         {"required": ["head_dim"]}],
              "properties": {"heads": _EXPR, "head_dim": _EXPR}}

    def map(self, args: Any, ctx: Context, value: View) -> Value:
        rows = value.shape[0] if value.shape else 0
        if "head_dim" in args:
            size = ctx.integer(args["head_dim"], f"{self.verb}.head_dim")
            if size <= 0 or rows % size:
                raise ctx.error(f"{self.verb}: {rows} rows are not whole heads of head_dim {size}")
            heads = rows // size
        else:
            heads = ctx.integer(args["heads"], f"{self.verb}.heads")
        if heads <= 0 or rows % heads or (rows // heads) % 2:
            raise ctx.error(f"{self.verb}: {rows} rows do not make {heads} heads of an even head size")
        if not value.nbytes:  # rows of no bytes (a header's claim alone): nothing to reorder or list
            return value
        return value.rows(rope_order(rows, heads, self.verb != "rope_permute"), value.shape)


class RopeUnpermute(RopePermute):
    verb = "rope_unpermute"
    inverse_verb = "rope_permute"
    description = "HF -> Meta/Mistral row order (the inverse of rope_permute)."


def interleave_order(heads: int, kv_heads: int, head_dim: int, inverse: bool) -> list[int]:
    """Source row of each output row of the Megatron GQA interleave: [q; k; v] rows become,
    for each kv group g, [the heads/kv_heads q heads of g; k_g; v_g]."""
    per = heads // kv_heads
    order: list[int] = []
    for g in range(kv_heads):
        for h in range(g * per, (g + 1) * per):
            order += range(h * head_dim, (h + 1) * head_dim)
        order += range((heads + g) * head_dim, (heads + g + 1) * head_dim)
        order += range((heads + kv_heads + g) * head_dim, (heads + kv_heads + g + 1) * head_dim)
    if not inverse:
        return order
    back = [0] * len(order)
    for out_row, src_row in enumerate(order):
        back[src_row] = out_row
    return back


class QkvInterleave(_RowOrder):
    verb = "qkv_interleave"
    inverse_verb = "qkv_deinterleave"
    description = ("Fused [q; k; v] rows -> Megatron's linear_qkv order: per kv group, its q heads, "
                   "then k, then v.")
    schema = {"type": "object", "additionalProperties": False, "required": ["heads", "kv_heads"],
              "properties": {"heads": _EXPR, "kv_heads": _EXPR}}

    def map(self, args: Any, ctx: Context, value: View) -> Value:
        heads = ctx.integer(args["heads"], f"{self.verb}.heads")
        kv = ctx.integer(args["kv_heads"], f"{self.verb}.kv_heads")
        rows = value.shape[0] if value.shape else 0
        if kv <= 0 or heads % kv or rows % (heads + 2 * kv):
            raise ctx.error(f"{self.verb}: {rows} rows are not q, k and v of {heads} heads with {kv} kv heads")
        if not value.nbytes:  # rows of no bytes (a header's claim alone): nothing to reorder or list
            return value
        order = interleave_order(heads, kv, rows // (heads + 2 * kv), self.verb != "qkv_interleave")
        return value.rows(order, value.shape)


class QkvDeinterleave(QkvInterleave):
    verb = "qkv_deinterleave"
    inverse_verb = "qkv_interleave"
    description = "Megatron's linear_qkv order -> fused [q; k; v] rows (the inverse of qkv_interleave)."
