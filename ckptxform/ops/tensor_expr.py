"""The tensor expressions of ``combine``: parsed and typed at plan time, evaluated in bands.

Grammar (Python's precedence; ``@`` binds as ``*`` does)::

    expr    := term (('+' | '-') term)*
    term    := unary (('*' | '/' | '@') unary)*
    unary   := '-' unary | postfix
    postfix := atom ('.T')*
    atom    := NAME | NUMBER | '${...}' | '(' expr ')'

A NAME is the op's input ``x`` or one of its ``inputs``; ``${...}`` is the rules' scalar
grammar (rules/expr.py), a number at plan time. Elementwise operators broadcast as numpy
does; ``@`` is a product of two 2-D tensors; ``.T`` transposes a 2-D tensor.

A parsed expression is plain data (nested tuples: the saved run plan holds it):
``("in", i)`` input ``i`` of the block, ``("num", v)``, ``("neg", a)``, ``("T", a)``,
``(op, a, b)`` for ``+ - * / @``.

Evaluation is a slice of the output at a time (``evaluate``): a slice along one axis is
pushed down the tree (rows of ``B @ A`` are rows of ``B`` times all of ``A``; rows of
``M.T`` are columns of ``M``; an operand broadcast along the axis is taken whole), so an
input is read a band of rows at a time where the expression reads it by rows, and whole
(once per band program) where it does not.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Tree = tuple[Any, ...]
Shape = tuple[int, ...]
#: (axis, start, stop) of a node's value, or None for all of it
Slice = tuple[int, int, int] | None

_TOKEN = re.compile(r"\s*(?:(?P<num>[0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?)|(?P<name>[A-Za-z_][A-Za-z0-9_]*)"
                    r"|(?P<T>\.T\b)|(?P<op>[-+*/@()])|(?P<dollar>\$\{))")
_ELEMENTWISE = ("+", "-", "*", "/")


class ExprError(ValueError):
    """A malformed or ill-typed expression (the op adds its FILE:LINE)."""


@dataclass(frozen=True)
class Parsed:
    """An expression before its names are bound: names as ``("name", NAME)``, scalars as
    ``("scalar", TEXT)``."""

    text: str
    tree: Tree

    def names(self) -> list[str]:
        out: list[str] = []

        def walk(node: Tree) -> None:
            if node[0] == "name" and node[1] not in out:
                out.append(node[1])
            for child in node[1:]:
                if isinstance(child, tuple):
                    walk(child)
        walk(self.tree)
        return out


def parse(text: str) -> Parsed:
    tokens = _tokenize(text)
    parser = _Parser(tokens, text)
    tree = parser.expr()
    if parser.pos != len(tokens):
        raise ExprError(f"unexpected {tokens[parser.pos][1]!r} at column {tokens[parser.pos][2] + 1} of {text!r}")
    return Parsed(text, tree)


def _tokenize(text: str) -> list[tuple[str, str, int]]:
    tokens, pos = [], 0
    while text[pos:].strip():
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            col = pos + len(text[pos:]) - len(text[pos:].lstrip())
            raise ExprError(f"unexpected {text[col]!r} at column {col + 1} of {text!r}")
        kind = m.lastgroup
        assert kind is not None
        if kind == "dollar":  # to the matching '}' (a ${...} may hold {VAR} templates)
            start, depth, end = m.start(kind), 1, m.end()
            while end < len(text) and depth:
                depth += {"{": 1, "}": -1}.get(text[end], 0)
                end += 1
            if depth:
                raise ExprError(f"'${{' at column {start + 1} of {text!r} is never closed")
            tokens.append(("scalar", text[start:end], start))
            pos = end
            continue
        tokens.append((kind, m.group(kind), m.start(kind)))
        pos = m.end()
    return tokens


class _Parser:
    def __init__(self, tokens: list[tuple[str, str, int]], text: str) -> None:
        self.tokens, self.text, self.pos = tokens, text, 0

    def _peek(self) -> tuple[str, str, int] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def expr(self) -> Tree:
        node = self.term()
        while (tok := self._peek()) is not None and tok[1] in ("+", "-"):
            self.pos += 1
            node = (tok[1], node, self.term())
        return node

    def term(self) -> Tree:
        node = self.unary()
        while (tok := self._peek()) is not None and tok[1] in ("*", "/", "@"):
            self.pos += 1
            node = (tok[1], node, self.unary())
        return node

    def unary(self) -> Tree:
        tok = self._peek()
        if tok is not None and tok[1] == "-":
            self.pos += 1
            return ("neg", self.unary())
        node = self.atom()
        while (tok := self._peek()) is not None and tok[0] == "T":
            self.pos += 1
            node = ("T", node)
        return node

    def atom(self) -> Tree:
        tok = self._peek()
        if tok is None:
            raise ExprError(f"{self.text!r} ends where a name, a number or '(' is expected")
        kind, text, col = tok
        self.pos += 1
        if kind == "num":
            return ("num", float(text))
        if kind == "name":
            return ("name", text)
        if kind == "scalar":
            return ("scalar", text)
        if text == "(":
            node = self.expr()
            close = self._peek()
            if close is None or close[1] != ")":
                raise ExprError(f"'(' at column {col + 1} of {self.text!r} is never closed")
            self.pos += 1
            return node
        raise ExprError(f"unexpected {text!r} at column {col + 1} of {self.text!r}")


def bind(parsed: Parsed, index: Callable[[str], int], scalar: Callable[[str], float]) -> Tree:
    """The tree with each name replaced by its input's index and each ``${...}`` by its value."""
    def walk(node: Tree) -> Tree:
        if node[0] == "name":
            return ("in", index(node[1]))
        if node[0] == "scalar":
            return ("num", float(scalar(node[1])))
        if node[0] == "num":
            return node
        return (node[0], *(walk(c) for c in node[1:]))
    return walk(parsed.tree)


