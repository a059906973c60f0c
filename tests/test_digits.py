"""Numbers in outside text (ports, folder names, HTTP headers, key indexes) are ASCII digits:
'٣' is a digit to str.isdigit and int('٣') == 3, '²' is a digit to isdigit and int() raises."""

from ckptxform.digits import ascii_int, is_ascii_digits
from ckptxform.rules.templates import is_index


def test_other_scripts_digits_spell_no_number() -> None:
    assert int("٣") == 3 and "²".isdigit()  # what the helpers guard against
    for text in ("٣", "²", "1²", "", " ", "-1", "+1", "1.0", "0x10", "1_000"):
        assert ascii_int(text) is None, text
        assert not is_ascii_digits(text), text
        assert not is_index(text), text


def test_ascii_digits_are_read_with_surrounding_blanks_only() -> None:
    assert ascii_int("4096") == 4096
    assert ascii_int(" 17 ") == 17
    assert ascii_int(None) is None
    assert is_index("007") and not is_index(" 7")
