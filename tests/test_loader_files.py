"""Issue 35 item 1: the files a server needs come along. Every shipped rule whose output
is a Hugging Face model carries the converted source's tokenizer files, chat template,
generation config and the other files a loader reads (``output.loader_files``), byte for
byte; ``plan`` lists them, the audit records their sha256 and ``verify`` checks them; a rule
can opt out or take them from another source."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO, assert_clean_failure, read_audit

from ckptxform import api, load_rules
from ckptxform.engine.output.verify import verify
from ckptxform.errors import PlanError, VerifyError
from ckptxform.rules.file_rules import LOADER_FILES, glob_pattern
from ckptxform.standins.for_rules import STANDINS

#: a model folder's loader files, one of each kind (path -> bytes)
LOADER = {
    "tokenizer.json": b'{"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0}}}',
    "tokenizer_config.json": b'{"chat_template": "{{ messages[0].content }}", "tokenizer_class": "X"}',
    "special_tokens_map.json": b'{"bos_token": "<s>"}',
    "generation_config.json": b'{"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.6}\n',
    "chat_template.jinja": b"{% for m in messages %}{{ m.content }}{% endfor %}",
    "tokenizer.model": b"\x00sentencepiece\xff" * 32,
    "added_tokens.json": b'{"<extra>": 9}',
    "vocab.json": b'{"a": 0, "b": 1}',
    "merges.txt": b"#version: 0.2\na b\n",
    "qwen.tiktoken": b"YQ== 0\nYg== 1\n",
    "tokenization_custom.py": b"# the tokenizer class tokenizer_config.json's auto_map names\n",
}

SHIPPED = sorted(p.stem for p in (REPO / "rules").glob("*.yaml"))
CARRYING = [stem for stem in SHIPPED if load_rules(stem).output.loader_files is not None]


def test_which_shipped_rules_carry_loader_files() -> None:
    # not a Hugging Face folder: GGUF files (tokenizer in the metadata), Meta's consolidated
    # layout, a drafter whose own tokenizer contradicts the vocabulary it is remapped to, and a
    # Megatron save, which holds no tokenizer (a rule extending it names one: below)
    assert sorted(set(SHIPPED) - set(CARRYING)) == [
        "aqmedai_k2_to_k25", "aqmedai_k2_to_k25_sglang", "hf_llama_to_meta",
        "hf_to_gguf_bf16", "hf_to_gguf_f16", "hf_to_gguf_q8_0", "megatron_gpt_to_hf", "megatron_moe_to_hf"]
    assert load_rules("torchtitan_0_2_llama_to_hf").output.loader_files == "hf_assets"
    assert load_rules("mtp_graft").output.loader_files == "verifier"


def _folder(location: str) -> Path:
    path = Path(location)
    return path if path.is_dir() else path.parent


def _add_loader_files(folder: Path) -> None:
    for name, data in LOADER.items():
        (folder / name).write_bytes(data)


@pytest.mark.parametrize("stem", CARRYING)
def test_shipped_rule_output_holds_the_loader_files_byte_identical(stem: str, tmp_path: Path) -> None:
    sources = STANDINS[stem].build(tmp_path / "sources")
    carry = load_rules(stem).output.loader_files
    assert carry is not None
    folder = _folder(sources[carry])
    _add_loader_files(folder)
    names = sorted(n for n in LOADER if not (folder / n).is_symlink())

    planned = api.plan(stem, sources=sources)
    copied = {c.target: c for c in planned.files.copies}
    assert set(names) <= set(copied), sorted(copied)
    assert all(copied[n].source == carry and copied[n].path == n for n in names)

    out = tmp_path / "out"
    api.apply(stem, out=out, sources=sources)
    for name in names:
        assert (out / name).read_bytes() == (folder / name).read_bytes(), name
    events = {e["file"]: e for e in read_audit(out) if e["event"] == "file" and e["action"] == "copied"}
    assert set(names) <= set(events)
    verify(out)
    (out / "generation_config.json").write_bytes(b"{}")
    with pytest.raises(VerifyError, match="generation_config.json: sha256 .* differs from the audit"):
        verify(out)


def test_a_megatron_rule_extended_with_hf_assets_carries_theirs(tmp_path: Path) -> None:
    sources = STANDINS["megatron_gpt_to_hf"].build(tmp_path / "sources")
    _add_loader_files(_model(tmp_path / "hf_assets"))
    (tmp_path / "mine.yaml").write_text(textwrap.dedent("""\
        version: 1
        extends: megatron_gpt_to_hf
        sources:
          hf_assets: {path: hf_assets}
        output:
          loader_files: {from: hf_assets}
        """))
    api.apply(tmp_path / "mine.yaml", out=tmp_path / "out", sources=sources)
    for name, data in LOADER.items():
        assert (tmp_path / "out" / name).read_bytes() == data
    verify(tmp_path / "out")


def _rule(tmp_path: Path, output: str = "", files: str = "") -> Path:
    (tmp_path / "rule.yaml").write_text(textwrap.dedent("""\
        version: 1
        name: r
        sources:
          model: {path: model}
          assets: {path: assets}
        convert: model
        tensors:
          - match: '.+'
        config: {from: model}
        """) + files + output)
    return tmp_path / "rule.yaml"


def _model(folder: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    save_file({"model.norm.weight": torch.ones(4)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text('{"model_type": "llama"}')
    return folder


@pytest.fixture
def folders(tmp_path: Path) -> Path:
    _add_loader_files(_model(tmp_path / "model"))
    assets = _model(tmp_path / "assets")
    (assets / "tokenizer.json").write_bytes(b'{"assets": true}')
    (_model(tmp_path / "nothing")).joinpath("README.md").write_text("no tokenizer here\n")
    return tmp_path


def test_plan_lists_the_carried_files_in_text_and_json(folders: Path, run_cli) -> None:  # type: ignore[no-untyped-def]
    rule = _rule(folders).name
    text = run_cli("plan", rule, cwd=folders)
    assert text.returncode == 0, text.stderr
    assert f"files: {len(LOADER)} copied, 0 skipped, 0 other file(s) not copied" in text.stdout
    assert re.search(r"^  tokenizer\.json +<- model:tokenizer\.json \(rule\.yaml:1, output\.loader_files\)$",
                     text.stdout, re.M), text.stdout
    as_json = run_cli("plan", rule, "--json", cwd=folders)
    assert as_json.returncode == 0, as_json.stderr
    files = json.loads(as_json.stdout)["files"]
    assert sorted(f["file"] for f in files) == sorted(LOADER)
    assert all(f["action"] == "copied" and f["source"] == "model" for f in files)


def test_opting_out_copies_no_file(folders: Path) -> None:
    rule = _rule(folders, "output: {loader_files: none}\n")
    assert api.plan(rule).files.copies == ()
    api.apply(rule, out=folders / "out")
    assert sorted(p.name for p in (folders / "out").iterdir()) == ["ckptxform_audit.jsonl", "config.json",
                                                                    "model.safetensors"]


def test_loader_files_from_another_source(folders: Path) -> None:
    rule = _rule(folders, "output: {loader_files: {from: assets}}\n")
    api.apply(rule, out=folders / "out")
    assert (folders / "out" / "tokenizer.json").read_bytes() == b'{"assets": true}'
    assert not (folders / "out" / "merges.txt").exists()


def test_a_source_without_loader_files_is_fine(folders: Path) -> None:
    rule = _rule(folders)
    api.apply(rule, out=folders / "out", sources={"model": str(folders / "nothing")})
    assert not (folders / "out" / "README.md").exists()
    assert sorted(p.name for p in (folders / "out").iterdir()) == ["ckptxform_audit.jsonl", "config.json",
                                                                    "model.safetensors"]


def test_a_files_entry_comes_before_the_loader_files(folders: Path) -> None:
    files = textwrap.dedent("""\
        files:
          - {glob: merges.txt, skip: not this one}
          - {glob: tokenizer.json, from: assets}
          - {glob: vocab.json, rename: vocab-original.json}
        """)
    plan = api.plan(_rule(folders, files=files))
    copied = {c.target: (c.source, c.path) for c in plan.files.copies}
    assert copied["tokenizer.json"] == ("assets", "tokenizer.json")
    assert copied["vocab-original.json"] == ("model", "vocab.json") and "vocab.json" not in copied
    assert "merges.txt" not in copied and [s.path for s in plan.files.skips] == ["merges.txt"]


def test_a_gguf_output_carries_none_by_default_and_a_rule_says_no_other_value(tmp_path: Path) -> None:
    assert load_rules("hf_to_gguf_q8_0").loader_file_rules == ()
    rule = _rule(tmp_path, "output: {loader_files: {from: nowhere}}\n")
    with pytest.raises(Exception, match=r"loader_files.*unknown source 'nowhere'"):
        load_rules(rule)
    bad = _rule(tmp_path, "output: {loader_files: copy}\n")
    with pytest.raises(Exception, match="loader_files"):
        load_rules(bad)


@pytest.mark.parametrize("name", ["evil\x1b[2J.tiktoken", "tokenizer\n.json", "tokenizer\x7f.json"])
def test_a_hostile_loader_file_name_is_refused(folders: Path, name: str,
                                               run_cli) -> None:  # type: ignore[no-untyped-def]
    (folders / "model" / name).write_bytes(b"x")
    with pytest.raises(PlanError, match="holds a loader file named .* must not hold control characters"):
        api.plan(_rule(folders))
    proc = run_cli("apply", _rule(folders), "--out", folders / "out", cwd=folders)
    err = assert_clean_failure(proc)
    assert "\x1b" not in err and "control characters" in err
    assert not (folders / "out").exists()


def test_every_loader_glob_stays_at_the_top_or_one_named_folder() -> None:
    # no glob reaches into a source's subfolders (original/, a training run's state) but
    # the one transformers writes extra chat templates to
    for glob in LOADER_FILES:
        assert "**" not in glob and glob.count("/") <= int(glob.startswith("additional_chat_templates/"))
    assert glob_pattern("*.tiktoken").fullmatch("a/b.tiktoken") is None


def _real_tokenizer(folder: Path) -> None:
    """A small real tokenizer (the tokenizers library's WordLevel) with its config, chat
    template and generation config, as a model folder on the Hub holds them."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "server": 5}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                              **special}))
    (folder / "special_tokens_map.json").write_text(json.dumps(special))
    (folder / "chat_template.jinja").write_text("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>"
                                                "{% endfor %}")
    (folder / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.25}')


@pytest.mark.reference
def test_transformers_loads_model_tokenizer_and_generation_config_from_the_output(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    sources = STANDINS["bf16_to_fp8_block"].build(tmp_path / "sources")
    source = Path(sources["model"])
    _real_tokenizer(source)
    out = tmp_path / "out"
    api.apply("bf16_to_fp8_block", out=out, sources=sources)

    chat = [{"role": "user", "content": "hello server"}]
    theirs = transformers.AutoTokenizer.from_pretrained(source)
    ours = transformers.AutoTokenizer.from_pretrained(out)
    assert ours("hello world server").input_ids == theirs("hello world server").input_ids == [3, 4, 5]
    assert ours.apply_chat_template(chat, tokenize=False) == "<s>user: hello server</s>"
    assert (ours.bos_token, ours.eos_token) == ("<s>", "</s>")
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert (generation.eos_token_id, generation.temperature) == (2, 0.25)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_from_the_hub_only_the_loader_files_are_fetched(tmp_path: Path) -> None:
    from hub_fixtures import ProxyTrap, client_env, file_requests
    from hubserver import HubServer

    _add_loader_files(_model(tmp_path / "model"))
    (tmp_path / "model" / "training_state.pt").write_bytes(b"\x80" * 65536)
    (tmp_path / "model" / "README.md").write_text("# not a loader file\n")
    (tmp_path / "model" / "original").mkdir()
    (tmp_path / "model" / "original" / "tokenizer.model").write_bytes(b"\x00" * 512)
    (tmp_path / "rule.yaml").write_text("version: 1\nname: r\nsources:\n  model: {repo: ORG/M, revision: main}\n"
                                        "tensors:\n  - match: '.+'\nconfig: {from: model}\n")
    trap = ProxyTrap()
    try:
        with HubServer() as server:
            server.add_repo("ORG/M", tmp_path / "model")
            env = client_env(server, tmp_path / "home", trap, HF_HUB_CACHE=str(tmp_path / "cache"), NO_COLOR="1")

            def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
                server.clear_log()
                return subprocess.run([sys.executable, "-m", "ckptxform", *map(str, args), "-q"], env=env,
                                      cwd=tmp_path, capture_output=True, text=True, timeout=120)

            def fetched() -> set[str]:
                return {r.path.split("/resolve/", 1)[1].split("/", 1)[1] for r in file_requests(server.log) if r.sent}

            plan = cli("plan", "rule.yaml", "--json")
            assert plan.returncode == 0, plan.stderr
            assert sorted(f["file"] for f in json.loads(plan.stdout)["files"]) == sorted(LOADER)
            assert fetched() <= {"config.json", "model.safetensors"}  # no file is fetched to plan
            applied = cli("apply", "rule.yaml", "--out", tmp_path / "out")
            assert applied.returncode == 0, applied.stderr
            assert set(LOADER) <= fetched() <= {"config.json", "model.safetensors", *LOADER}
    finally:
        trap.close()
    for name, data in LOADER.items():
        assert (tmp_path / "out" / name).read_bytes() == data
    assert not (tmp_path / "out" / "README.md").exists() and not (tmp_path / "out" / "original").exists()
    verify(tmp_path / "out")
    assert trap.lines == []


def test_a_loader_file_linking_out_of_the_source_is_refused(folders: Path) -> None:
    (folders / "secret.txt").write_text("not the model's\n")
    (folders / "model" / "tokenizer.json").unlink()
    (folders / "model" / "tokenizer.json").symlink_to(folders / "secret.txt")
    with pytest.raises(Exception, match="tokenizer.json: links to .*secret.txt, outside the checkpoint directory"):
        api.apply(_rule(folders), out=folders / "out")
    assert not (folders / "out").exists()


def test_llava_to_text_skips_the_image_processor_files_and_carries_the_rest(tmp_path: Path) -> None:
    sources = STANDINS["llava_to_text"].build(tmp_path / "sources")
    folder = Path(sources["model"])
    _add_loader_files(folder)
    for name in ("preprocessor_config.json", "processor_config.json", "chat_template.json"):
        (folder / name).write_text('{"image": true}')
    plan = api.plan("llava_to_text", sources=sources)
    assert sorted(s.path for s in plan.files.skips) == ["chat_template.json", "preprocessor_config.json",
                                                        "processor_config.json"]
    assert sorted(c.target for c in plan.files.copies) == sorted(LOADER)
