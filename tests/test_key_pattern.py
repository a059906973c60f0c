"""Rule regexes: matched by ``re`` where the pattern cannot backtrack badly (the time
bound costs more than the match), with the time bound everywhere else; the same answers
either way."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptxform.errors import RuleError
from ckptxform.rules.key_pattern import FAST_KEY_MAX, KeyPattern

PIECES = [r"\.", r"\d+", r"(\d+)", r"layers", r"(q|k|v)", r"(?:a|b)", r".*", r"(.*)", r"[a-z]+", r"w\d",
          r"(ab){1,3}", r"x?", r"_proj", r"(a+)+", r"(?=w)", r"\w*"]


@pytest.mark.parametrize(("pattern", "fast"), [
    (r"model\.layers\.(\d+)\.experts\.(\d+)\.(w\d)\.weight", True),
    (r"(?:layers|blocks)\.(\d+)\.(.*)", True),
    (r"(a+)+$", False),      # a repetition inside a repetition
    (r"(a|aa)*", False),     # an alternation under a repetition
    (r".*.*.*", False),      # three repetitions: n^3 steps
    (r"(a)\1", False),       # a backreference
    (r"x(?=y)", False),      # a lookahead
])
def test_which_patterns_skip_the_time_bound(pattern: str, fast: bool) -> None:
    assert KeyPattern.compile(pattern, label="t")._fast is fast


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), min_size=1, max_size=5),
       st.lists(st.text(alphabet="ab.xwqk_0123456789layers", max_size=40), min_size=1, max_size=8))
def test_both_paths_give_re_s_answer(pieces: list[str], keys: list[str]) -> None:
    text = "".join(pieces)
    try:
        reference = re.compile(text)
    except re.error:
        return
    pattern = KeyPattern.compile(text, label="t")
    for key in keys + keys[::-1]:  # again, in another order: the last match kept must not leak
        got, want = pattern.fullmatch(key), reference.fullmatch(key)
        assert (got is None) == (want is None), (text, key)
        if want is not None:
            assert got.span() == want.span() and got.groups() == want.groups()


def test_a_long_key_is_matched_with_the_time_bound() -> None:
    # fast for short keys (two repetitions), but n^2 steps on a long hostile key: bounded
    pattern = KeyPattern.compile(r"(.*)a(.*)b", label="tensors[0].match:")
    assert pattern._fast
    assert pattern.fullmatch("xaxb") is not None
    with pytest.raises(RuleError, match="was stopped after"):
        pattern.fullmatch("a" * 200_000 + "c")
    assert FAST_KEY_MAX < 200_000
