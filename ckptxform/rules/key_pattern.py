"""A rule file's regular expression, matched against tensor names within a time bound.

Python's ``re`` backtracks: ``(a|aa)+$`` against a long key of a crafted checkpoint runs
for hours, and no key-length limit helps (30 characters are enough). The syntax and
the error messages stay ``re``'s (the pattern is compiled by ``re`` first); matching goes
through the ``regex`` engine, which takes the same syntax and stops a match after
``MATCH_TIMEOUT_S`` seconds: the rule is then refused with one line, as a rule-file
problem (exit 2). ``regex_literal`` reads the one key a pattern without operators matches
(``fc\\.weight``), which the loader, the planner and ``invert`` reason about.

The bound costs ~20 us a match (the engine's timeout bookkeeping: seconds over a
200,000-key checkpoint), so a pattern that cannot backtrack badly is matched by ``re``
directly: one with no repetition inside a repetition, no alternation under a repetition,
no backreference or lookaround, and at most two repetitions in all, is O(n^2) in the key's
length at worst; keys up to ``FAST_KEY_MAX`` characters take that path (a millisecond at
worst), longer ones the bounded one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import regex

from ..errors import RuleError, quote

#: no sane pattern needs more than microseconds on a tensor name
MATCH_TIMEOUT_S = 1.0
#: the longest key a pattern of ``_backtracks_little`` matches without the time bound
FAST_KEY_MAX = 1024
#: repetitions a pattern matched without the bound may hold (n^k steps at worst)
_FAST_REPEATS = 2


@dataclass(frozen=True)
class KeyPattern:
    """What ``re.compile(text)`` gives, for the parts the engine uses (``pattern``,
    ``groups``, ``groupindex``, ``flags``, ``fullmatch``), with ``fullmatch`` bounded.
    ``label`` (``FILE:LINE:COL: tensors[0].match:``) opens the message of a stopped match."""

    pattern: str
    label: str
    _re: re.Pattern[str] = field(repr=False, compare=False)
    _bounded: Any = field(repr=False, compare=False)
    #: matched by ``re`` (no time bound needed) for keys up to FAST_KEY_MAX characters
    _fast: bool = field(default=False, repr=False, compare=False)
    #: ``[key, match]`` of the last ``fullmatch``: the planner asks the same key two or three
    #: times in a row (which rule, its binding, its target), and a time-bounded match costs
    #: ~20 us (the timeout's bookkeeping is most of it), seconds at 200,000 keys
    _last: tuple[Any, Any] = field(default=(None, None), repr=False, compare=False)

    @classmethod
    def compile(cls, text: str, *, label: str) -> KeyPattern:
        """Raises what ``re.compile`` raises for a bad pattern (``re.error``...)."""
        compiled = re.compile(text)
        try:
            bounded = regex.compile(text, flags=regex.VERSION0)
        except regex.error as err:  # the two engines disagree: refuse rather than guess
            raise re.error(f"not supported by the time-bounded matcher ({err})", text) from None
        return cls(text, label, compiled, bounded, _fast=_backtracks_little(text))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_last": (None, None)}  # a match object does not pickle

    @property
    def groups(self) -> int:
        return self._re.groups

    @property
    def groupindex(self) -> Any:
        return self._re.groupindex

    @property
    def flags(self) -> int:
        return self._re.flags

    def prefix_match(self, key: str) -> bool:
        """Whether the pattern matches the start of ``key`` (what ``re.match`` would take,
        and ``fullmatch`` does not): said to a user who wrote ``match: 'model.layers.0'``."""
        try:
            return self._bounded.match(key, timeout=MATCH_TIMEOUT_S) is not None
        except TimeoutError:
            return False  # fullmatch of the same key reports the pattern

    def fullmatch(self, key: str) -> Any:
        """The match of the whole of ``key`` (``expand``, ``group`` as ``re``'s), or None."""
        last = self._last
        if last[0] == key:
            return last[1]
        if self._fast and len(key) <= FAST_KEY_MAX:
            found = self._re.fullmatch(key)
            object.__setattr__(self, "_last", (key, found))
            return found
        try:
            found = self._bounded.fullmatch(key, timeout=MATCH_TIMEOUT_S)
        except TimeoutError:
            shown = key if len(key) <= 60 else key[:57] + "..."
            raise RuleError([
                f"{self.label} {quote(self.pattern)} was stopped after {MATCH_TIMEOUT_S:g} s on the "
                f"{len(key):,}-character key {quote(shown)}: it backtracks catastrophically; rewrite it "
                "without nested or overlapping repetition such as '(a+)+' or '(a|aa)*'"]) from None
        object.__setattr__(self, "_last", (key, found))  # one store: another thread sees a pair
        return found


def _backtracks_little(text: str) -> bool:
    """True when ``re`` matches ``text`` in at most O(n^2) steps of a key of n characters:
    no repetition (of more than one) inside another or over an alternation, no
    backreference or lookaround, at most _FAST_REPEATS repetitions. Conservative: a
    pattern it cannot read is matched with the time bound."""
    from re import _constants as sre, _parser  # type: ignore[attr-defined]

    repeats = 0

    def simple(items: Any, in_repeat: bool) -> bool:
        nonlocal repeats
        for op, arg in items:
            if op in (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT):
                _, most, inner = arg
                if most > 1:
                    if in_repeat:
                        return False
                    repeats += 1
                if not simple(inner, in_repeat or most > 1):
                    return False
            elif op is sre.SUBPATTERN:
                if not simple(arg[-1], in_repeat):
                    return False
            elif op is sre.ATOMIC_GROUP:
                if not simple(arg, in_repeat):
                    return False
            elif op is sre.BRANCH:
                if in_repeat or not all(simple(alt, in_repeat) for alt in arg[1]):
                    return False
            elif op in (sre.GROUPREF, sre.GROUPREF_EXISTS, sre.ASSERT, sre.ASSERT_NOT):
                return False
        return True

    try:
        tree = _parser.parse(text)
    except Exception:  # noqa: BLE001 - any doubt takes the bounded path
        return False
    return simple(tree, False) and repeats <= _FAST_REPEATS


def regex_literal(pattern: str) -> str | None:
    """The one string ``pattern`` matches when it has no regex operators (``fc\\.weight``)."""
    out = []
    chars = iter(pattern)
    for ch in chars:
        if ch == "\\":
            nxt = next(chars, "")
            if not nxt or nxt.isalnum():
                return None
            out.append(nxt)
        elif ch in ".^$*+?{}[]|()":
            return None
        else:
            out.append(ch)
    return "".join(out)
