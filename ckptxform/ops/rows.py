"""permute_rows: a tensor's rows reordered by two vocabulary maps, the rows of tokens the
source vocabulary lacks filled (``missing_rows``). Written at rule level (``permute_rows:``
with ``missing_rows:`` beside it, which the loader turns into this op) or in ``ops:``.

The program is a row view over the source (every run of adjacent rows one run, so a local
lm_head is written by one kernel copy per run) plus, for the rows it lacks: zeros, a run of
zero bytes; ``rows_of`` another tensor of the same dtype, runs of that tensor's rows; and
``mean``, ``normal`` or ``rows_of`` a tensor of another dtype, the rows of a small block op
(``FillRows``), the only part that decodes values.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from math import prod
from typing import Any

from ..dtypes import DTYPE_SIZES, cast_problem, decodable, is_float
from ..errors import printable
from .accounts import RowAccount, RowsOrigin
from .base import Accepts, Block, BlockOp, Context, InputTensor, NoInverse, OpDef, Run, View, join_runs
from .decode import cast_bytes
from .fills import NormalRows, mean_row


class FillRows(BlockOp):
    """The filled rows of a permutation, in order: the mean of the rows taken from the
    source, seeded normal values, or another tensor's rows cast to the output dtype."""

    verb = "fill_rows"  # not a verb of ``ops:``: made by permute_rows only
    fills = True
    description = "The rows permute_rows fills (mean, normal, or rows of another dtype)."
    schema: dict[str, Any] = {}

    def inverse(self, args: Any) -> tuple[str, Any]:
        raise NoInverse("filled rows are made, not moved")

    def blocks(self, block: Block, inputs: Sequence[InputTensor], chunk_bytes: int,
               rows: range | None = None) -> Iterator[bytes | memoryview]:
        count, row_shape = block.shape[0], block.shape[1:]
        width = DTYPE_SIZES[block.dtype] * prod(row_shape)
        wanted = rows if rows is not None else range(count)
        step = max(1, chunk_bytes // max(1, width))
        init = block.args["init"]
        if init == "cast":  # rows of another tensor, in its dtype
            (source,) = inputs
            src_width = source.view.row_nbytes
            for first in range(wanted.start, wanted.stop, step):
                n = min(step, wanted.stop - first)
                yield cast_bytes(source.read(first * src_width, n * src_width), source.view.dtype, block.dtype)
        elif init == "mean":
            (source,) = inputs
            have, src_width = source.view.shape[0], source.view.row_nbytes
            spans = [(first, min(step, have - first)) for first in range(0, have, step)]
            mean = mean_row(((source.read(f * src_width, n * src_width), n) for f, n in spans), row_shape,
                            block.dtype)
            for first in range(wanted.start, wanted.stop, step):
                yield mean * min(step, wanted.stop - first)
        else:  # normal: one stream from the first filled row, whatever range is asked
            normal = NormalRows(block.args["seed"], block.args["std"], row_shape, block.dtype)
            for first in range(0, wanted.stop, step):
                n = min(step, wanted.stop - first)
                values = normal.take(n)
                if first + n > wanted.start:
                    yield values[max(0, wanted.start - first) * width:]


FILL_ROWS = FillRows()



class PermuteRows(OpDef):
    """Output row ``j`` is the input's row for the token of draft index ``j`` of vocabulary
    ``to``, found through vocabulary ``from``; rows of tokens ``from`` lacks come from
    ``missing_rows``."""

    verb = "permute_rows"
    action = "permuted"
    description = ("Reorder dim 0 from vocabulary map `from` to map `to` (row j: the row of to's token j); "
                   "`missing_rows` fills tokens `from` lacks: {rows_of: SOURCE, tensor: KEY} or "
                   "{init: zeros|mean|normal}.")
    schema: dict[str, Any] = {
        "type": "object", "additionalProperties": False, "required": ["from", "to"],
        "properties": {"from": {"$ref": "#/$defs/identifier"}, "to": {"$ref": "#/$defs/identifier"},
                       "missing_rows": {"$ref": "#/$defs/missingRows"}}}
    accepts = Accepts(min_rank=1)

    def sources(self, args: Any) -> tuple[str, ...]:
        fill = args.get("missing_rows") or {}
        return (fill["rows_of"],) if "rows_of" in fill else ()

    def inverse(self, args: Any) -> tuple[str, Any]:
        raise NoInverse("a vocabulary permutation (with filled rows) has no inverse")

    def describe(self, args: Any) -> str:
        return f"permute_rows {args['from']} -> {args['to']}"

    def map(self, args: Any, ctx: Context, value: View) -> View:
        src, dst = args["from"], args["to"]
        origin = ctx.tensor_of(value)
        source, key, whole = origin if origin is not None else ("", "", False)
        named = f"{source}:{printable(key)}" if whole else f"the input of {self.verb}"
        size = ctx.vocab(src).draft_size
        if not value.shape or value.shape[0] != size:
            raise ctx.error(
                f"{named} has {value.shape[0] if value.shape else 0} rows but vocabulary map {src!r} has "
                f"{size} draft tokens; permute_rows.from must be the map this tensor's rows are indexed by",
                key=key or None)
        rows, targets = ctx.alignment(src, dst).source_index, ctx.vocab(dst).target_ids
        filled = rows.count(-1)
        fill = args.get("missing_rows")
        if filled and fill is None:
            raise ctx.error(
                f"{filled} of {len(rows)} rows of {key!r} are tokens of {dst!r} absent from {src!r}; add "
                "missing_rows (rows_of a full-vocabulary tensor such as the verifier's lm_head, or init: "
                "zeros|mean|normal)", key=key or None)
        present = tuple(i for i in rows if i >= 0)
        missing = [t for r, t in zip(rows, targets) if r < 0]
        reads = [(source, key, present)] if whole else []
        init = None if fill is None or not filled else fill.get("init", "rows_of")
        problem = _fill_problem(init, value.dtype)
        if problem is not None:
            raise ctx.error(f"missing_rows init: {init} {problem} ({key or 'the input'!r} is {value.dtype}); "
                            f"{'use init: zeros, or ' if init != 'zeros' else 'use '}rows_of a tensor that has the rows",
                            key=key or None)
        fill_view = None
        if init == "rows_of":
            assert fill is not None
            fill_view = self._fill_tensor(ctx, fill, value, key, max(missing), filled, (src, dst))
            reads.append((fill["rows_of"], fill["tensor"], tuple(missing)))
        view = _permuted(ctx, value, rows, targets, fill if init else None, fill_view)
        label = None if init is None else f"{fill['rows_of']}:{fill['tensor']}" if init == "rows_of" else init
        account = RowAccount(source, len(rows) - filled, filled, init, label)
        said = "" if fill is None else f"{fill['rows_of']}:{fill['tensor']}" if "rows_of" in fill else fill["init"]
        ctx.account(RowsOrigin(source, key, account, tuple(reads)),
                    f"rows permuted {src} -> {dst}: {account.from_source} from the source, {filled} filled"
                    + (f" ({said})" if said else ""))
        return view

    def _fill_tensor(self, ctx: Context, fill: dict[str, Any], value: View, key: str, needed: int, filled: int,
                     maps: tuple[str, str]) -> View:
        """The ``rows_of`` tensor, checked: rows of the input's width for every missing token."""
        src, dst = maps
        name = f"{fill['rows_of']}:{fill['tensor']}"
        fb, dtype = ctx.other_tensor(fill["rows_of"], fill["tensor"], "missing_rows")
        if len(fb.shape) != len(value.shape) or fb.shape[1:] != value.shape[1:] or fb.shape[0] <= needed:
            raise ctx.error(
                f"missing_rows tensor {name} has shape {list(fb.shape)}; rows of shape {list(value.shape[1:])} for "
                f"target ids up to {needed} are needed: point missing_rows at a full-vocabulary tensor of the "
                "same width", key=fill["tensor"])
        why = cast_problem(dtype, value.dtype)
        if why is not None:
            raise ctx.error(
                f"missing_rows tensor {name} is {dtype} and the rows of {key!r} are "
                f"{value.dtype}; that cast cannot be exact: {why}; point missing_rows at a tensor of a "
                "compatible dtype", key=fill["tensor"])
        ctx.lend(fill["rows_of"], fill["tensor"], "missing_rows",
                 f"{filled} rows read for tokens of {dst!r} absent from {src!r}"
                 + (f", cast {dtype} -> {value.dtype}" if dtype != value.dtype else ""))
        return fb


def _fill_problem(init: str | None, dtype: str) -> str | None:
    """Why ``init`` cannot fill rows of ``dtype`` (None when it can)."""
    if init in ("mean", "normal") and not (is_float(dtype) and decodable(dtype)):
        return "makes float values"
    if init == "zeros" and dtype == "F8_E8M0":
        return "cannot fill a power-of-two scale, which has no zero"
    return None


def _permuted(ctx: Context, source: View, rows: Sequence[int], targets: Sequence[int],
              fill: dict[str, Any] | None, fill_view: View | None) -> View:
    """Output row ``j`` is row ``rows[j]`` of ``source``; where that is -1, the row for target
    token ``targets[j]`` made per ``fill`` (``init``: zeros, mean, normal, else ``rows_of``
    ``fill_view``). A fill that makes values is a ``FillRows`` block, one more input of the
    chain that the runs point at."""
    width = source.row_nbytes
    shape = (len(rows), *source.shape[1:])
    missing = [t for r, t in zip(rows, targets) if r < 0]
    init = None if fill is None else fill.get("init", "rows_of")
    block = None
    if init == "rows_of" and fill_view is not None and fill_view.dtype != source.dtype:
        block = Block(FILL_ROWS, {"init": "cast"}, (fill_view.rows(missing),), (len(missing), *shape[1:]),
                      source.dtype)
    elif init == "mean":
        present = sorted({r for r in rows if r >= 0})
        block = Block(FILL_ROWS, {"init": "mean"}, (source.rows(present),), (len(missing), *shape[1:]), source.dtype)
    elif init == "normal":
        assert fill is not None
        block = Block(FILL_ROWS, {"init": "normal", "std": float(fill.get("std", 0.02)),
                                  "seed": int(fill.get("seed", 0))}, (), (len(missing), *shape[1:]), source.dtype)
    made = ctx.block_input(block) if block is not None else None
    pieces: list[Sequence[Run]] = []
    filled = 0
    for row, target in zip(rows, targets):
        if row >= 0:
            pieces.append(source.slice(row * width, width))
            continue
        if made is not None:
            pieces.append(made.slice(filled * width, width))
        elif init == "rows_of":
            assert fill_view is not None
            pieces.append(fill_view.slice(target * width, width))
        else:
            pieces.append((Run(-1, 0, width),))
        filled += 1
    return View(shape, source.dtype, join_runs(pieces))