def text_of(node: Tree, names: Sequence[str]) -> str:
    """The expression of ``node`` as written (inputs by name), for messages."""
    kind = node[0]
    if kind == "in":
        return names[node[1]]
    if kind == "num":
        return repr(node[1])
    if kind == "neg":
        return f"-{text_of(node[1], names)}"
    if kind == "T":
        return f"{text_of(node[1], names)}.T"
    return f"({text_of(node[1], names)} {kind} {text_of(node[2], names)})"


def shape_of(node: Tree, shapes: Sequence[Shape], names: Sequence[str]) -> Shape:
    """The shape of ``node``'s value; ``ExprError`` names the operands that do not fit."""
    kind = node[0]
    if kind == "in":
        return shapes[node[1]]
    if kind == "num":
        return ()
    if kind == "neg":
        return shape_of(node[1], shapes, names)
    if kind == "T":
        inner = shape_of(node[1], shapes, names)
        if len(inner) != 2:
            raise ExprError(f"{text_of(node[1], names)} has shape {list(inner)}; .T transposes a 2-D tensor")
        return (inner[1], inner[0])
    left, right = shape_of(node[1], shapes, names), shape_of(node[2], shapes, names)
    if kind == "@":
        if len(left) != 2 or len(right) != 2 or left[1] != right[0]:
            raise ExprError(f"{text_of(node[1], names)} {list(left)} @ {text_of(node[2], names)} {list(right)}: "
                            "@ multiplies a 2-D [m, k] by a 2-D [k, n]")
        return (left[0], right[1])
    out = broadcast(left, right)
    if out is None:
        raise ExprError(f"{text_of(node[1], names)} {list(left)} {kind} {text_of(node[2], names)} {list(right)}: "
                        "the shapes do not broadcast")
    return out


def broadcast(a: Shape, b: Shape) -> Shape | None:
    """numpy's broadcast of two shapes, or None."""
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else 1
        y = b[-i] if i <= len(b) else 1
        if x != y and 1 not in (x, y):
            return None
        out.append(max(x, y) if 1 not in (x, y) else x * y)
    return tuple(reversed(out))


def evaluate(node: Tree, shapes: Sequence[Shape], leaf: Callable[[int, Slice], Any], sl: Slice, xp: Any) -> Any:
    """The value of ``node`` (slice ``sl`` of it), from ``leaf(i, slice)``: the slice of input
    ``i``. ``xp`` is the array module's operators (``torch``)."""
    kind = node[0]
    if kind == "in":
        return leaf(node[1], sl)
    if kind == "num":
        return node[1]
    if kind == "neg":
        return -evaluate(node[1], shapes, leaf, sl, xp)
    if kind == "T":
        inner = None if sl is None else (1 - sl[0], sl[1], sl[2])
        return evaluate(node[1], shapes, leaf, inner, xp).T
    a, b = node[1], node[2]
    if kind == "@":
        if sl is None:
            return xp.matmul(evaluate(a, shapes, leaf, None, xp), evaluate(b, shapes, leaf, None, xp))
        if sl[0] == 0:
            return xp.matmul(evaluate(a, shapes, leaf, sl, xp), evaluate(b, shapes, leaf, None, xp))
        return xp.matmul(evaluate(a, shapes, leaf, None, xp), evaluate(b, shapes, leaf, (1, sl[1], sl[2]), xp))
    names = [str(i) for i in range(len(shapes))]
    out_rank = len(shape_of(node, shapes, names))
    left = evaluate(a, shapes, leaf, _operand_slice(sl, shape_of(a, shapes, names), out_rank), xp)
    right = evaluate(b, shapes, leaf, _operand_slice(sl, shape_of(b, shapes, names), out_rank), xp)
    return {"+": xp.add, "-": xp.sub, "*": xp.mul, "/": xp.div}[kind](left, right)


def _operand_slice(sl: Slice, shape: Shape, out_rank: int) -> Slice:
    """The slice of an operand of shape ``shape`` that broadcasts to slice ``sl`` of the
    result (rank ``out_rank``): None where the operand is broadcast along the axis."""
    if sl is None:
        return None
    axis = sl[0] - (out_rank - len(shape))
    if axis < 0 or shape[axis] == 1:
        return None
    return (axis, sl[1], sl[2])
