"""``${...}``: the one safe arithmetic expression grammar of rule files.

Used by the loader (syntax and reference checks, at validate time), the planner (op
arguments such as ``count``, ``sizes`` or an ``add``'s value) and the config builder
(``config.set``)::

    whole   := expr [' ?? ' (JSON | expr)]  (the fallback when a config field is absent)
    expr    := term (('+' | '-') term)*
    term    := unary (('*' | '//' | '%') unary)*
    unary   := '-' unary | power
    power   := atom ['**' unary]         (right to left, as in Python: 2 ** -1 is 0.5)
    atom    := INT | FLOAT | REF | 'sqrt' '(' expr ')' | '(' expr ')' | LISTFN '(' expr ',' expr ')'
    REF     := config.PATH | shape.KEY[INT] | vocab.NAME.draft_size | vocab.NAME.vocab_size
             | source.NAME.repo | source.NAME.revision | source.NAME.location
             | source.NAME.config[.PATH] | output.dtype
    LISTFN  := without                 (the list without the elements equal to the value)

No names are looked up in Python, nothing is ``eval``-ed: a reference is resolved by the
caller's function. An expression that is one reference yields the referenced value as it
is (a string, a mapping); arithmetic takes numbers only. Integers stay integers (exact,
as counts and sizes need): ``//`` and ``%`` take integers only, and a value is a float
only where a float literal, a float field, ``sqrt`` or a negative power makes it one.
A list of numbers takes a number element by element (``config.target_layer_ids + 1``):
see ``_lists``.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_WHOLE = re.compile(r"^\$\{(.*)\}$", re.DOTALL)
_TOKEN = re.compile(r"\s*(?:(?P<float>[0-9]+(?:\.[0-9]+(?:[eE][-+]?[0-9]+)?|[eE][-+]?[0-9]+))|(?P<int>[0-9]+)"
                    r"|(?P<op>//|\*\*|[-+*%(),])|(?P<func>sqrt)(?=\s*\()"
                    r"|(?P<ref>[A-Za-z_][^\s+*%(),\-/]*(?:\[[0-9]+\])?))")
_SHAPE = re.compile(r"^shape\.(?P<key>.+)\[(?P<dim>[0-9]+)\]$")
_MAX_DIGITS = 19  # integers of a rule file stay within 64 bits
_MAX_BITS = 64
#: parentheses, signs, powers, calls and chained operators nested deeper than this are
#: refused (evaluation recurses once per level; no rule needs more than a few)
MAX_DEPTH = 100

REFERENCE_FORMS = ("${config.PATH}, ${shape.KEY[I]}, ${vocab.NAME.draft_size}, ${vocab.NAME.vocab_size}, "
                   "${source.NAME.repo}, ${source.NAME.config.PATH} or ${output.dtype}")


class ExpressionError(ValueError):
    """A malformed expression; ``col`` is the 0-based position in the ``${...}`` body."""

    def __init__(self, message: str, col: int = 0) -> None:
        super().__init__(message)
        self.col = col


@dataclass(frozen=True)
class Ref:
    """A reference: ``kind`` is config, shape, vocab, source or output."""

    kind: str
    path: tuple[str, ...]
    dim: int | None = None

    def text(self) -> str:
        body = ".".join((self.kind, *self.path))
        return body + (f"[{self.dim}]" if self.dim is not None else "")


@dataclass(frozen=True)
class Num:
    value: int | float


@dataclass(frozen=True)
class Neg:
    operand: Node


@dataclass(frozen=True)
class Call:
    """``sqrt(x)``, the one function of the grammar."""

    name: str
    operand: Node


@dataclass(frozen=True)
class BinOp:
    op: str
    left: Node
    right: Node


@dataclass(frozen=True)
class ListCall:
    """A function on lists (``LIST_FUNCTIONS``) of its arguments."""

    name: str
    args: tuple[Node, ...]


Node = Num | Ref | Neg | Call | BinOp | ListCall

#: name -> argument count of the functions on lists
LIST_FUNCTIONS = {"without": 2}


@dataclass(frozen=True)
class Expression:
    """A parsed ``${...}``; ``evaluate`` resolves its references with the caller's function."""

    text: str
    root: Node
    #: ``${config.flag ?? false}``: the value used when a config field is absent
    default: Any = None
    has_default: bool = False
    #: ``${config.block_size ?? config.dflash_config.block_size}``: an expression instead
    fallback: Node | None = None

    def refs(self) -> list[Ref]:
        out: list[Ref] = []

        def walk(node: Node) -> None:
            if isinstance(node, Ref):
                out.append(node)
            elif isinstance(node, (Neg, Call)):
                walk(node.operand)
            elif isinstance(node, BinOp):
                walk(node.left)
                walk(node.right)
            elif isinstance(node, ListCall):
                for arg in node.args:
                    walk(arg)
        walk(self.root)
        if self.fallback is not None:
            walk(self.fallback)
        return out

    def evaluate(self, resolve: Callable[[Ref], Any]) -> Any:
        """The value; raises ``ExpressionError`` when arithmetic meets a value that is no
        number, a division by zero or a result that is not finite (``resolve`` raises its
        own errors for missing references)."""
        return _value(self.root, resolve, self.text)

    def evaluate_default(self, resolve: Callable[[Ref], Any]) -> Any:
        """What ``?? ...`` gives when the expression's config field is absent."""
        if self.fallback is not None:
            return _value(self.fallback, resolve, self.text)
        return copy.deepcopy(self.default)


