"""Fuzzing the rule loader: whatever the bytes of a rule file, ``load_rules`` returns a RuleSet
or raises ``RuleError`` whose every problem names the file; never another exception.

Three generators: YAML-looking text, JSON-compatible structures built from the rule
language's own words (so they get past the YAML stage into the schema and the semantic
checks), and small mutations of the shipped headline rule (so they reach every check).
"""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ckptxform import RuleSet, load_rules
from ckptxform.errors import RuleError

REPO = Path(__file__).parent.parent
HEADLINE_LINES = (REPO / "rules" / "aqmedai_k2_to_k25.yaml").read_text("utf-8").splitlines(keepends=True)

# 1,500 examples in all, fewer where one costs more (a mutated headline is a full parse).
EXAMPLES = {"text": 450, "bytes": 450, "structures": 350, "mutations": 250}


def fuzz(kind: str) -> settings:
    return settings(max_examples=EXAMPLES[kind], deadline=None, suppress_health_check=[HealthCheck.too_slow])


_WORDS = [
    "version", "name", "description", "extends", "sources", "convert", "vocab", "tensors", "add",
    "require", "config", "output", "repo", "revision", "path", "fetch", "source", "d2t", "t2d",
    "file", "encoding", "offset", "absolute", "vocab_size", "identity_rows_of", "match", "rename",
    "skip", "permute_rows", "from", "to", "missing_rows", "rows_of", "tensor", "init", "zeros",
    "mean", "normal", "std", "seed", "cast", "float32", "bfloat16", "optional", "field", "loaded",
    "min_rows_from_source", "strict", "keep", "delete", "set", "max_shard_size", "dtype",
    "file_name", "drafter", "verifier", "k2", "k25", "org/repo", "5GB", "1", "\\1", "\\g<x>",
    "(.+)", "a(", "fc\\.weight", "${vocab.k2.draft_size}", "${config.x}", "${nope}", "base.yaml",
]
_YAML_CHARS = "abc01 :-[]{}&*!|>'\"#%@`,?\n\t\\.$()<"
# Pieces of YAML that take PyYAML and the loader down their rarer paths.
_YAML_TOKENS = [
    "version: 1\n", "tensors:\n", "  - match: ", "    rename: ", "sources:\n", "  d: {repo: a/b}\n",
    "\n", "\n  ", "- ", ": ", "? ", "{", "}", "[", "]", ", ", "'", '"', "#", "---\n", "...\n",
    "&a ", "*a", "<<: ", "!!int ", "!!float ", "!!bool ", "!!str ", "!!null ", "!!binary ", "!!set ",
    "!!python/object/apply:os.system ", "!local ", "%YAML 1.1\n", "%TAG ! tag:x,2000:\n",
    "0b_", "0x_", "0o7", "1_000", "1:20", ".nan", ".inf", "-.inf", "1e400", "2001-12-14", "~", "yes",
    "\\1", "\\g<x>", "(", "(?P<x>", "[a-", "${vocab.k2.draft_size}", "|\n", ">-\n", "\t", "\x00", "\ufeff",
]
_serial = itertools.count()


@pytest.fixture(scope="module")
def folder() -> Iterator[Path]:
    # Module-scoped: hypothesis does not mix with the function-scoped tmp_path.
    with tempfile.TemporaryDirectory() as name:
        yield Path(name)


def _check(folder: Path, content: str | bytes) -> RuleSet | None:
    """Load ``content`` as a rule file; only a RuleError naming the file in every problem may escape."""
    # A fresh file per example: rewriting one file in place makes ext4 flush it on close,
    # which costs milliseconds per example on a busy disk.
    path = folder / f"fuzz{next(_serial)}.yaml"
    if isinstance(content, str):
        content = content.encode("utf-8", errors="surrogatepass")
    path.write_bytes(content)
    try:
        rules = load_rules(path)
        event("loaded")
        return rules
    except RuleError as err:
        event("RuleError")
        assert err.problems, "a RuleError without problems"
        for problem in err.problems:
            assert problem.startswith(f"{path}:"), problem
            assert "\n" not in problem, problem
        return None
    finally:
        path.unlink()


_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(_WORDS), st.text(max_size=12),
)
_structures = st.recursive(
    _scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(_WORDS), st.text(max_size=6)), children, max_size=5),
    ),
    max_leaves=12,
)
_rule_like = st.fixed_dictionaries(
    {"version": st.sampled_from([1, 1, 1, 2, "1"])},
    optional={word: _structures for word in
              ("name", "sources", "convert", "vocab", "tensors", "add", "require", "config", "output")},
)


@fuzz("text")
@given(text=st.one_of(
    st.text(alphabet=st.sampled_from(list(_YAML_CHARS)) | st.characters(), max_size=300),
    st.lists(st.sampled_from(_YAML_TOKENS) | st.sampled_from(_WORDS), max_size=40).map("".join),
))
def test_yaml_ish_text(folder: Path, text: str) -> None:
    _check(folder, text)


@fuzz("bytes")
@given(raw=st.binary(max_size=200))
def test_arbitrary_bytes(folder: Path, raw: bytes) -> None:
    _check(folder, raw)


@fuzz("structures")
@given(data=st.one_of(_rule_like, _structures), flow=st.booleans())
def test_json_compatible_structures(folder: Path, data: Any, flow: bool) -> None:
    _check(folder, yaml.safe_dump(data, default_flow_style=flow, allow_unicode=True))


_mutation = st.one_of(
    st.tuples(st.just("delete"), st.integers(0, 10_000)),
    st.tuples(st.just("duplicate"), st.integers(0, 10_000)),
    st.tuples(st.just("swap"), st.integers(0, 10_000)),
    st.tuples(st.just("char"), st.integers(0, 10_000), st.sampled_from(list(_YAML_CHARS))),
    st.tuples(st.just("word"), st.integers(0, 10_000), st.sampled_from(_WORDS)),
)


def _mutate(lines: list[str], mutation: tuple[Any, ...]) -> list[str]:
    kind, where = mutation[0], mutation[1] % len(lines)
    if kind == "delete":
        return lines[:where] + lines[where + 1:]
    if kind == "duplicate":
        return lines[:where + 1] + lines[where:]
    if kind == "swap":
        other = (where + 1) % len(lines)
        lines = list(lines)
        lines[where], lines[other] = lines[other], lines[where]
        return lines
    line = lines[where]
    col = mutation[1] // len(lines) % max(len(line), 1)
    new = mutation[2]
    replaced = line[:col] + new + line[col + 1:] if kind == "char" else line[:col] + new + line[col:]
    return lines[:where] + [replaced] + lines[where + 1:]


@fuzz("mutations")
@given(mutations=st.lists(_mutation, min_size=1, max_size=4))
def test_mutations_of_the_headline_rule(folder: Path, mutations: list[tuple[Any, ...]]) -> None:
    lines = list(HEADLINE_LINES)
    for mutation in mutations:
        lines = _mutate(lines, mutation) or ["\n"]
    _check(folder, "".join(lines))
