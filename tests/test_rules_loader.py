"""Golden tests for the rule loader: each error kind, a YAML snippet in, the exact message out;
then ``extends`` and the RuleSet built from the shipped headline rule.

Snippets are written to ``rules.yaml`` in a fresh working directory, so messages start
with ``rules.yaml:LINE:COL``. Most snippets are ``BASE`` (lines 1-9: three sources, the
converted one, two vocabulary maps) followed by the lines under test, from line 10.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import time
from pathlib import Path

import pytest

from ckptxform import RuleSet, load_rules
from ckptxform.errors import CkptxformError, RuleError, UsageError
from ckptxform.rules.loader import parse_size
from ckptxform.rules.yaml_source import MAX_FILE_BYTES

REPO = Path(__file__).parent.parent
HEADLINE = REPO / "rules" / "aqmedai_k2_to_k25.yaml"

BASE = """\
version: 1
sources:
  drafter: {repo: org/drafter}
  target_vocab: {repo: org/target}
  verifier: {repo: org/verifier}
convert: drafter
vocab:
  k2: {source: drafter, encoding: offset}
  k25: {source: target_vocab, encoding: offset}
"""

TOP_KEYS = ("$schema, add, config, convert, description, extends, files, inverse, name, output, require, sources, "
            "tensors, version, vocab")


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


def problems_of(text: str | bytes, name: str = "rules.yaml") -> list[str]:
    """Write ``text`` to ``name``, load it, and return the problems of the RuleError."""
    if isinstance(text, bytes):
        Path(name).write_bytes(text)
    else:
        Path(name).write_text(text, "utf-8")
    with pytest.raises(RuleError) as info:
        load_rules(name)
    assert str(info.value) == "\n".join(info.value.problems)
    return info.value.problems


GOLDEN = [
    # --- unknown keys ------------------------------------------------------------------
    pytest.param(
        BASE + "tensorz: []\n",
        ["rules.yaml:10:1: tensorz: unknown key 'tensorz'; did you mean 'tensors'?"],
        id="unknown-top-level-key-did-you-mean",
    ),
    pytest.param(
        BASE + "frobnicate: 1\n",
        [f"rules.yaml:10:1: frobnicate: unknown key 'frobnicate' (allowed: {TOP_KEYS})"],
        id="unknown-top-level-key-no-close-match",
    ),
    pytest.param(
        BASE + "tensors:\n  - match: 'a'\n  - match: 'b\\.(.+)'\n    renam: 'c.\\1'\n",
        ["rules.yaml:13:5: tensors[1].renam: unknown key 'renam'; did you mean 'rename'?"],
        id="unknown-key-in-tensor-rule",
    ),
    pytest.param(
        BASE + "tensors:\n  - match: 'lm_head\\.weight'\n    permute_rows: {from: k2, to: k25, fallback: zeros}\n",
        [("rules.yaml:12:39: tensors[0].permute_rows.fallback: unknown key 'fallback' "
         "(allowed: from, to)")],
        id="unknown-key-two-levels-deep",
    ),
    pytest.param(
        BASE.replace("  k2: {source: drafter, encoding: offset}", "  k2: {srouce: drafter, encoding: offset}"),
        ["rules.yaml:8:8: vocab.k2.srouce: unknown key 'srouce'; did you mean 'source'?"],
        id="unknown-key-reported-once-not-also-as-one-of-failure",
    ),
    # --- wrong types, enums, required ----------------------------------------------------
    pytest.param(
        BASE + "tensors:\n  - match: 'lm_head\\.weight'\n    permute_rows: {from: k2, to: [k25]}\n",
        ["rules.yaml:12:34: tensors[0].permute_rows.to: expected a string, got a list [\"k25\"]"],
        id="wrong-type-deep-in-tensor-rule",
    ),
    pytest.param(
        BASE + "tensors:\n  - match: 'embed\\.weight'\n    optional: 'yes'\n",
        ["rules.yaml:12:15: tensors[0].optional: expected a boolean, got a string 'yes'"],
        id="wrong-type-quoted-boolean",
    ),
    pytest.param(
        BASE + "tensors: {match: a}\n",
        ["rules.yaml:10:10: tensors: expected a list, got a mapping {\"match\": \"a\"}"],
        id="wrong-type-tensors-mapping",
    ),
    pytest.param(
        BASE + "tensors:\n  - match: 'fc\\.weight'\n    cast: bf16\n",
        ["rules.yaml:12:11: tensors[0].cast: 'bf16' is not one of 'bfloat16', 'float16', 'float32', 'float64'"],
        id="enum-value",
    ),
    pytest.param(
        BASE.replace("encoding: offset}\n  k25", "encoding: offst}\n  k25"),
        ["rules.yaml:8:35: vocab.k2.encoding: 'offst' is not one of 'offset', 'absolute'"],
        id="enum-value-vocab-encoding",
    ),
    pytest.param(
        BASE + "output: {max_shard_size: 5 gigs}\n",
        [("rules.yaml:10:26: output.max_shard_size: '5 gigs' is not of the form "
         "^[0-9]+(\\.[0-9]+)?\\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)$")],
        id="pattern-shard-size",
    ),
    pytest.param(
        "version: 2\n",
        ["rules.yaml:1:10: version: expected 1, got 2"],
        id="const-version",
    ),
    pytest.param(
        BASE + "tensors:\n  - rename: 'x'\n",
        ["rules.yaml:11:5: tensors[0]: missing required key 'match'"],
        id="missing-required-key",
    ),
    pytest.param(
        "name: no-version\n",
        ["rules.yaml:1:1: (top level): missing required key 'version'"],
        id="missing-version",
    ),
    # --- one-of failures ------------------------------------------------------------------
    pytest.param(
        "version: 1\nsources:\n  drafter: {repo: org/drafter, path: ./drafter}\n",
        ["rules.yaml:3:12: sources.drafter: give exactly one of the forms {repo} or {path} or {example}, not several"],
        id="one-of-source-with-repo-and-path",
    ),
    pytest.param(
        BASE + "tensors:\n  - match: 'lm_head\\.weight'\n    permute_rows: {from: k2, to: k25}\n"
        "    missing_rows: zeros\n",
        [("rules.yaml:13:19: tensors[0].missing_rows: expected a mapping with keys {rows_of, tensor} "
         "or {init}, got a string 'zeros'")],
        id="one-of-missing-rows-as-string",
    ),
    pytest.param(
        BASE + "tensors:\n  - match: 'lm_head\\.weight'\n    permute_rows: {from: k2, to: k25}\n"
        "    missing_rows: {rows_of: verifier}\n",
        ["rules.yaml:13:19: tensors[0].missing_rows: missing required key 'tensor'"],
        id="one-of-best-match-names-the-missing-key",
    ),
    pytest.param(
        BASE + "add:\n  d2t: {encoding: offset, tensor: d2t}\n",
        [("rules.yaml:11:8: add.d2t: expected one of the forms {vocab, field} or {source, tensor} or {fill, shape}, "
         "got {\"encoding\": \"offset\", \"tensor\": \"d2t\"}")],
        id="one-of-add-entry-with-neither-form",
    ),
    pytest.param(
        BASE + "add:\n  d2t: {}\n",
        ["rules.yaml:11:8: add.d2t: expected one of the forms {vocab, field} or {source, tensor} or {fill, shape}, got {}"],
        id="one-of-add-entry-empty",
    ),
    # --- dependent keys --------------------------------------------------------------------
    pytest.param(
        BASE + "tensors:\n  - match: 'd2t'\n    skip: replaced\n    rename: 'x'\n    cast: float32\n",
        ["rules.yaml:13:5: tensors[0].rename: 'rename' cannot be combined with 'skip'",
         "rules.yaml:14:5: tensors[0].cast: 'cast' cannot be combined with 'skip'"],
        id="skip-combined-with-rename-and-cast",
    ),
    pytest.param(
        BASE + "tensors:\n  - match: 'lm_head\\.weight'\n    missing_rows: {init: zeros}\n",
        ["rules.yaml:12:5: tensors[0].missing_rows: 'missing_rows' needs 'permute_rows'"],
        id="missing-rows-without-permute-rows",
    ),
    # --- regular expressions and rename templates ----------------------------------------
    pytest.param(
        BASE + "tensors:\n  - match: 'midlayer\\.(.+'\n",
        [("rules.yaml:11:12: tensors[0].match: invalid regular expression 'midlayer\\\\.(.+': "
         "missing ), unterminated subpattern at position 10")],
        id="invalid-regex-in-match",
    ),
    pytest.param(
        BASE + "require:\n  loaded:\n    - 'fc\\.weight'\n    - 'layers\\.0\\.[a-z'\n",
        [("rules.yaml:13:7: require.loaded[1]: invalid regular expression 'layers\\\\.0\\\\.[a-z': "
         "unterminated character set at position 11")],
        id="invalid-regex-in-require-loaded",
    ),
    pytest.param(
        BASE + "tensors:\n  - match: 'a{99999999999}'\n",
        [("rules.yaml:11:12: tensors[0].match: invalid regular expression 'a{99999999999}': "
         "the repetition number is too large")],
        id="regex-repetition-too-large",
    ),
    pytest.param(
        BASE + "tensors:\n  - match: 'midlayer\\.(.+)'\n    rename: 'layers.0.\\2'\n",
        ["rules.yaml:12:13: tensors[0].rename: \\2 refers to group 2 but 'match' has 1 group"],
        id="rename-numbered-group-missing",
    ),
    pytest.param(
        BASE + "tensors:\n  - match: 'midlayer\\.(?P<rest>.+)'\n    rename: 'layers.0.\\g<tail>'\n",
        ["rules.yaml:12:13: tensors[0].rename: \\g<tail> names no group of 'match'"],
        id="rename-named-group-missing",
    ),
    pytest.param(
        BASE + "tensors:\n  - match: 'midlayer\\.(.+)'\n    rename: 'layers.0.\\1\\q'\n",
        [("rules.yaml:12:13: tensors[0].rename: invalid rename template 'layers.0.\\\\1\\\\q': "
         "bad escape \\q at position 11")],
        id="rename-bad-escape",
    ),
    pytest.param(
        BASE + "tensors:\n  - match: 'midlayer\\.(.+)'\n    rename: 'layers\\.0\\.\\1'\n",
        [("rules.yaml:12:13: tensors[0].rename: rename template 'layers\\\\.0\\\\.\\\\1' puts a backslash "
         "into the output key; a rename is not a regular expression: write '.' rather than '\\.'")],
        id="rename-regex-escape-copied-into-template",
    ),
    pytest.param(
        BASE + "tensors:\n  - match: 'a'\n    rename: 'b\\\\1'\n",
        [("rules.yaml:12:13: tensors[0].rename: rename template 'b\\\\\\\\1' puts a backslash "
         "into the output key; a rename is not a regular expression: write '.' rather than '\\.'")],
        id="rename-escaped-backslash-is-not-a-group",
    ),
    # --- references ------------------------------------------------------------------------
    pytest.param(
        BASE.replace("{source: target_vocab,", "{source: target_vocb,"),
        [("rules.yaml:9:17: vocab.k25.source: unknown source 'target_vocb' "
         "(defined: drafter, target_vocab, verifier); did you mean 'target_vocab'?")],
        id="undefined-source-did-you-mean",
    ),
    pytest.param(
        BASE.replace("convert: drafter", "convert: drafer"),
        [("rules.yaml:6:10: convert: unknown source 'drafer' (defined: drafter, target_vocab, verifier); "
         "did you mean 'drafter'?")],
        id="undefined-convert-source",
    ),
    pytest.param(
        BASE + "tensors:\n  - match: 'lm_head\\.weight'\n    permute_rows: {from: k2, to: k255}\n"
        "    missing_rows: {rows_of: verifer, tensor: lm_head.weight}\n",
        [("rules.yaml:12:34: tensors[0].permute_rows.to: unknown vocabulary 'k255' (defined: k2, k25); "
         "did you mean 'k25'?"),
         ("rules.yaml:13:29: tensors[0].missing_rows.rows_of: unknown source 'verifer' "
         "(defined: drafter, target_vocab, verifier); did you mean 'verifier'?")],
        id="undefined-vocab-and-fallback-source",
    ),
    pytest.param(
        BASE + "add:\n  d2t: {vocab: qwen, field: d2t}\n",
        ["rules.yaml:11:16: add.d2t.vocab: unknown vocabulary 'qwen' (defined: k2, k25)"],
        id="undefined-vocab-no-close-match",
    ),
    pytest.param(
        BASE + "config:\n  from: drafter\n  set:\n    outer:\n      inner: [1, '${vocab.k3.draft_size}']\n"
        "      other: ${source.verifier.repo}\n      bad: ${hidden_size}\n",
        ["rules.yaml:14:18: config.set.outer.inner[1]: unknown vocabulary 'k3' (defined: k2, k25)",
         ("rules.yaml:16:12: config.set.outer.bad: unknown reference 'hidden_size'; use ${config.PATH}, "
         "${shape.KEY[I]}, ${vocab.NAME.draft_size}, ${vocab.NAME.vocab_size}, ${source.NAME.repo}, "
         "${source.NAME.config.PATH} or ${output.dtype}")],
        id="config-set-reference-nested",
    ),
    # --- output key collisions -------------------------------------------------------------
    pytest.param(
        BASE + "tensors:\n  - match: 'fc\\.weight'\n  - match: 'proj\\.weight'\n    rename: fc.weight\n",
        [("rules.yaml:12:12: tensors[1].match: produces output key 'fc.weight', already produced by "
         "tensors[0] (rules.yaml:11); two tensors cannot be written to one key")],
        id="two-rules-same-literal-output",
    ),
    pytest.param(
        BASE + "tensors:\n  - match: 'vocab_map'\n    rename: d2t\nadd:\n  d2t: {vocab: k25, field: d2t}\n",
        [("rules.yaml:14:3: add.d2t: output key 'd2t' is also produced by tensors[0] (rules.yaml:11); "
         "remove one of them")],
        id="add-collides-with-literal-rename",
    ),
    # --- YAML level --------------------------------------------------------------------------
    pytest.param(
        "version: 1\nname: first\ndescription: x\nname: second\n",
        ["rules.yaml:4:1: duplicate key 'name' (first at line 2)"],
        id="duplicate-yaml-key",
    ),
    pytest.param(
        "version: 1\nsources:\n  d: {repo: org/a}\n  d: {repo: org/b}\n",
        ["rules.yaml:4:3: duplicate key 'd' (first at line 3)"],
        id="duplicate-yaml-key-nested",
    ),
    pytest.param(
        "version: 1\ntensors:\n  - match: 'a\n",
        ["rules.yaml:4:1: invalid YAML: while scanning a quoted scalar at line 3: found unexpected end of stream"],
        id="yaml-syntax-error",
    ),
    pytest.param(
        "version: 1\nname: &n a\ndescription: &n b\n",
        [("rules.yaml:3:14: invalid YAML: found duplicate anchor 'n'; first occurrence at line 2: "
         "second occurrence")],
        id="yaml-duplicate-anchor",
    ),
    pytest.param(
        "version: 1\nname: *nowhere\n",
        ["rules.yaml:2:7: invalid YAML: found undefined alias 'nowhere'"],
        id="yaml-undefined-alias",
    ),
    pytest.param(
        "version: 1\n<<: {name: x}\n",
        ["rules.yaml:2:1: YAML merge keys ('<<') are not supported; use 'extends'"],
        id="yaml-merge-key",
    ),
    pytest.param(
        "version: 1\n1: x\n",
        ["rules.yaml:2:1: mapping keys must be strings, got 'tag:yaml.org,2002:int'"],
        id="yaml-non-string-key",
    ),
    pytest.param(
        "version: 1\nname: 2024-01-01\n",
        [("rules.yaml:2:7: YAML tag 'tag:yaml.org,2002:timestamp' is not allowed in a rule file; "
         "use plain strings, numbers, booleans, lists and mappings")],
        id="yaml-timestamp",
    ),
    pytest.param(
        "version: 1\nname: !!int twelve\noutput: {max_shard_size: 0b_}\ndescription: !!float\n",
        ["rules.yaml:2:7: 'twelve' is not a valid int; quote it to make it a string",
         "rules.yaml:3:26: '0b_' is not a valid int; quote it to make it a string",
         "rules.yaml:4:14: '' is not a valid float; quote it to make it a string"],
        id="yaml-scalar-not-of-its-type",
    ),
    pytest.param(
        "version: 1\nrequire:\n  min_rows_from_source: {lm_head.weight: .nan}\n",
        ["rules.yaml:3:42: '.nan' is not a finite number"],
        id="yaml-nan",
    ),
    pytest.param(
        "version: 1\nname: " + "[" * 100 + "]" * 100 + "\n",
        ["rules.yaml:2:70: invalid YAML: nested more than 64 levels deep"],
        id="yaml-nested-too-deep",
    ),
    pytest.param(
        "version: 1\nname: &loop [*loop]\n",
        [("rules.yaml:2:7: nested more than 64 levels deep (through aliases?); "
         "write the rules out without nested aliases")],
        id="yaml-self-referencing-alias",
    ),
    pytest.param(
        "",
        ["rules.yaml:1:1: the file is empty; a rule file starts with 'version: 1'"],
        id="empty-file",
    ),
    pytest.param(
        "# only a comment\n\n",
        ["rules.yaml:1:1: the file is empty; a rule file starts with 'version: 1'"],
        id="comments-only",
    ),
    pytest.param(
        "- version: 1\n",
        ["rules.yaml:1:1: (top level): expected a mapping, got a list [{\"version\": 1}]"],
        id="top-level-list",
    ),
    pytest.param(
        b"version: 1\nname: caf\xe9\n",
        ["rules.yaml:2:10: not UTF-8 (byte 0xe9); save the file as UTF-8"],
        id="not-utf8",
    ),
    # --- many problems at once, in line order ----------------------------------------------
    pytest.param(
        "version: 1\n"                                       # 1
        "sources:\n"                                         # 2
        "  drafter: {repo: org/drafter}\n"                   # 3
        "tensors:\n"                                         # 4
        "  - match: 'a('\n"                                  # 5
        "  - match: 'b'\n"                                   # 6
        "    cast: bf16\n"                                   # 7
        "frobnicate: 1\n"                                    # 8
        "add:\n"                                             # 9
        "  d2t: {vocab: k3, field: d2t}\n"                   # 10
        "config: {from: verifier}\n",                        # 11
        [("rules.yaml:5:12: tensors[0].match: invalid regular expression 'a(': "
         "missing ), unterminated subpattern at position 1"),
         "rules.yaml:7:11: tensors[1].cast: 'bf16' is not one of 'bfloat16', 'float16', 'float32', 'float64'",
         f"rules.yaml:8:1: frobnicate: unknown key 'frobnicate' (allowed: {TOP_KEYS})",
         "rules.yaml:10:16: add.d2t.vocab: unknown vocabulary 'k3' (defined: none)",
         "rules.yaml:11:16: config.from: unknown source 'verifier' (defined: drafter)"],
        id="several-problems-in-line-order",
    ),
]


@pytest.mark.parametrize(("text", "expected"), GOLDEN)
def test_golden_message(text: str | bytes, expected: list[str]) -> None:
    assert problems_of(text) == expected


def test_rule_error_is_a_value_error_with_exit_code_2() -> None:
    problems_of(BASE + "frobnicate: 1\n")
    with pytest.raises(RuleError) as info:
        load_rules("rules.yaml")
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, CkptxformError)
    assert err.exit_code == 2
    assert err.path == "rules.yaml"


def test_missing_file() -> None:
    with pytest.raises(RuleError) as info:
        load_rules("nowhere.yaml")
    assert info.value.problems == ["nowhere.yaml: file not found; check the path"]


def test_python_tag_is_refused_and_never_executed(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    text = f"version: 1\nname: !!python/object/apply:os.system ['touch {marker}']\n"
    assert problems_of(text) == [
        ("rules.yaml:2:7: YAML tag 'tag:yaml.org,2002:python/object/apply:os.system' is not allowed "
        "in a rule file; use plain strings, numbers, booleans, lists and mappings")
    ]
    text = f"version: 1\nname: !!python/object/new:os.system ['touch {marker}']\nx: !!python/name:os.system\n"
    assert len(problems_of(text)) == 2
    assert not marker.exists()


def test_alias_bomb_is_bounded_and_fast() -> None:
    lines = ["version: 1", "a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):  # 10**9 strings if expanded
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    start = time.perf_counter()
    problems = problems_of("\n".join(lines) + "\n")
    assert time.perf_counter() - start < 5
    assert len(problems) == 1
    assert re.fullmatch(
        r"rules\.yaml:\d+:\d+: more than 100,000 YAML nodes \(an alias bomb\?\); "
        r"write the rules out without nested aliases",
        problems[0],
    )


def test_huge_document_is_refused_before_parsing() -> None:
    text = "version: 1\n" + "# " + "x" * MAX_FILE_BYTES + "\n"
    assert problems_of(text) == [f"rules.yaml: larger than {MAX_FILE_BYTES:,} bytes, too large for a rule file"]


def test_all_files_problems_are_reported_each_with_its_file() -> None:
    Path("base.yaml").write_text("version: 1\nfrobnicate: 1\n")
    problems = problems_of("version: 1\nextends: base.yaml\nname: 7\n")
    assert problems == [
        f"base.yaml:2:1: frobnicate: unknown key 'frobnicate' (allowed: {TOP_KEYS})",
        "rules.yaml:3:7: name: expected a string, got an integer 7",
    ]


# --- extends -------------------------------------------------------------------------------

BASE_FILE = """\
version: 1
name: base
description: the base rules
sources:
  drafter: {repo: org/drafter, revision: main}
  verifier: {path: ../checkpoints/verifier}
