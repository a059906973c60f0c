"""Input text (tensor keys, paths, messages) as the rule file ``diff --emit-rules`` writes it.

A key is whatever a checkpoint's header holds: a newline followed by an indented line, a
quote, an ANSI escape, a NUL, a Unicode line separator. Written raw, such a key would end a
comment and start a rule of its own, fold a quoted regex so that it no longer matches the
key, or put control bytes into the file. So every piece of input text is written as a
YAML double-quoted string (``yaml_string``) or a one-line comment (``yaml_comment``) made of
printable ASCII only: every other character is an escape YAML reads back as that
character, so the file parses to exactly the strings given.

>>> yaml_string('a.b\\n  - {match: x}')
'"a.b\\\\n  - {match: x}"'
>>> yaml_comment('key\\u2028skip: x')
'key\\\\u2028skip: x'
"""

from __future__ import annotations

#: printable ASCII written as it is (``"`` and ``\\`` are escaped in strings)
_PLAIN = frozenset(chr(c) for c in range(0x20, 0x7F))
#: YAML's short escapes (YAML 1.1 and 1.2, double-quoted scalars)
_SHORT = {"\0": "\\0", "\a": "\\a", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\v": "\\v", "\f": "\\f",
          "\r": "\\r", "\x1b": "\\e", '"': '\\"', "\\": "\\\\"}


def _escape(ch: str) -> str:
    if ch in _SHORT:
        return _SHORT[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def yaml_string(text: str) -> str:
    """``text`` as a one-line YAML double-quoted scalar of printable ASCII that loads back
    as ``text`` exactly (lone surrogates included)."""
    return '"' + "".join(ch if ch in _PLAIN and ch not in '"\\' else _escape(ch) for ch in text) + '"'


def yaml_comment(text: str) -> str:
    """``text`` made fit to follow ``# `` on one line: printable ASCII as it is, everything
    else (a newline, a carriage return, U+0085, U+2028, a terminal escape) escaped, so that
    the comment cannot end early; a backslash is doubled, so that escapes stay unambiguous."""
    return "".join(ch if ch in _PLAIN and ch != "\\" else _escape(ch) for ch in text)
