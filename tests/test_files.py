"""The ``files:`` section: non-weight files copied from a source by glob, with renames and
skips, recorded in the audit with their sha256 and checked by ``verify``; from the Hub only
the files copied are fetched."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, assert_clean_failure, read_audit
from hub_fixtures import ProxyTrap, client_env, file_requests
from hubserver import HubServer
from safetensors.torch import save_file

from ckptxform import api, load_rules
from ckptxform.errors import PlanError, RuleError
from ckptxform.rules.file_rules import glob_pattern
from ckptxform.engine.output.verify import verify

#: what a served model folder holds besides its weights (path -> bytes)
MODEL_FILES = {
    "config.json": b'{"model_type": "llama", "tie_word_embeddings": true}',
    "tokenizer.json": b'{"version": "1.0", "model": {"type": "BPE"}}',
    "tokenizer_config.json": b'{"chat_template": "{{ bos_token }}"}',
    "special_tokens_map.json": b'{"bos_token": "<s>"}',
    "generation_config.json": b'{"bos_token_id": 1, "eos_token_id": 2}',
    "chat_template.jinja": b"{% for m in messages %}{{ m.content }}{% endfor %}",
    "README.md": b"# a model\n",
    "LICENSE": b"Apache-2.0\n",
    "original/tokenizer.model": b"\x00sentencepiece\xff" * 64,
    "training_state.pt": b"\x80" * 4096,
}

#: a whole-model rule: every tensor kept, the files a server needs copied
RULE = """\
version: 1
name: whole-model
sources:
  model: {path: model}
tensors:
  - match: '.+'
files:
  - {glob: 'tokenizer*'}
  - {glob: special_tokens_map.json}
  - {glob: generation_config.json}
  - {glob: '*.jinja'}
  - {glob: preprocessor_config.json, optional: true}
  - {glob: README.md, rename: 'SOURCE_{name}'}
  - {glob: LICENSE}
  - {glob: 'original/**', skip: the sentencepiece model is not needed beside tokenizer.json}