def is_expression(value: Any) -> bool:
    """True for a YAML string that is exactly one ``${...}``."""
    return isinstance(value, str) and _WHOLE.match(value) is not None


def parse_expression(value: str) -> Expression:
    """Parse ``'${config.n_heads * 2}'``; ``ExpressionError`` says what is wrong and where."""
    whole = _WHOLE.match(value)
    if whole is None:
        raise ExpressionError(f"{value!r} is not one '${{...}}' expression")
    body, has_default, default_text = whole.group(1).partition(" ?? ")
    default, fallback = None, None
    if has_default:
        try:
            default = json.loads(default_text)
        except RecursionError:
            raise _too_deep(value, len(body) + 4) from None
        except ValueError:
            fallback = _fallback(default_text, value, len(body) + 4)
    return Expression(value, _parse_body(body, value), default, bool(has_default), fallback)


def _too_deep(value: str, col: int) -> ExpressionError:
    return ExpressionError(f"{_cut(value)} is nested too deep (more than {MAX_DEPTH} levels of parentheses, "
                           "signs, powers, calls or chained operators); split it into config fields", col)


def _cut(text: str, limit: int = 60) -> str:
    return repr(text) if len(text) <= limit else repr(text[:limit - 3] + "...")


def _depth(root: Node) -> int:
    """The depth of an expression tree, counted without recursion."""
    deepest, stack = 0, [(root, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(node, (Neg, Call)):
            stack.append((node.operand, depth + 1))
        elif isinstance(node, BinOp):
            stack += [(node.left, depth + 1), (node.right, depth + 1)]
        elif isinstance(node, ListCall):
            stack += [(arg, depth + 1) for arg in node.args]
    return deepest


def _parse_body(body: str, value: str, start: int = 0) -> Node:
    tokens = _tokenize(body)
    parser = _Parser(tokens, body)
    try:
        root = parser.expr()
    except _TooDeep as deep:
        raise _too_deep(value, start + deep.col) from None
    if parser.pos < len(tokens):
        kind, text, col = tokens[parser.pos]
        raise ExpressionError(f"unexpected {text!r} in {value!r}", start + col)
    if _depth(root) > MAX_DEPTH:
        raise _too_deep(value, start)
    return root


def _fallback(text: str, value: str, col: int) -> Node:
    """The expression after ' ?? ' (what is not JSON must be one)."""
    try:
        return _parse_body(text, value, col)
    except ExpressionError as err:
        raise ExpressionError(f"{value!r}: the default after ' ?? ' must be a JSON value (true, false, a number, "
                              f"\"text\", null) or an expression: {err}", col) from None


def _tokenize(body: str) -> list[tuple[str, str, int]]:
    tokens = []
    pos = 0
    while pos < len(body):
        if body[pos:].strip() == "":
            break
        m = _TOKEN.match(body, pos)
        if m is None or m.end() == pos:
            col = pos + len(body[pos:]) - len(body[pos:].lstrip())
            raise ExpressionError(f"unexpected {body[col]!r} in '${{{body}}}'", col)
        kind = m.lastgroup
        assert kind is not None
        tokens.append((kind, m.group(kind), m.start(kind)))
        pos = m.end()
    return tokens


class _TooDeep(Exception):
    def __init__(self, col: int) -> None:
        self.col = col


class _Parser:
    def __init__(self, tokens: list[tuple[str, str, int]], body: str) -> None:
        self.tokens, self.body, self.pos, self.depth = tokens, body, 0, 0

    def _nested(self, parse: Callable[[], Node], col: int) -> Node:
        """``parse()`` one level deeper; refused past MAX_DEPTH before Python's stack is."""
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _TooDeep(col)
        try:
            return parse()
        finally:
            self.depth -= 1

    def _peek(self) -> tuple[str, str, int] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _binary(self, ops: tuple[str, ...], operand: Callable[[], Node]) -> Node:
        node = operand()
        while (tok := self._peek()) is not None and tok[0] == "op" and tok[1] in ops:
            self.pos += 1
            node = BinOp(tok[1], node, operand())
        return node

    def expr(self) -> Node:
        return self._binary(("+", "-"), self.term)

    def term(self) -> Node:
        return self._binary(("*", "//", "%"), self.unary)

    def unary(self) -> Node:
        tok = self._peek()
        if tok is not None and tok[1] == "-":
            self.pos += 1
            return Neg(self._nested(self.unary, tok[2]))
        return self.power()

    def power(self) -> Node:
        base = self.atom()
        tok = self._peek()
        if tok is not None and tok[1] == "**":
            self.pos += 1
            return BinOp("**", base, self._nested(self.unary, tok[2]))
        return base

    def atom(self) -> Node:
        tok = self._peek()
        if tok is None:
            raise ExpressionError(f"'${{{self.body}}}' ends where a number or a reference is expected",
                                  len(self.body))
        kind, text, col = tok
        self.pos += 1
        if kind == "int":
            if len(text.lstrip("0")) > _MAX_DIGITS:
                raise ExpressionError(f"integer {text[:20]}... in '${{{self.body}}}' has more than 64 bits", col)
            return Num(int(text))
        if kind == "float":
            value = float(text)
            if not math.isfinite(value):
                raise ExpressionError(f"number {text[:20]} in '${{{self.body}}}' is too large for a float", col)
            return Num(value)
        if kind == "ref" and text in LIST_FUNCTIONS and (nxt := self._peek()) is not None and nxt[1] == "(":
            return self._list_call(text, col)
        if kind == "ref":
            return _reference(text, col)
        if kind == "func":
            self.pos += 1  # its '(' (the token pattern looked ahead for it)
            return Call(text, self._closed(col + len(text)))
        if text == "(":
            return self._closed(col)
        raise ExpressionError(f"unexpected {text!r} in '${{{self.body}}}'", col)


    def _list_call(self, name: str, col: int) -> Node:
        self.pos += 1  # the '('
        args = [self._nested(self.expr, col)]
        while (tok := self._peek()) is not None and tok[1] == ",":
            self.pos += 1
            args.append(self._nested(self.expr, col))
        close = self._peek()
        if close is None or close[1] != ")":
            raise ExpressionError(f"{name}( at column {col + 1} of '${{{self.body}}}' is never closed", col)
        self.pos += 1
        if len(args) != LIST_FUNCTIONS[name]:
            raise ExpressionError(f"{name}() takes {LIST_FUNCTIONS[name]} arguments, not {len(args)}, "
                                  f"in '${{{self.body}}}'", col)
        return ListCall(name, tuple(args))

    def _closed(self, col: int) -> Node:
        """The expression after the '(' at ``col``, and its ')'."""
        node = self._nested(self.expr, col)
        close = self._peek()
        if close is None or close[1] != ")":
            raise ExpressionError(f"'(' at column {col + 1} of '${{{self.body}}}' is never closed", col)
        self.pos += 1
        return node


def _reference(text: str, col: int) -> Ref:
    head, _, rest = text.partition(".")
    shape = _SHAPE.match(text)
    if shape is not None:
        return Ref("shape", (shape.group("key"),), int(shape.group("dim")))
    parts = tuple(rest.split(".")) if rest else ()
    if head == "config" and parts and all(parts):
        return Ref("config", parts)
    if head == "vocab" and len(parts) == 2 and parts[1] in ("draft_size", "vocab_size"):
        return Ref("vocab", parts)
    if head == "source" and len(parts) == 2 and parts[1] in ("repo", "revision", "location"):
        return Ref("source", parts)
    if head == "source" and len(parts) >= 2 and parts[1] == "config" and all(parts):
        return Ref("source", parts)  # another source's config file (NAME, "config", *PATH), or all of it
    if text == "output.dtype":
        return Ref("output", ("dtype",))
    raise ExpressionError(f"unknown reference {text!r}; use {REFERENCE_FORMS}", col)


def _value(node: Node, resolve: Callable[[Ref], Any], text: str, *, whole: bool = True) -> Any:
    """A reference standing alone yields its value as it is; arithmetic takes numbers and
    lists of numbers (``_lists``), ``without`` a list and a value."""
    if isinstance(node, Num):
        return node.value
    if isinstance(node, Ref):
        value = resolve(node)
        return value if whole else _operand(value, node.text(), text)
    if isinstance(node, Neg):
        return _lists("-", 0, _value(node.operand, resolve, text, whole=False), text)
    if isinstance(node, ListCall):
        items, drop = (_value(arg, resolve, text, whole=False) for arg in node.args)
        if not isinstance(items, list):
            raise ExpressionError(f"{text}: {node.name}() takes a list first, not {items!r}")
        return [x for x in items if x != drop]
    if isinstance(node, Call):
        operand = _value(node.operand, resolve, text, whole=False)
        if isinstance(operand, list):
            raise ExpressionError(f"{text}: sqrt takes a number, not the list {operand!r}")
        if operand < 0:
            raise ExpressionError(f"{text}: sqrt of {operand!r}, a negative number")
        return _finite(math.sqrt(operand), text)
    left = _value(node.left, resolve, text, whole=False)
    return _lists(node.op, left, _value(node.right, resolve, text, whole=False), text)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _operand(value: Any, name: str, text: str) -> int | float | list[int | float]:
    if isinstance(value, list) and all(map(_is_number, value)):
        return list(value)
    if not _is_number(value):
        kind = "a list of numbers" if isinstance(value, list) else "a number"
        raise ExpressionError(f"{text}: {name} is {value!r}, not {kind}")
    return _bounded(value, f"{name} is", text)


def _bounded(value: int | float, what: str, text: str) -> int | float:
    """Integers stay within 64 bits (as literals and ``**`` do): a longer one is refused
    before it grows further or meets a float (OverflowError)."""
    if isinstance(value, int) and value.bit_length() > _MAX_BITS:
        digits = len(str(abs(value))) if value.bit_length() < 60_000 else f"~{int(value.bit_length() * 0.30103)}"
        raise ExpressionError(f"{_cut(text)}: {what} a {digits}-digit integer: number too large "
                              f"(more than {_MAX_BITS} bits)")
    return value


def _lists(op: str, left: Any, right: Any, text: str) -> Any:
    """``op`` of two numbers, or of each element of a list with a number (``[0, 3] + 1``
    is ``[1, 4]``): the one list transform a rule needs, no comprehension."""
    if isinstance(left, list) and isinstance(right, list):
        raise ExpressionError(f"{text}: {op!r} between two lists; one side must be a number")
    if isinstance(left, list):
        return [_binary(op, x, right, text) for x in left]
    if isinstance(right, list):
        return [_binary(op, left, x, text) for x in right]
    return _binary(op, left, right, text)


def _binary(op: str, left: int | float, right: int | float, text: str) -> int | float:
    if op in ("+", "-", "*"):
        if isinstance(left, int) and isinstance(right, int):
            result = left + right if op == "+" else left - right if op == "-" else left * right
            return _bounded(result, f"{_cut(str(left), 24)[1:-1]} {op} {_cut(str(right), 24)[1:-1]} is", text)
        return _finite(left + right if op == "+" else left - right if op == "-" else left * right, text)
    if op == "**":
        return _power(left, right, text)
    if isinstance(left, float) or isinstance(right, float):
        raise ExpressionError(f"{text}: {op} takes integers, and {left!r} {op} {right!r} has a float")
    if right == 0:
        raise ExpressionError(f"{text}: division by zero")
    return left // right if op == "//" else left % right


def _power(base: int | float, exponent: int | float, text: str) -> int | float:
    if base == 0 and exponent < 0:
        raise ExpressionError(f"{text}: division by zero")
    if isinstance(base, int) and isinstance(exponent, int) and exponent >= 0:
        # an integer power stays exact, within the 64 bits a rule file's integers have
        if abs(base) > 1 and exponent * math.log2(abs(base)) > _MAX_BITS:
            raise ExpressionError(f"{text}: {base} ** {exponent} has more than {_MAX_BITS} bits")
        return int(base ** exponent)
    if base < 0 and not float(exponent).is_integer():
        raise ExpressionError(f"{text}: {base!r} ** {exponent!r} is not a real number")
    try:
        return _finite(float(base) ** float(exponent), text)
    except OverflowError:
        raise ExpressionError(f"{text}: {base!r} ** {exponent!r} is too large for a float") from None


def _finite(value: int | float, text: str) -> int | float:
    if isinstance(value, float) and not math.isfinite(value):
        raise ExpressionError(f"{text}: the result is {value!r}, not a finite number")
    return value
