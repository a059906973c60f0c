"""Hostile inputs against the output's promise (issue 12, items 1, 2, 3-local and 13):
``--force`` never destroys what ckptxform did not write, "up to date" is true, a source
rewritten under a run never yields a mixed output, and SIGTERM cleans up like SIGINT.

Every case runs the real command (a subprocess) or the real engine on real stand-in
checkpoints, asserts the exact one-line message and exit code, that nothing is left
beside OUT (no temporary sibling, no lock) and that no source file changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import LM_HEAD, read_audit, source_args
from safetensors.torch import load_file, save_file
from test_crash import CRASH_DIMS, output_files, wait_for_tmp
from test_reliability import apply_args, beside, copy_drafter, flip_byte, one_error, snapshot, tree_digest
from test_writer import mark_as_earlier_output

from ckptxform import api
from ckptxform.engine.output.outdir import OutputDir
from ckptxform.engine.run.writer import ShardWriter
from ckptxform.errors import CkptxformError, OutputError, SourceChangedError
from ckptxform.standins import HeadlineStandins, build_headline_standins
from ckptxform.engine.output.verify import verify

AUDIT = "ckptxform_audit.jsonl"
REFUSE_FIX = "ckptxform replaces only its own earlier outputs (with --force): move it away or choose another --out"


def source_dirs(sources: dict[str, str]) -> list[Path]:
    return [Path(loc) for loc in sources.values()]


def real(path: Path) -> str:
    return repr(str(path.resolve()))


# ============================================================================ 1. --force never destroys


@pytest.mark.parametrize("where", ["the drafter itself", "a link to the drafter", "the sources' parent",
                                   "inside the drafter"])
@pytest.mark.parametrize("force", [False, True])
def test_an_out_overlapping_a_source_is_refused_and_the_source_is_untouched(
        where: str, force: bool, headline: HeadlineStandins, headline_rule: Path, run_cli: Any,
        tmp_path: Path) -> None:
    root = tmp_path / "sources"
    sources = copy_drafter(headline, root / "drafter")
    drafter = root / "drafter"
    (tmp_path / "link").symlink_to(drafter)
    out, relation = {
        "the drafter itself": (drafter, "is"),
        "a link to the drafter": (tmp_path / "link", "is"),
        "the sources' parent": (root, "contains"),
        "inside the drafter": (drafter / "converted", "lies inside"),
    }[where]
    before = tree_digest(drafter, *source_dirs(headline.sources))
    entries = sorted(p.name for p in drafter.iterdir())

    refused = run_cli(*apply_args(headline_rule, sources, out, *(["--force"] if force else [])))
    assert one_error(refused) == (f"error: refusing to write to {str(out)!r}: it {relation} source 'drafter' "
                                  f"({real(drafter)}); choose an --out outside every input")
    assert tree_digest(drafter, *source_dirs(headline.sources)) == before
    assert sorted(p.name for p in drafter.iterdir()) == entries  # training_state.pt and all
    assert beside(out) == [] and beside(drafter) == []


def test_an_out_that_is_a_vocab_file_or_holds_the_rule_file_is_refused(
        headline: HeadlineStandins, rule_variant: Callable[..., Path], run_cli: Any, tmp_path: Path) -> None:
    vocab = tmp_path / "vocab" / "k25.safetensors"
    write_vocab_file(vocab, Path(headline.target_vocab.path))
    rules = tmp_path / "rules" / "vocab-file.yaml"
    rules.parent.mkdir()
    vocab_file_rule(rule_variant, vocab).rename(rules)
    before = tree_digest(vocab.parent)

    as_vocab = run_cli(*apply_args(rules, headline.sources, vocab.parent, "--force"))
    assert one_error(as_vocab) == (f"error: refusing to write to {str(vocab.parent)!r}: it contains the file "
                                   f"of vocabulary 'k25' ({real(vocab)}); choose an --out outside every input")
    over_rules = run_cli(*apply_args(rules, headline.sources, rules.parent, "--force"))
    assert one_error(over_rules) == (f"error: refusing to write to {str(rules.parent)!r}: it contains the "
                                     f"rule file ({real(rules)}); choose an --out outside every input")
    assert tree_digest(vocab.parent) == before and rules.exists()


def test_force_refuses_a_directory_ckptxform_did_not_write(
        headline: HeadlineStandins, headline_rule: Path, run_cli: Any, tmp_path: Path) -> None:
    out = tmp_path / "notes"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for force in ([], ["--force"]):  # the same refusal: no hint that --force would help
        refused = run_cli(*apply_args(headline_rule, headline.sources, out, *force))
        assert one_error(refused) == (f"error: {str(out)!r} already exists and has no {AUDIT}, so ckptxform "
                                      f"did not write it; {REFUSE_FIX}")
        assert (out / "notes.txt").read_text() == "mine" and sorted(p.name for p in out.iterdir()) == ["notes.txt"]
        assert beside(out) == []


def test_force_refuses_an_earlier_output_holding_a_file_ckptxform_did_not_write(
        headline: HeadlineStandins, headline_rule: Path, run_cli: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    api.apply(headline_rule, out=out, sources=headline.sources, progress=False)
    (out / "notes.txt").write_text("mine")
    (out / "eval").mkdir()
    before = snapshot(out)
    forced = run_cli(*apply_args(headline_rule, headline.sources, out, "--force"))
    assert one_error(forced) == (f"error: {str(out)!r} already exists and holds 'eval', 'notes.txt', "
                                 f"which ckptxform did not write there; {REFUSE_FIX}")
    assert snapshot(out) == before and (out / "eval").is_dir() and beside(out) == []


def test_force_replaces_an_earlier_output_with_copied_files_but_not_a_file_added_among_them(
        tmp_path: Path) -> None:
    from test_files import RULE, make_model

    make_model(tmp_path / "model")
    rules = tmp_path / "rule.yaml"
    skip = "  - {glob: 'original/**', skip: the sentencepiece model is not needed beside tokenizer.json}"
    assert RULE.count(skip) == 1
    rules.write_text(RULE.replace(skip, "  - {glob: 'original/**'}"))  # a copy in a folder of OUT
    out = tmp_path / "out"
    api.apply(rules, out=out, progress=False)
    assert (out / "original" / "tokenizer.model").is_file()
    assert api.apply(rules, out=out, force=True, progress=False).copied  # its own files, folder and all

    (out / "original" / "notes.txt").write_text("mine")
    with pytest.raises(OutputError) as err:
        api.apply(rules, out=out, force=True, progress=False)
    assert str(err.value) == (f"{str(out)!r} already exists and holds 'original/notes.txt', which ckptxform did "
                              f"not write there; {REFUSE_FIX}")
    assert (out / "original" / "notes.txt").read_text() == "mine" and beside(out) == []


@pytest.mark.parametrize("audit, reason", [
    ('{"event": "tensor"}\n', f"has a {AUDIT} that does not start with the run record of ckptxform apply"),
    ('{"event": "run"}\n{"event": "summary", "status": "failed"}\n',
     f"has a {AUDIT} that does not end with the summary of a completed run"),
    ("\x00\x01", f"has a {AUDIT} that does not start with the run record of ckptxform apply"),
])
def test_force_refuses_a_directory_whose_audit_is_not_a_completed_run(
        audit: str, reason: str, headline: HeadlineStandins, headline_rule: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / AUDIT).write_text(audit)
    with pytest.raises(OutputError) as err:
        api.apply(headline_rule, out=out, sources=headline.sources, force=True, progress=False)
    assert str(err.value) == f"{str(out)!r} already exists and {reason}; {REFUSE_FIX}"
    assert (out / AUDIT).read_text() == audit and beside(out) == []


def test_force_refuses_a_file(headline: HeadlineStandins, headline_rule: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.write_text("a file")
    with pytest.raises(OutputError) as err:
        api.apply(headline_rule, out=out, sources=headline.sources, force=True, progress=False)
    assert str(err.value) == f"{str(out)!r} already exists and is not a directory; {REFUSE_FIX}"
    assert out.read_text() == "a file" and beside(out) == []


# ============================================================================ 2. "up to date" is true


def write_vocab_file(path: Path, drafter: Path) -> None:
    """A standalone vocab file holding ``drafter``'s d2t and t2d."""
    tensors = load_file(drafter / "model.safetensors")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"d2t": tensors["d2t"], "t2d": tensors["t2d"]}, path)