config: {from: model}
"""
COPIED = {"tokenizer.json": "tokenizer.json", "tokenizer_config.json": "tokenizer_config.json",
          "special_tokens_map.json": "special_tokens_map.json", "generation_config.json": "generation_config.json",
          "chat_template.jinja": "chat_template.jinja", "SOURCE_README.md": "README.md", "LICENSE": "LICENSE"}


def make_model(folder: Path) -> Path:
    folder.mkdir(parents=True)
    save_file({"model.embed_tokens.weight": torch.arange(32, dtype=torch.float32).reshape(8, 4),
               "model.norm.weight": torch.ones(4)}, str(folder / "model.safetensors"))
    for name, data in MODEL_FILES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return folder


@pytest.fixture
def model_rule(tmp_path: Path) -> Path:
    make_model(tmp_path / "model")
    (tmp_path / "rule.yaml").write_text(RULE)
    return tmp_path / "rule.yaml"


def test_files_arrive_unchanged_renamed_and_skipped_and_are_audited(model_rule: Path, tmp_path: Path) -> None:
    result = api.apply(model_rule, out=tmp_path / "out")
    out = tmp_path / "out"
    for target, source in COPIED.items():
        assert (out / target).read_bytes() == MODEL_FILES[source]
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == sorted(
        [*COPIED, "config.json", "model.safetensors", "ckptxform_audit.jsonl"])
    events = [e for e in read_audit(out) if e["event"] == "file"]
    assert {e["file"]: (e["path"], e["sha256"], e["bytes"]) for e in events if e["action"] == "copied"} == {
        t: (s, hashlib.sha256(MODEL_FILES[s]).hexdigest(), len(MODEL_FILES[s])) for t, s in COPIED.items()}
    skipped = [e for e in events if e["action"] == "skipped"]
    assert skipped == [{"event": "file", "action": "skipped", "source": "model", "path": "original/tokenizer.model",
                        "rule": f"{model_rule}:15",
                        "reason": "the sentencepiece model is not needed beside tokenizer.json"}]
    assert read_audit(out)[-1]["copied_files"] == len(COPIED)
    assert sorted(c.copy.target for c in result.copied) == sorted(COPIED)
    # training_state.pt is matched by no entry: not copied, counted in the plan
    with api.plan(model_rule) as plan:
        assert plan.files.unmatched == (("model", 1),)


def test_verify_catches_an_edited_or_missing_copied_file(model_rule: Path, tmp_path: Path, run_cli: Any) -> None:
    out = tmp_path / "out"
    api.apply(model_rule, out=out)
    assert verify(out).tensors == 2
    (out / "tokenizer.json").write_bytes(MODEL_FILES["tokenizer.json"].replace(b"BPE", b"BPF"))
    (out / "chat_template.jinja").unlink()
    proc = run_cli("verify", out)
    assert_clean_failure(proc, 1)
    digest = hashlib.sha256(MODEL_FILES["tokenizer.json"]).hexdigest()
    assert proc.stderr.splitlines()[:2] == [
        f"error: {out / 'chat_template.jinja'}: No such file or directory; apply copied it from source 'model' "
        "('chat_template.jinja')",
        f"error: {out / 'tokenizer.json'}: sha256 "
        f"{hashlib.sha256(MODEL_FILES['tokenizer.json'].replace(b'BPE', b'BPF')).hexdigest()[:12]}... differs "
        f"from the audit's {digest[:12]}...; the file was changed after apply"]


def test_without_a_files_section_nothing_is_copied(headline_out: Path) -> None:
    assert sorted(p.name for p in headline_out.iterdir()) == ["ckptxform_audit.jsonl", "config.json",
                                                              "model.safetensors"]
    assert load_rules(REPO / "rules" / "aqmedai_k2_to_k25.yaml").file_rules == ()


def test_a_glob_that_matches_nothing_fails_the_plan_and_lists_the_files(model_rule: Path) -> None:
    rule = model_rule.read_text().replace("{glob: LICENSE}", "{glob: LICENCE}")
    model_rule.write_text(rule)
    with pytest.raises(PlanError) as err:
        api.plan(model_rule)
    assert str(err.value) == (
        f"files[6] ({model_rule}:14): glob 'LICENCE' matches no file of source 'model' "
        f"({model_rule.parent / 'model'}), which holds 'LICENSE', 'README.md', 'chat_template.jinja', "
        "'generation_config.json', 'original/tokenizer.model', 'special_tokens_map.json', 'tokenizer.json', "
        "'tokenizer_config.json' and 1 more besides its weights; fix the glob, or add optional: true if the "
        "file may be absent")


@pytest.mark.parametrize(("entry", "message"), [
    ("{glob: 'tokenizer*', rename: tokenizer.json}",
     "files[0] ({rule}:7): model:'tokenizer_config.json' and model:'tokenizer.json' would both be copied "
     "to 'tokenizer.json'; rename one (rename: may use {{path}})"),
    ("{glob: README.md, rename: model.safetensors}",
     "files[0] ({rule}:7): would copy model:'README.md' to 'model.safetensors', a name the output's weights, "
     "config.json or audit take; skip the file or rename it"),
])
def test_collisions_are_refused_before_anything_is_written(entry: str, message: str, tmp_path: Path) -> None:
    make_model(tmp_path / "model")
    rule = tmp_path / "rule.yaml"
    rule.write_text(f"version: 1\nsources:\n  model: {{path: model}}\ntensors:\n  - match: '.+'\nfiles:\n  - {entry}\n")
    with pytest.raises(PlanError) as err:
        api.apply(rule, out=tmp_path / "out")
    assert str(err.value) == message.format(rule=rule)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("entry", "message"), [
    ("{glob: '../secrets'}", "files[0].glob: '../secrets' must not hold empty, '.' or '..' parts"),
    ("{glob: '/etc/passwd'}", "files[0].glob: '/etc/passwd' must be a relative path with '/' between folders"),
    ("{glob: x, rename: '../x'}", "files[0].rename: '../x' must not hold empty, '.' or '..' parts"),
    ("{glob: x, rename: '{stem}.txt'}", "files[0].rename: '{stem}.txt' may hold only {name} and {path}"),
    ("{glob: x, from: modle}", "files[0].from: unknown source 'modle' (defined: model); did you mean 'model'?"),
])
def test_bad_entries_are_rule_errors(entry: str, message: str, tmp_path: Path) -> None:
    rule = tmp_path / "rule.yaml"
    rule.write_text(f"version: 1\nsources:\n  model: {{path: model}}\ntensors: []\nfiles:\n  - {entry}\n")
    with pytest.raises(RuleError) as err:
        load_rules(rule)
    assert [p.split(": ", 1)[1] for p in err.value.problems] == [message]


def test_a_child_rule_s_entries_are_tried_first(model_rule: Path, tmp_path: Path) -> None:
    child = tmp_path / "child.yaml"
    child.write_text("version: 1\nextends: rule.yaml\nfiles:\n  - {glob: README.md, skip: ours is better}\n")
    with api.plan(child) as plan:
        assert [(s.path, s.reason) for s in plan.files.skips] == [
            ("README.md", "ours is better"), ("original/tokenizer.model",
                                              "the sentencepiece model is not needed beside tokenizer.json")]
        assert "SOURCE_README.md" not in {c.target for c in plan.files.copies}


@pytest.mark.parametrize(("glob", "path", "hit"), [
    ("tokenizer*", "tokenizer.json", True), ("tokenizer*", "sub/tokenizer.json", False),
    ("**/tokenizer.json", "tokenizer.json", True), ("**/tokenizer.json", "a/b/tokenizer.json", True),
    ("original/**", "original/x/y.model", True), ("*.jinja", "templates/chat.jinja", False),
    ("[!R]*.md", "README.md", False), ("[!R]*.md", "NOTES.md", True), ("a?c", "a/c", False),
])
def test_globs(glob: str, path: str, hit: bool) -> None:
    assert (glob_pattern(glob).fullmatch(path) is not None) is hit


# --- from the Hub: only the copied files are fetched ----------------------------------------------

@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HubServer, ProxyTrap, Path]]:
    root = tmp_path_factory.mktemp("files-hub")
    make_model(root / "model")
    (root / "rule.yaml").write_text(RULE.replace("model: {path: model}", "model: {repo: ORG/M, revision: main}"))
    trap = ProxyTrap()
    with HubServer() as server:
        server.add_repo("ORG/M", root / "model")
        yield server, trap, root
    trap.close()


def test_from_the_hub_plan_lists_and_apply_fetches_only_the_copied_files(
        hub: tuple[HubServer, ProxyTrap, Path], tmp_path: Path) -> None:
    server, trap, root = hub
    env = client_env(server, tmp_path / "home", trap, HF_HUB_CACHE=str(tmp_path / "cache"), NO_COLOR="1")

    def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
        server.clear_log()
        return subprocess.run([sys.executable, "-m", "ckptxform", *map(str, args), "-q"], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)

    def fetched() -> set[str]:
        return {r.path.rsplit("/", 1)[-1] if "/original/" not in r.path else "original/tokenizer.model"
                for r in file_requests(server.log) if r.sent}

    plan = cli("plan", root / "rule.yaml", "--json")
    assert plan.returncode == 0, plan.stderr
    assert {f["file"] for f in json.loads(plan.stdout)["files"] if f["action"] == "copied"} == set(COPIED)
    assert fetched() == {"config.json", "model.safetensors"}  # config, and the weights' header by range
    assert any("/api/models/ORG/M/tree/" in r.path for r in server.log)

    applied = cli("apply", root / "rule.yaml", "--out", tmp_path / "out")
    assert applied.returncode == 0, applied.stderr
    # not training_state.pt, not original/; the small weights may have come whole with the
    # plan's first read of model.safetensors (its first 256 KiB, kept in the range cache)
    assert set(COPIED.values()) <= fetched() <= {"model.safetensors", *COPIED.values()}
    for target, source in COPIED.items():
        assert (tmp_path / "out" / target).read_bytes() == MODEL_FILES[source]
    assert verify(tmp_path / "out").tensors == 2
    assert trap.lines == []


def test_files_text_of_the_plan(model_rule: Path, run_cli: Any) -> None:
    text = run_cli("plan", model_rule).stdout
    rule = str(model_rule)
    assert text.endswith(textwrap.dedent(f"""\
        files: 7 copied, 1 skipped, 1 other file(s) not copied
          LICENSE                  <- model:LICENSE ({rule}:14)
          SOURCE_README.md         <- model:README.md ({rule}:13)
          chat_template.jinja      <- model:chat_template.jinja ({rule}:11)
          generation_config.json   <- model:generation_config.json ({rule}:10)
          special_tokens_map.json  <- model:special_tokens_map.json ({rule}:9)
          tokenizer.json           <- model:tokenizer.json ({rule}:8)
          tokenizer_config.json    <- model:tokenizer_config.json ({rule}:8)
          skipped model:original/tokenizer.model ({rule}:15): the sentencepiece model is not needed beside \
