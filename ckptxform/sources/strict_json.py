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


def parse_json_object(blob: bytes, label: str, *, what: str, fix: str) -> dict[str, Any]:
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


def parse_json(blob: bytes, label: str, *, what: str, fix: str) -> Any:
    """``blob`` as one JSON value, read strictly: UTF-8, no key twice in any object (json
    keeps the last silently), no NaN/Infinity nor a number beyond a float (not JSON, or read
    as infinity; written back they make invalid JSON), no integer of more than MAX_INT_DIGITS digits, nesting
    no deeper than the parser's stack. Every problem is a CheckpointFormatError naming
    ``label`` and ending in ``fix``."""
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointFormatError(
            f"{label}: {what} is not UTF-8 (byte {exc.start}: {exc.reason}); {fix}",
            path=label,
        ) from None

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

    try:
        return json.loads(text, object_pairs_hook=unique_pairs, parse_constant=_refuse_constant,
                          parse_float=finite_float, parse_int=bounded_int)
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