def vocab_file_rule(rule_variant: Callable[..., Path], vocab: Path) -> Path:
    return rule_variant({"  k25: {source: target_vocab, encoding: offset}":
                         f"  k25: {{file: '{vocab}', encoding: offset}}"}, name="vocab-file.yaml")


def refused_as(run_cli: Any, rules: Path, sources: dict[str, str], out: Path, *reasons: str) -> None:
    before = snapshot(out)
    refused = run_cli(*apply_args(rules, sources, out))
    assert one_error(refused) == (f"error: {str(out)!r} already exists and was made from {'; '.join(reasons)}; "
                                  "pass --force to replace it")
    assert snapshot(out) == before and beside(out) == []


def forced_then_up_to_date(run_cli: Any, rules: Path, sources: dict[str, str], out: Path) -> None:
    forced = run_cli(*apply_args(rules, sources, out, "--force"))
    assert forced.returncode == 0, forced.stderr
    verify(out)
    again = run_cli(*apply_args(rules, sources, out))
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith(f"{out} is up to date (same plan from the same inputs, verified)")


def test_a_changed_vocab_file_makes_the_output_stale(
        headline: HeadlineStandins, rule_variant: Callable[..., Path], run_cli: Any, tmp_path: Path) -> None:
    vocab = tmp_path / "k25.safetensors"
    write_vocab_file(vocab, Path(headline.target_vocab.path))
    rules = vocab_file_rule(rule_variant, vocab)
    out = tmp_path / "out"
    api.apply(rules, out=out, sources=headline.sources, progress=False)
    d2t_before = load_file(out / "model.safetensors")["d2t"]

    write_vocab_file(vocab, Path(headline.drafter.path))  # another vocabulary, same path
    # the drafter's own vocabulary misses no row: the verifier's lm_head shard is not read now
    refused_as(run_cli, rules, headline.sources, out, f"{real(_lm_head_shard(headline))}, which this run does not read",
               f"an earlier {real(vocab)} (its bytes changed)",
               f"a different plan than {str(rules)!r} now decides")
    forced_then_up_to_date(run_cli, rules, headline.sources, out)
    assert not load_file(out / "model.safetensors")["d2t"].equal(d2t_before)