tokenizer.json
        """))


def test_a_rerun_notices_a_changed_source_file(model_rule: Path, tmp_path: Path) -> None:
    from ckptxform.errors import OutputError

    out = tmp_path / "out"
    api.apply(model_rule, out=out)
    assert api.apply(model_rule, out=out).up_to_date
    (tmp_path / "model" / "tokenizer.json").write_bytes(b'{"version": "2.0"}')
    with pytest.raises(OutputError) as err:
        api.apply(model_rule, out=out)
    assert str(err.value) == (f"{str(out)!r} already exists and was made from another 'tokenizer.json' of source "
                              "'model' (its sha256 changed since); pass --force to replace it")
    (tmp_path / "model" / "tokenizer.json").write_bytes(MODEL_FILES["tokenizer.json"])
    (tmp_path / "model" / "tool_template.jinja").write_text("{{ tools }}")
    with pytest.raises(OutputError) as err:
        api.apply(model_rule, out=out)
    assert str(err.value).endswith("was made from other files: 7 copied then, 8 to copy now (the rules' files "
                                   "section or the sources' files changed); pass --force to replace it")
    (tmp_path / "model" / "LICENSE").unlink()
    model_rule.write_text(model_rule.read_text().replace("{glob: LICENSE}", "{glob: LICENSE, optional: true}"))
    with pytest.raises(OutputError, match="other files: 7 copied then, 7 to copy now"):
        api.apply(model_rule, out=out)
    assert api.apply(model_rule, out=out, force=True).copied[0].copy.target == "SOURCE_README.md"
