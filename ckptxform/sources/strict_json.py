"""JSON read strictly, for the small JSON files a checkpoint is described by (safetensors
headers, shard indexes, config.json): UTF-8, one object, no key twice, no NaN, Infinity or
number beyond a float, no lone surrogate escape; and JSON values shown in messages (one
line, quoted, cut to a readable length). Every problem is one ``CheckpointFormatError``.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from ckptxform.errors import CheckpointFormatError

#: JSON integers longer than this are refused (2**128 has 39 digits)
MAX_INT_DIGITS = 40


def parse_json_object(blob: bytes | str, label: str, *, what: str, fix: str) -> dict[str, Any]:
    """``blob`` as one JSON object, read strictly (``parse_json``): every problem is a
    CheckpointFormatError naming ``label`` and ending in ``fix``."""
    value = parse_json(blob, label, what=what, fix=fix)
    if not isinstance(value, dict):
        raise CheckpointFormatError(
            f"{label}: {what} must be a JSON object, got {json_type(value)}; {fix}",
            path=label,
        )
    for key in value:
        check_unicode(key, label, f"{what} key")
    return value


def utf8_text(blob: bytes, label: str, *, what: str, fix: str) -> str:
    """``blob`` decoded as UTF-8, or a CheckpointFormatError naming the first bad byte."""
    try:
        return blob.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointFormatError(
            f"{label}: {what} is not UTF-8 (byte {exc.start}: {exc.reason}); {fix}",
            path=label,
        ) from None


def parse_json(blob: bytes | str, label: str, *, what: str, fix: str) -> Any:
    """``blob`` (bytes, or the text ``utf8_text`` made of them) as one JSON value, read
    strictly: UTF-8, no key twice in any object (json
    keeps the last silently), no NaN/Infinity nor a number beyond a float (not JSON, or read
    as infinity; written back they make invalid JSON), no integer of more than MAX_INT_DIGITS digits, nesting
    no deeper than the parser's stack. Every problem is a CheckpointFormatError naming
    ``label`` and ending in ``fix``."""
    text = blob if isinstance(blob, str) else utf8_text(blob, label, what=what, fix=fix)

    def unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        # json's default keeps the last of two equal keys; a reader that kept the
        # first would see a different tensor, so a repeated name is refused outright.
        obj: dict[str, Any] = {}
        for key, value in pairs:
            if key in obj:
                raise CheckpointFormatError(
                    f"{label}: {what} has key {quote_short(key)} twice in one JSON object; "
                    "each name must appear once (the file is corrupt or crafted)",
                    path=label,
                    key=key,
                )
            obj[key] = value
        return obj

    def finite_float(number: str) -> float:
        # 1e400 is JSON, but a float cannot hold it: json reads it as inf, written back as Infinity
        value = float(number)
        if not math.isfinite(value):
            raise CheckpointFormatError(
                f"{label}: {what} holds the number {_cut(number)}, beyond a 64-bit float (written back it "
                f"would be Infinity, which is not JSON); {fix}",
                path=label,
            )
        return value

    def bounded_int(number: str) -> int:
        # no reader of these files reads an integer of this size, and Python's int() of a long
        # one costs quadratic time (past 4,300 digits it refuses it); beyond 64 bits, each
        # reader says what its field allows
        digits = len(number.lstrip("-"))
        if digits > MAX_INT_DIGITS:
            raise CheckpointFormatError(
                f"{label}: {what} holds the {digits}-digit integer {_cut(number, 24)}: number too large "
                f"(more than {MAX_INT_DIGITS} digits); {fix}",
                path=label,
            )
        return int(number)

    keys = 0

    def counted(obj: dict[str, Any]) -> dict[str, Any]:
        nonlocal keys
        keys += len(obj)
        return obj

    # Read first as json reads by default, each object straight into a dict (which keeps the
    # last of a key given twice), counting the keys kept; the same count in the text means
    # no key was given twice. Only otherwise, or on any error, is it read again a pair at a
    # time, for the exact error: the pairs (a tuple each, in a list an object) were ~70
    # bytes a key of a shard index, the peak of planning a million tensors.
    numbers: dict[str, Any] = {"parse_constant": _refuse_constant, "parse_float": finite_float,
                               "parse_int": bounded_int}
    try:
        value = json.loads(text, object_hook=counted, **numbers)
        if keys == _key_count(text):
            return value
    except (CheckpointFormatError, ValueError, RecursionError):
        pass
    try:
        return json.loads(text, object_pairs_hook=unique_pairs, **numbers)
    except CheckpointFormatError:
        raise
    except json.JSONDecodeError as exc:
        raise CheckpointFormatError(
            f"{label}: {what} is not valid JSON ({exc.msg} at line {exc.lineno} column "
            f"{exc.colno}); {fix}",
            path=label,
        ) from None
    except (ValueError, RecursionError) as exc:
        # ValueError: NaN/Infinity; RecursionError: nesting deeper than the parser's stack.
        reason = "nested too deeply" if isinstance(exc, RecursionError) else _cut(str(exc))
        raise CheckpointFormatError(
            f"{label}: {what} is not valid JSON ({reason}); {fix}",
            path=label,
        ) from None


#: a JSON string and, when one follows it, the colon that makes it a key
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"([ \t\n\r]*:)?')


def _key_count(text: str) -> int:
    """How many keys the objects of ``text``, valid JSON, hold between them: outside its
    strings JSON has no quote, so each string is found whole, in order, and a string a colon
    follows is a key (~0.6 s for the 82 MB index of a million tensors)."""
    return sum(1 for string in _STRING.finditer(text) if string.group(1) is not None)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def check_unicode(text: str, label: str, what: str) -> None:
    # JSON escapes can encode lone surrogates ("\ud800") that no UTF-8 writer can
    # write back; the safetensors crate refuses them too.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise CheckpointFormatError(
            f"{label}: {what} {quote_short(text)} is not valid Unicode (a lone surrogate escape); "
            "the file is corrupt or crafted",
            path=label,
        ) from None


def json_type(value: Any) -> str:
    names = {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)


def show_value(value: Any) -> str:
    """A JSON value for a message: one line, cut to a readable length."""
    if isinstance(value, str):
        return quote_short(value)
    try:
        text = json.dumps(value)
    except (ValueError, RecursionError):
        text = json_type(value)
    return _cut(text)


def quote_short(text: str) -> str:
    return _cut(repr(text))


def _cut(text: str, limit: int = 80) -> str:
    text = re.sub(r"\s+", " ", text)
    return text if len(text) <= limit else text[: limit - 3] + "..."