def _lm_head_shard(headline: HeadlineStandins) -> Path:
    verifier = Path(headline.verifier.path)
    return verifier / json.loads((verifier / "model.safetensors.index.json").read_text())["weight_map"][LM_HEAD]


def test_a_changed_source_config_makes_the_output_stale(
        headline: HeadlineStandins, headline_rule: Path, run_cli: Any, tmp_path: Path) -> None:
    sources = copy_drafter(headline, tmp_path / "drafter")
    out = tmp_path / "out"
    api.apply(headline_rule, out=out, sources=sources, progress=False)
    config = tmp_path / "drafter" / "config.json"
    values = json.loads(config.read_text())
    values["rms_norm_eps"] = values["rms_norm_eps"] * 10
    config.write_text(json.dumps(values))

    refused_as(run_cli, headline_rule, sources, out, f"an earlier {real(config)} (its bytes changed)",
               f"a different plan than {str(headline_rule)!r} now decides")
    forced_then_up_to_date(run_cli, headline_rule, sources, out)
    written = json.loads((out / "config.json").read_text())
    assert written["transformer_layer_config"]["rms_norm_eps"] == values["rms_norm_eps"]


def apply_piped(rules_text: str, sources: dict[str, str], out: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CKPTXFORM_DEBUG"}
    return subprocess.run([sys.executable, "-m", "ckptxform", "apply", "/dev/stdin", *source_args(sources),
                           "--out", str(out)], input=rules_text, capture_output=True, text=True, env=env,
                          timeout=180, check=False)


def test_rules_through_a_pipe_are_hashed_as_read_and_decide_up_to_date(
        headline: HeadlineStandins, headline_rule: Path, tmp_path: Path) -> None:
    text = headline_rule.read_text()
    out = tmp_path / "out"
    first = apply_piped(text, headline.sources, out)
    assert first.returncode == 0, first.stderr
    run = read_audit(out)[0]
    assert run["rules"] == "/dev/stdin"
    assert run["rules_sha256"] == hashlib.sha256(text.encode()).hexdigest() != hashlib.sha256(b"").hexdigest()

    again = apply_piped(text, headline.sources, out)
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith(f"{out} is up to date")

    before = snapshot(out)
    other = apply_piped(text.replace("max_shard_size: 5GB", "max_shard_size: 200KB"), headline.sources, out)
    assert one_error(other) == (f"error: {str(out)!r} already exists and was made from a different plan than "
                                "'/dev/stdin' now decides; pass --force to replace it")
    assert snapshot(out) == before and beside(out) == []


def test_a_comment_added_to_the_rule_file_leaves_the_output_up_to_date(
        headline: HeadlineStandins, headline_rule: Path, run_cli: Any, tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(headline_rule.read_text())
    out = tmp_path / "out"
    api.apply(rules, out=out, sources=headline.sources, progress=False)
    before, dir_mtime = snapshot(out), out.stat().st_mtime_ns

    # every rule moves down two lines: positions change, what the rules ask does not
    rules.write_text("# converted for the K2.5 fine-tune\n\n" + rules.read_text().replace(
        "convert: drafter", "convert: drafter   # the source every tensor comes from"))
    again = run_cli(*apply_args(rules, headline.sources, out))
    assert again.returncode == 0, again.stderr
    assert again.stdout == (f"{out} is up to date (same plan from the same inputs, verified); nothing written\n"
                            f"audit: {out / AUDIT}\n")
    assert snapshot(out) == before and out.stat().st_mtime_ns == dir_mtime and beside(out) == []


def edit_run_record(out: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    lines = (out / AUDIT).read_text().splitlines(keepends=True)
    run = json.loads(lines[0])
    edit(run)
    (out / AUDIT).write_text(json.dumps(run) + "\n" + "".join(lines[1:]))


@pytest.mark.parametrize("edit, reason", [
    # another version records another digest of the same plan and files
    (lambda run: run.update(version="0.0.9", digest="0" * 64), "ckptxform '0.0.9' (this is {version})"),
    (lambda run: [run.pop(k) for k in ("digest", "plan_sha256", "files_read")],
     "inputs its audit does not pin (written by ckptxform '{version}', which recorded no digest of them)"),
], ids=["another ckptxform version", "an audit without a digest"])
def test_an_output_of_another_ckptxform_is_not_up_to_date(
        edit: Callable[[dict[str, Any]], None], reason: str, headline: HeadlineStandins, headline_rule: Path,
        tmp_path: Path) -> None:
    import ckptxform

    out = tmp_path / "out"
    api.apply(headline_rule, out=out, sources=headline.sources, progress=False)
    edit_run_record(out, edit)
    with pytest.raises(OutputError) as err:
        api.apply(headline_rule, out=out, sources=headline.sources, progress=False)
    assert str(err.value) == (f"{str(out)!r} already exists and was made from "
                              f"{reason.format(version=ckptxform.__version__)}; pass --force to replace it")
    assert beside(out) == []


def test_the_run_record_carries_the_digest_of_the_plan_and_every_file_read(
        headline: HeadlineStandins, headline_out: Path) -> None:
    run = read_audit(headline_out)[0]
    read = set(run["files_read"])
    for name in ("drafter", "target_vocab"):
        loc = headline.sources[name]
        assert {str(p.resolve()) for p in Path(loc).glob("*.safetensors")} <= read, loc
    # of the verifier's shards, only the one holding lm_head (its rows fill the missing ones) is read
    shards = {str(p.resolve()) for p in Path(headline.sources["verifier"]).glob("*.safetensors")}
    assert len(shards) > 1 and shards & read == {str(_lm_head_shard(headline).resolve())}
    drafter, verifier = Path(headline.sources["drafter"]).resolve(), Path(headline.sources["verifier"]).resolve()
    assert {str(drafter / "config.json"), str(verifier / "model.safetensors.index.json")} <= read
    stat = (drafter / "model.safetensors").stat()
    assert run["files_read"][str(drafter / "model.safetensors")] == (
        f"size={stat.st_size} mtime_ns={stat.st_mtime_ns} ctime_ns={stat.st_ctime_ns} "
        f"inode={stat.st_dev}:{stat.st_ino}")
    assert len(run["digest"]) == len(run["plan_sha256"]) == 64


# ============================================================================ 3. sources rewritten mid-apply


def rewrite_in_place(path: Path) -> None:
    flip_byte(path, path.stat().st_size - 1)


def rewrite_keeping_mtime(path: Path) -> None:
    stat = path.stat()
    flip_byte(path, stat.st_size - 1)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # what `touch -r` would do; ctime still moves


def replace_by_rename(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.with_name("new").write_bytes(bytes(data))
    os.replace(path.with_name("new"), path)


REWRITES = {"in place": (rewrite_in_place, "it was written to"),
            "in place, mtime set back": (rewrite_keeping_mtime, "it was written to"),
            "replaced by a rename": (replace_by_rename, "it was replaced by another file")}


def after_first_tensor(action: Callable[[], None]) -> Callable[..., None]:
    """A ShardWriter.finish_tensor that runs ``action`` once, after the first tensor is written."""
    original, done = ShardWriter.finish_tensor, []

    def finish(self: ShardWriter, key: str) -> None:
        original(self, key)
        if not done:
            done.append(key)
            action()

    return finish


@pytest.mark.parametrize("how", REWRITES)
def test_a_source_rewritten_during_apply_fails_naming_it_and_leaves_no_output(
        how: str, headline: HeadlineStandins, headline_rule: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    rewrite, moved = REWRITES[how]
    sources = copy_drafter(headline, tmp_path / "drafter")
    weights = tmp_path / "drafter" / "model.safetensors"
    others = tree_digest(*source_dirs(headline.sources)[1:])
    monkeypatch.setattr(ShardWriter, "finish_tensor", after_first_tensor(lambda: rewrite(weights)))
    out = tmp_path / "out"
    with pytest.raises(SourceChangedError) as err:
        api.apply(headline_rule, out=out, sources=sources, progress=False)
    assert str(err.value) == (f"{real(weights)} changed while ckptxform was reading it ({moved}); no output "
                              "was written; rerun once nothing writes to it")
    assert not out.exists() and beside(out) == []
    assert tree_digest(*source_dirs(headline.sources)[1:]) == others


def test_a_source_truncated_during_apply_fails_naming_it_and_leaves_no_output(
        headline: HeadlineStandins, headline_rule: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cut to its header after the first tensor is written: the next read of it fails
    (copies hash the output, never the source again, so the failure is the read's)."""
    sources = copy_drafter(headline, tmp_path / "drafter")
    weights = tmp_path / "drafter" / "model.safetensors"
    header_end = 8 + int.from_bytes(weights.read_bytes()[:8], "little")
    monkeypatch.setattr(ShardWriter, "finish_tensor", after_first_tensor(lambda: os.truncate(weights, header_end)))
    out = tmp_path / "out"
    with pytest.raises(CkptxformError) as err:
        api.apply(headline_rule, out=out, sources=sources, progress=False)
    assert str(weights) in str(err.value) and "truncated" in str(err.value), str(err.value)
    assert len(str(err.value).splitlines()) == 1
    assert not out.exists() and beside(out) == []


def test_a_source_rewritten_during_apply_is_one_line_and_exit_1_from_the_cli(
        headline: HeadlineStandins, headline_rule: Path, tmp_path: Path) -> None:
    """The real command in a subprocess; the only addition is the rewrite, made from inside
    the run after its first tensor (a patched finish_tensor), so that it surely lands mid-run."""
    sources = copy_drafter(headline, tmp_path / "drafter")
    weights = tmp_path / "drafter" / "model.safetensors"
    out = tmp_path / "out"
    script = textwrap.dedent("""
        import sys
        from pathlib import Path
        from ckptxform.cli import main
        from ckptxform.engine.run.writer import ShardWriter
        from test_trust_output import after_first_tensor, rewrite_in_place
        ShardWriter.finish_tensor = after_first_tensor(lambda: rewrite_in_place(Path(sys.argv[1])))
        main(sys.argv[2:], prog_name="ckptxform")
    """)
    env = {k: v for k, v in os.environ.items() if k != "CKPTXFORM_DEBUG"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", script, str(weights), *apply_args(headline_rule, sources, out)],
                          capture_output=True, text=True, env=env, timeout=180, check=False)
    assert one_error(proc) == (f"error: {real(weights)} changed while ckptxform was reading it (it was written "
                               "to); no output was written; rerun once nothing writes to it")
    assert not out.exists() and beside(out) == []


def test_a_weight_file_replaced_between_plan_and_apply_fails_naming_it(
        headline: HeadlineStandins, headline_rule: Path, tmp_path: Path) -> None:
    from ckptxform.engine.run.execute import execute

    sources = copy_drafter(headline, tmp_path / "drafter")
    weights = tmp_path / "drafter" / "model.safetensors"
    plan, opened = api.plan_open(headline_rule, sources=sources)
    try:
        replace_by_rename(weights)
        with pytest.raises(SourceChangedError) as err:
            execute(plan, opened, tmp_path / "out", progress=False)
    finally:
        opened.close()
    assert str(err.value) == (f"{real(weights)} changed while ckptxform was reading it (it was replaced by "
                              "another file); no output was written; rerun once nothing writes to it")
    assert not (tmp_path / "out").exists() and beside(tmp_path / "out") == []


# ============================================================================ 13. SIGTERM


@pytest.fixture(scope="module")
def slow_sources(tmp_path_factory: pytest.TempPathFactory) -> HeadlineStandins:
    """Stand-ins large enough that the write phase can be hit by a signal."""
    return build_headline_standins(tmp_path_factory.mktemp("sigterm-sources"), dims=CRASH_DIMS, seed=7)


def only_resumable_jobs(out: Path) -> bool:
    """Nothing beside OUT but job directories holding finished shards, which a stopped run
    keeps for the rerun to resume (issue 15); no temporary sibling, no lock."""
    return all(".ckptxform-job-" in name and list((out.parent / name).glob("*.record.json")) for name in beside(out))


def terminate_while_writing(args: list[str], out: Path, attempts: int = 10) -> subprocess.CompletedProcess[str]:
    """Run ``ckptxform ARGS`` and send SIGTERM once its temporary sibling exists."""
    env = {k: v for k, v in os.environ.items() if k != "CKPTXFORM_DEBUG"}
    for _ in range(attempts):
        proc = subprocess.Popen([sys.executable, "-m", "ckptxform", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
        seen = wait_for_tmp(proc, out, time.perf_counter())
        if seen is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            stdout, stderr = proc.communicate(timeout=120)
            if proc.returncode != 0:  # 0: it finished before the signal landed; try again
                return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        else:
            proc.communicate(timeout=120)
        if out.exists() and "--force" not in args:
            shutil.rmtree(out)
    pytest.fail("the run was never caught while writing")


def test_sigterm_while_writing_leaves_no_output_no_sibling_and_no_lock(
        slow_sources: HeadlineStandins, headline_rule: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    before = tree_digest(*source_dirs(slow_sources.sources))
    proc = terminate_while_writing(apply_args(headline_rule, slow_sources.sources, out), out)
    assert proc.returncode == 128 + signal.SIGTERM == 143, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == "terminated (SIGTERM)"
    assert not out.exists() and only_resumable_jobs(out)
    assert tree_digest(*source_dirs(slow_sources.sources)) == before


def test_sigterm_during_a_forced_replacement_keeps_the_earlier_output(
        slow_sources: HeadlineStandins, headline_rule: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    api.apply(headline_rule, out=out, sources=slow_sources.sources, progress=False)
    before = output_files(out)  # (a retried attempt that finished rewrote the same bytes, a new audit)
    proc = terminate_while_writing(apply_args(headline_rule, slow_sources.sources, out, "--force"), out)
    assert (proc.returncode, proc.stderr.splitlines()[-1]) == (143, "terminated (SIGTERM)"), proc.stderr
    assert output_files(out) == before and only_resumable_jobs(out)
    verify(out)


@pytest.mark.parametrize("signum, raised", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, SystemExit)])
def test_a_stop_signal_while_an_earlier_output_is_swapped_waits_for_the_swap(
        signum: int, raised: type[BaseException], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The signal lands between moving the earlier OUT aside and renaming the new one in:
    it takes effect once the new OUT is in place and the old content is gone."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_text("old")
    mark_as_earlier_output(out, ["model.safetensors"])
    rename = os.rename

    def signalled_rename(src: Any, dst: Any) -> None:
        rename(src, dst)
        if Path(src) == out:
            os.kill(os.getpid(), signum)  # OUT is aside: the worst moment to stop

    def stop(number: int, _frame: Any) -> None:
        raise raised(number)

    previous = signal.signal(signum, stop)
    try:
        monkeypatch.setattr(os, "rename", signalled_rename)
        with pytest.raises(raised):
            with OutputDir(out, force=True) as odir:
                (odir.tmp_path / "model.safetensors").write_text("new")
                odir.commit()
    finally:
        signal.signal(signum, previous)
    assert (out / "model.safetensors").read_text() == "new"
    assert beside(out) == []


def test_other_names_beside_out_are_not_taken_for_stale_temporaries(tmp_path: Path) -> None:
    """A future resumable job directory (``.NAME.ckptxform-job``) is neither tmp nor old: kept."""
    out = tmp_path / "out"
    job = tmp_path / ".out.ckptxform-job"
    job.mkdir()
    (job / "state.json").write_text("{}")
    with OutputDir(out) as odir:
        (odir.tmp_path / "x").write_text("x")
        odir.commit()
    assert (job / "state.json").read_text() == "{}"
    assert beside(out) == [".out.ckptxform-job"]