convert: drafter
vocab:
  k2: {source: drafter, encoding: offset}
tensors:
  - match: 'fc\\.weight'
  - match: 'midlayer\\.(.+)'
    rename: 'layers.0.\\1'
add:
  d2t: {vocab: k2, field: d2t}
require:
  loaded: ['fc\\.weight']
  min_rows_from_source: {lm_head.weight: 0.75}
output: {max_shard_size: 5GB, dtype: bfloat16}
"""

CHILD_FILE = """\
version: 1
extends: ../base/base.yaml
name: child
sources:
  drafter: {path: ./local-drafter}
tensors:
  - match: 'fc\\.weight'
    cast: float32
require:
  strict: false
  min_rows_from_source: {other.weight: 0.5}
output: {max_shard_size: 1GiB}
"""


def _write_family() -> None:
    Path("base").mkdir()
    Path("child").mkdir()
    Path("base/base.yaml").write_text(BASE_FILE)
    Path("child/child.yaml").write_text(CHILD_FILE)


def test_extends_child_overrides_base() -> None:
    _write_family()
    rules = load_rules("child/child.yaml")
    assert rules.files == ("base/base.yaml", "child/child.yaml")
    assert rules.name == "child"
    assert rules.description == "the base rules"
    # sources are replaced by name: the child's drafter is a local path without revision
    assert sorted(rules.sources) == ["drafter", "verifier"]
    assert rules.sources["drafter"].repo is None and rules.sources["drafter"].revision is None
    # paths are relative to the file that wrote them
    assert rules.sources["drafter"].path == "child/local-drafter"
    assert rules.sources["verifier"].path == "checkpoints/verifier"
    assert rules.sources["drafter"].where.file == "child/child.yaml"
    assert rules.sources["verifier"].where.file == "base/base.yaml"
    # the child's rules are tried first; its literal fc.weight rule shadows the base's
    assert [(t.match, t.cast, t.where.short) for t in rules.tensors] == [
        ("fc\\.weight", "float32", "child/child.yaml:7"),
        ("fc\\.weight", None, "base/base.yaml:11"),
        ("midlayer\\.(.+)", None, "base/base.yaml:12"),
    ]
    assert [t.index for t in rules.tensors] == [0, 1, 2]
    # require fields merge: loaded from the base, strict from the child, fractions from both
    assert [p.pattern.pattern for p in rules.require.loaded] == ["fc\\.weight"]
    assert rules.require.strict is False
    assert {m.key: m.fraction for m in rules.require.min_rows_from_source} == {
        "lm_head.weight": 0.75,
        "other.weight": 0.5,
    }
    # output fields merge one by one
    assert rules.output.max_shard_size == 2**30
    assert rules.output.dtype == "bfloat16"
    assert list(rules.add) == ["d2t"] and rules.add["d2t"].where.file == "base/base.yaml"
    assert len(rules.sha256) == 64


def test_extends_inverse_is_replaced_as_a_whole() -> None:
    """Like ``config``: the child's ``inverse`` section replaces the base's, even an empty one."""
    _write_family()
    Path("base/base.yaml").write_text(BASE_FILE + "inverse:\n  config: {from: drafter, keep: [a], set: {b: 1}}\n")
    inherited = load_rules("child/child.yaml").inverse_config
    assert inherited is not None and inherited.where.file == "base/base.yaml"
    settings = [(k, v) for k, v, _ in inherited.set]
    assert (inherited.from_source, inherited.keep, settings) == ("drafter", ("a",), [("b", 1)])
    Path("child/child.yaml").write_text(CHILD_FILE + "inverse:\n  config: {from: verifier}\n")
    replaced = load_rules("child/child.yaml").inverse_config
    assert replaced is not None and replaced.where.file == "child/child.yaml"
    assert (replaced.from_source, replaced.keep, replaced.set) == ("verifier", None, ())
    Path("child/child.yaml").write_text(CHILD_FILE + "inverse: {}\n")
    assert load_rules("child/child.yaml").inverse_config is None


def test_extends_hash_covers_the_base() -> None:
    _write_family()
    before = load_rules("child/child.yaml").sha256
    Path("base/base.yaml").write_text(BASE_FILE.replace("the base rules", "changed"))
    assert load_rules("child/child.yaml").sha256 != before


def test_extends_relative_to_the_rule_file_not_the_working_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    _write_family()
    monkeypatch.chdir("child")
    rules = load_rules("child.yaml")
    assert rules.files == ("../base/base.yaml", "child.yaml")
    assert rules.sources["verifier"].path == "../checkpoints/verifier"


def test_extends_missing_base() -> None:
    Path("sub").mkdir()
    Path("sub/rules.yaml").write_text("version: 1\nextends: base.yaml\n")
    assert problems_of(Path("sub/rules.yaml").read_text(), "sub/rules.yaml") == [
        "sub/rules.yaml:2:10: extends: 'base.yaml' not found (looked for sub/base.yaml)"
    ]


def test_extends_cycle() -> None:
    Path("a.yaml").write_text("version: 1\nextends: b.yaml\n")
    Path("b.yaml").write_text("version: 1\nname: b\nextends: a.yaml\n")
    assert problems_of(Path("a.yaml").read_text(), "a.yaml") == [
        "b.yaml:3:10: extends: 'a.yaml' makes a cycle (a.yaml -> b.yaml -> a.yaml); remove one of the extends"
    ]


def test_extends_itself() -> None:
    assert problems_of("version: 1\nextends: rules.yaml\n") == [
        "rules.yaml:2:10: extends: 'rules.yaml' makes a cycle (rules.yaml -> rules.yaml); remove one of the extends"
    ]


def test_extends_collision_between_files_is_still_reported() -> None:
    _write_family()
    Path("child/child.yaml").write_text(CHILD_FILE + "add:\n  fc.weight: {source: drafter, tensor: x}\n")
    assert problems_of(Path("child/child.yaml").read_text(), "child/child.yaml") == [
        ("child/child.yaml:14:3: add.fc.weight: output key 'fc.weight' is also produced by tensors[0] "
        "(child/child.yaml:7); remove one of them")
    ]


# --- the shipped headline rule -------------------------------------------------------------------


@pytest.fixture(scope="module")
def headline_rules() -> RuleSet:
    return load_rules(HEADLINE)


def _line_of(text: str) -> int:
    """1-based line of the first line of the headline file that contains ``text``."""
    for number, line in enumerate(HEADLINE.read_text().splitlines(), 1):
        if text in line:
            return number
    raise AssertionError(text)


def test_headline_sources_and_vocab(headline_rules: RuleSet) -> None:
    assert headline_rules.name == "aqmedai-k2-to-k25"
    assert headline_rules.convert == "drafter"
    assert {n: (s.repo, s.revision, s.path, s.location) for n, s in headline_rules.sources.items()} == {
        "drafter": ("AQ-MedAI/Kimi-K2-Instruct-eagle3", "main", None, "hf://AQ-MedAI/Kimi-K2-Instruct-eagle3@main"),
        "target_vocab": ("AQ-MedAI/Kimi-K25-eagle3", "main", None, "hf://AQ-MedAI/Kimi-K25-eagle3@main"),
        "verifier": ("moonshotai/Kimi-K2.5", "main", None, "hf://moonshotai/Kimi-K2.5@main"),
    }
    assert {n: (v.source, v.d2t, v.t2d, v.encoding) for n, v in headline_rules.vocab.items()} == {
        "k2": ("drafter", "d2t", "t2d", "offset"),
        "k25": ("target_vocab", "d2t", "t2d", "offset"),
    }
    assert headline_rules.vocab["k25"].where.line == _line_of("k25: {source: target_vocab")


def test_headline_tensor_rules_in_order(headline_rules: RuleSet) -> None:
    rules = headline_rules.tensors
    assert [(t.index, t.match, t.where.line) for t in rules] == [
        (0, "midlayer\\.(.+)", _line_of("match: 'midlayer")),
        (1, "fc\\.weight|norm\\.weight", _line_of("match: 'fc")),
        (2, "lm_head\\.weight", _line_of("match: 'lm_head")),
        (3, "d2t|t2d", _line_of("match: 'd2t")),
        (4, "embed_tokens\\.weight", _line_of("match: 'embed_tokens")),
    ]
    assert all(t.where.file == str(HEADLINE) for t in rules)
    assert rules[0].rename == "layers.0.\\1"
    lm_head = rules[2]
    # permute_rows and missing_rows at rule level are the one op step they spell
    (step,) = lm_head.ops
    assert (step.verb, step.rule_level) == ("permute_rows", True)
    assert step.args == {"from": "k2", "to": "k25",
                         "missing_rows": {"rows_of": "verifier", "tensor": "language_model.lm_head.weight"}}
    assert step.where.line == _line_of("permute_rows:") and step.place("missing_rows").line == _line_of("missing_rows:")
    assert rules[3].skip is not None and rules[3].skip.startswith("replaced by")
    assert rules[4].optional is True
    assert rules[2].label == f"tensors[2] ({HEADLINE}:{rules[2].where.line})"


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("midlayer.self_attn.q_proj.weight", "layers.0.self_attn.q_proj.weight"),
        ("midlayer.post_attention_layernorm.weight", "layers.0.post_attention_layernorm.weight"),
        ("fc.weight", "fc.weight"),
        ("norm.weight", "norm.weight"),
        ("lm_head.weight", "lm_head.weight"),
        ("d2t", None),
        ("t2d", None),
        ("embed_tokens.weight", "embed_tokens.weight"),
        ("model.fc.weight", None),
    ],
)
def test_headline_output_keys(headline_rules: RuleSet, key: str, expected: str | None) -> None:
    """The first rule that matches the whole key decides its output key."""
    first = next((t for t in headline_rules.tensors if t.pattern.fullmatch(key)), None)
    assert (first.output_key(key) if first else None) == expected


def test_output_key_of_a_rule_that_does_not_match(headline_rules: RuleSet) -> None:
    assert headline_rules.tensors[0].output_key("fc.weight") is None
    assert headline_rules.tensors[0].output_key("xmidlayer.a") is None  # whole-key match only


def test_headline_add_require_config_output(headline_rules: RuleSet) -> None:
    assert {k: (a.vocab, a.field, a.encoding) for k, a in headline_rules.add.items()} == {
        "d2t": ("k25", "d2t", "offset"),
        "t2d": ("k25", "t2d", "offset"),
    }
    loaded = [p.pattern.pattern for p in headline_rules.require.loaded]
    assert len(loaded) == 13
    for key in ("layers.0.post_attention_layernorm.weight", "layers.0.self_attn.q_proj.weight",
                "fc.weight", "norm.weight", "lm_head.weight"):
        assert any(re.fullmatch(p, key) for p in loaded), key
    assert headline_rules.require.loaded[0].where.line == _line_of("- 'layers\\.0\\.self_attn\\.q_proj")
    assert [(m.key, m.fraction) for m in headline_rules.require.min_rows_from_source] == [("lm_head.weight", 0.75)]
    assert headline_rules.require.strict is True
    config = headline_rules.config
    assert config is not None
    assert (config.from_source, config.keep, config.rename, config.delete) == ("drafter", (), (), ())
    settings = {key: value for key, value, _ in config.set}
    assert settings["draft_vocab_size"] == "${vocab.k25.draft_size}"
    assert settings["transformer_layer_config"]["vocab_size"] == "${vocab.k25.vocab_size}"
    assert settings["speculators_config"]["verifier"]["name_or_path"] == "${source.verifier.repo}"
    assert headline_rules.output.max_shard_size == 5_000_000_000
    assert headline_rules.output.file_name == "model.safetensors"


def test_ruleset_is_frozen(headline_rules: RuleSet) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        headline_rules.name = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        headline_rules.tensors[0].rename = "x"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        headline_rules.output.max_shard_size = 1  # type: ignore[misc]


def test_with_sources_overrides_a_location(headline_rules: RuleSet) -> None:
    local = headline_rules.with_sources({"drafter": "./k2-drafter"})
    assert local.sources["drafter"].location == "./k2-drafter"
    assert local.sources["drafter"].repo == "AQ-MedAI/Kimi-K2-Instruct-eagle3"  # kept for the audit
    assert headline_rules.sources["drafter"].location == "hf://AQ-MedAI/Kimi-K2-Instruct-eagle3@main"
    assert local.tensors == headline_rules.tensors


def test_with_sources_unknown_name(headline_rules: RuleSet) -> None:
    with pytest.raises(UsageError) as info:
        headline_rules.with_sources({"drafer": "./x"})
    assert str(info.value) == (
        f"--source drafer=...: the rule file {HEADLINE} has no source 'drafer' "
        "(defined: drafter, target_vocab, verifier)"
    )
    assert info.value.exit_code == 2


def test_a_copy_loads_from_anywhere(tmp_path: Path) -> None:
    shutil.copy(HEADLINE, "copy.yaml")
    assert load_rules("copy.yaml").sha256 == load_rules(HEADLINE).sha256


@pytest.mark.parametrize(("text", "size"), [("5GB", 5_000_000_000), ("1.5GB", 1_500_000_000),
                                            ("512MiB", 512 * 2**20), ("7 B", 7), (123, 123)])
def test_parse_size(text: str | int, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize(("value", "shown", "bits"), [("0x" + "f" * 4000, "0xfffffffffffffffffff...", 16000),
                                                    (str(2**64), "18446744073709551616", 65),
                                                    ("0b1" + "0" * 64, "0b1000000000000000000...", 65)])
def test_integers_past_64_bits_are_one_clear_error(tmp_path: Path, value: str, shown: str, bits: int) -> None:
    """A hex literal has no digit limit in Python, but printing it in decimal (a message,
    JSON) fails: such numbers are refused where they stand."""
    rule = tmp_path / "big.yaml"
    rule.write_text("version: 1\nname: x\nsources: {a: {path: p}}\nconvert: a\ntensors: [{match: '.*'}]\n"
                    f"output: {{max_shard_size: {value}}}\n")
    with pytest.raises(RuleError) as caught:
        load_rules(rule)
    [message] = caught.value.problems
    assert message == f"{rule}:6:26: {shown!r} is a {bits}-bit integer; rule files take integers of at most 64 bits"


def test_a_64_bit_integer_is_still_accepted(tmp_path: Path) -> None:
    rule = tmp_path / "ok.yaml"
    rule.write_text("version: 1\nname: x\nsources: {a: {path: p}}\nconvert: a\ntensors: [{match: '.*'}]\n"
                    "output: {max_shard_size: 0xffffffffffffffff}\n")
    assert load_rules(rule).output.max_shard_size == 2**64 - 1
