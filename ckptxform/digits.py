"""Numbers read from outside text (rule keys, folder names, HTTP headers, addresses): ASCII
digits only. ``str.isdigit`` also accepts '²' and '٣', and ``int`` accepts '٣' (and raises on
'²'): neither names an index, a port or a byte count.
"""

from __future__ import annotations


def is_ascii_digits(text: str) -> bool:
    """True for a non-empty run of the digits 0-9 and nothing else."""
    return text.isascii() and text.isdigit()


def ascii_int(text: str | None) -> int | None:
    """The number ``text`` spells in ASCII digits (surrounding blanks allowed), else None."""
    if text is None:
        return None
    text = text.strip()
    return int(text) if is_ascii_digits(text) else None
