"""Reliability and security of ``apply`` and ``verify`` as a user runs them (issue 7).

Every case runs the real command in a subprocess on real stand-in checkpoints:
idempotent reruns and the reasons a rerun is refused, two concurrent runs, ``verify`` on
damaged outputs, a file-size limit and a full disk, Hub faults during a run, a token
that must never be shown, output keys that cannot be written, and a pickled
``pytorch_model.bin`` that must not run. Hostile safetensors headers, indexes and YAML
are covered by test_sources_local.py, test_safetensors_header_fuzz.py,
test_rules_loader.py and test_rules_fuzz.py; the writer's own lock and I/O errors by
test_writer.py; Hub retries at the source level by test_hub.py.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, assert_clean_failure, error_lines, read_audit, recorded, reference_digest, source_args
from hub_fixtures import ClientRun, ProxyTrap, client_env, run_client, tensor_span
from hubserver import HubServer
from safetensors.torch import load_file

from ckptxform.rules.loader import load_rules
from ckptxform.standins import HeadlineStandins
from ckptxform.errors import VerifyError
from ckptxform.engine.output.verify import verify

AUDIT = "ckptxform_audit.jsonl"


def apply_args(rule: Path, sources: dict[str, str], out: Path, *extra: str) -> list[str]:
    return ["apply", str(rule), *source_args(sources), "--out", str(out), *extra]


def beside(out: Path) -> list[str]:
    """What ckptxform left beside OUT: temporary siblings, lock file."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.ckptxform-"))


def snapshot(directory: Path) -> dict[str, tuple[int, bytes]]:
    """name -> (mtime_ns, bytes) of every file under ``directory``."""
    return {str(p.relative_to(directory)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(directory.rglob("*")) if p.is_file()}


def tree_digest(*roots: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for root in roots for p in sorted(root.rglob("*")) if p.is_file()}


def flip_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def blake3_of(path: Path, offset: int = 0, length: int | None = None) -> str:
    data = path.read_bytes()
    return reference_digest("blake3", data[offset:] if length is None else data[offset:offset + length])


def one_error(proc: subprocess.CompletedProcess[str] | ClientRun, code: int = 1) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    [line] = error_lines(proc.stderr)
    return line


def copy_drafter(headline: HeadlineStandins, dest: Path) -> dict[str, str]:
    """The headline sources with the drafter replaced by a private copy a test may change."""
    shutil.copytree(headline.drafter.path, dest)
    return {**headline.sources, "drafter": str(dest)}


# ============================================================================ idempotent reruns


def test_a_rerun_of_the_same_conversion_is_up_to_date_and_writes_nothing(
        headline: HeadlineStandins, headline_rule: Path, run_cli: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = run_cli(*apply_args(headline_rule, headline.sources, out))
    assert first.returncode == 0, first.stderr
    before, dir_mtime = snapshot(out), out.stat().st_mtime_ns

    again = run_cli(*apply_args(headline_rule, headline.sources, out))
    assert again.returncode == 0, again.stderr
    assert again.stdout == (f"{out} is up to date (same plan from the same inputs, verified); nothing written\n"
                            f"audit: {out / AUDIT}\n")
    as_json = run_cli(*apply_args(headline_rule, headline.sources, out, "--json"))
    assert as_json.returncode == 0, as_json.stderr
    result = json.loads(as_json.stdout)
    assert (result["status"], result["bytes_written"]) == ("up_to_date", 0)
    assert [recorded(w) for w in result["written"]] == [recorded(e) for e in read_audit(out)
                                                       if e["event"] == "written"]
    # not a byte written, not even a file touched, nothing left beside it
    assert snapshot(out) == before and out.stat().st_mtime_ns == dir_mtime
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@dataclass(frozen=True)
class Change:
    """Something that makes an existing OUT not this run's conversion."""

    make: Callable[[Path, dict[str, str], Path], Path]  # (out, sources, tmp_path) -> rules of the rerun
    reason: Callable[[Path, dict[str, str], Path], str]  # the refusal's reason, after "already exists and "


def _other_rules(out: Path, sources: dict[str, str], tmp: Path) -> Path:
    text = (REPO / "rules" / "aqmedai_k2_to_k25.yaml").read_text()
    old = "max_shard_size: 5GB"
    assert text.count(old) == 1
    path = tmp / "variant.yaml"
    path.write_text(text.replace(old, "max_shard_size: 200KB"))
    return path


def _other_rules_reason(out: Path, sources: dict[str, str], tmp: Path) -> str:
    return f"was made from a different plan than {str(tmp / 'variant.yaml')!r} now decides"


def _touch_drafter(out: Path, sources: dict[str, str], tmp: Path) -> Path:
    weights = Path(sources["drafter"]) / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    return REPO / "rules" / "aqmedai_k2_to_k25.yaml"


def _rewrite_drafter(out: Path, sources: dict[str, str], tmp: Path) -> Path:
    weights = Path(sources["drafter"]) / "model.safetensors"
    offset, _ = tensor_span(weights, "fc.weight")
    flip_byte(weights, offset)
    return REPO / "rules" / "aqmedai_k2_to_k25.yaml"


def _drafter_reason(out: Path, sources: dict[str, str], tmp: Path) -> str:
    weights = (Path(sources["drafter"]) / "model.safetensors").resolve()
    return f"was made from an earlier {str(weights)!r} (its bytes changed)"


def _flip_output(out: Path, sources: dict[str, str], tmp: Path) -> Path:
    offset, _ = tensor_span(out / "model.safetensors", "norm.weight")
    flip_byte(out / "model.safetensors", offset)
    return REPO / "rules" / "aqmedai_k2_to_k25.yaml"


def _flip_output_reason(out: Path, sources: dict[str, str], tmp: Path) -> str:
    weights = out / "model.safetensors"
    offset, nbytes = tensor_span(weights, "norm.weight")
    [digest] = [recorded(e) for e in read_audit(out) if e["event"] == "written" and e["key"] == "norm.weight"]
    return (f"does not verify: {weights}: tensor 'norm.weight': blake3 {blake3_of(weights, offset, nbytes)[:12]}... "
            f"differs from the audit's {digest[:12]}...; its bytes were changed after apply")


CHANGES = {
    "rules with another shard size": Change(_other_rules, _other_rules_reason),
    "source weight file rewritten": Change(_rewrite_drafter, _drafter_reason),
    "output tensor changed": Change(_flip_output, _flip_output_reason),
}
# An OUT without an audit log is refused with --force too: tests/test_trust_output.py.


def test_a_touched_source_weight_file_leaves_the_output_up_to_date(
        headline: HeadlineStandins, headline_rule: Path, run_cli: Any, tmp_path: Path) -> None:
    """A touch changes no byte: reruns are keyed on content (issue 35 item 6)."""
    from ckptxform import api

    sources = copy_drafter(headline, tmp_path / "drafter")
    out = tmp_path / "out"
    api.apply(headline_rule, out=out, sources=sources, progress=False)
    rules = _touch_drafter(out, sources, tmp_path)
    before = snapshot(out)
    again = run_cli(*apply_args(rules, sources, out))
    assert again.returncode == 0 and f"{out} is up to date" in again.stdout, again.stderr
    assert snapshot(out) == before and beside(out) == []


@pytest.mark.parametrize("name", CHANGES)
def test_anything_else_is_refused_without_force_saying_why_and_rewritten_with_force(
        name: str, headline: HeadlineStandins, headline_rule: Path, run_cli: Any, tmp_path: Path) -> None:
    from ckptxform import api

    change = CHANGES[name]
    sources = copy_drafter(headline, tmp_path / "drafter")
    out = tmp_path / "out"
    api.apply(headline_rule, out=out, sources=sources, progress=False)
    rules = change.make(out, sources, tmp_path)
    reason = change.reason(out, sources, tmp_path)
    before = snapshot(out)

    refused = run_cli(*apply_args(rules, sources, out))
    assert one_error(refused) == f"error: '{out}' already exists and {reason}; pass --force to replace it"
    assert snapshot(out) == before and beside(out) == []

    forced = run_cli(*apply_args(rules, sources, out, "--force"))
    assert forced.returncode == 0, forced.stderr
    assert forced.stdout.splitlines()[-2].startswith(f"wrote {out}: ")
    verify(out)
    assert read_audit(out)[0]["rules_sha256"] == load_rules(rules).sha256
    assert beside(out) == []
    # and now it is this run's conversion: a rerun would have nothing to do
    assert api.apply(rules, out=out, sources=sources, progress=False).up_to_date


# ============================================================================ concurrent runs


def freeze_once_writing(proc: subprocess.Popen[str], out: Path) -> bool:
    """SIGSTOP ``proc`` as soon as it holds OUT's lock (its pid is in the lock file) and has
    created its temporary output; False if it exited first."""
    lock, tmp = out.with_name(f".{out.name}.ckptxform-lock"), out.with_name(f".{out.name}.ckptxform-tmp-{proc.pid}")
    while proc.poll() is None:
        try:
            if tmp.is_dir() and lock.read_text() == f"{proc.pid}\n":
                os.kill(proc.pid, signal.SIGSTOP)
                return True
        except FileNotFoundError:
            pass
        time.sleep(0.0002)
    return False


def test_a_second_apply_to_the_same_out_is_refused_while_the_first_holds_the_lock(
        headline: HeadlineStandins, headline_rule: Path, run_cli: Any, tmp_path: Path) -> None:
    """The first run is frozen (SIGSTOP) the moment it holds the lock, so the second surely
    starts while the lock is held; then it is resumed and must complete."""
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "CKPTXFORM_DEBUG"}
    command = [sys.executable, "-m", "ckptxform", *apply_args(headline_rule, headline.sources, out)]
    second = None
    for _attempt in range(10):  # a first run may finish before it is seen holding the lock
        shutil.rmtree(out, ignore_errors=True)
        first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            if freeze_once_writing(first, out):
                second = run_cli(*apply_args(headline_rule, headline.sources, out))
                # the refused run left the first one's temporary output alone
                kept = (tmp_path / f".out.ckptxform-tmp-{first.pid}").is_dir()
        finally:
            if first.poll() is None:
                os.kill(first.pid, signal.SIGCONT)
            stdout, stderr = first.communicate(timeout=120)
        if second is not None:
            break
    else:
        pytest.fail("the first run was never seen holding the lock")

    assert one_error(second) == (f"error: another ckptxform apply is writing to '{out}' (lock held by pid "
                                 f"{first.pid}); wait for it or choose another --out")
    assert kept
    assert first.returncode == 0, stderr
    assert stdout.splitlines()[-2].startswith(f"wrote {out}: ")
    assert run_cli("verify", out).returncode == 0
    assert beside(out) == []


# ============================================================================ verify


def _sharded_out(headline: HeadlineStandins, rule_variant: Callable[..., Path], out: Path) -> Path:
    from ckptxform import api

    rule = rule_variant({"  max_shard_size: 5GB": "  max_shard_size: 200KB"}, name="sharded.yaml")
    api.apply(rule, out=out, sources=headline.sources, progress=False)
    assert (out / "model.safetensors.index.json").exists()
    return out


def _written(out: Path) -> dict[str, dict[str, Any]]:
    return {e["key"]: e for e in read_audit(out) if e["event"] == "written"}


def test_verify_passes_on_an_untouched_output(headline_out: Path, run_cli: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(headline_out, out)
    proc = run_cli("verify", out)
    assert proc.returncode == 0, proc.stderr
    summary = read_audit(out)[-1]
    assert proc.stdout == f"{out}: {len(_written(out))} tensors verified ({summary['bytes_written']:,} bytes)\n"


def test_verify_names_the_tensor_whose_byte_was_flipped(headline_out: Path, run_cli: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(headline_out, out)
    weights = out / "model.safetensors"
    offset, nbytes = tensor_span(weights, "lm_head.weight")
    flip_byte(weights, offset + nbytes // 2)
    digest = recorded(_written(out)["lm_head.weight"])
    proc = run_cli("verify", out)
    assert one_error(proc) == (
        f"error: {weights}: tensor 'lm_head.weight': blake3 {blake3_of(weights, offset, nbytes)[:12]}... differs "
        f"from the audit's {digest[:12]}...; its bytes were changed after apply")


def test_verify_reports_a_weight_file_cut_short_while_it_is_hashed(headline_out: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The header still lists the tensor, the read comes back empty (the file shrank in
    between): one problem naming the tensor, not a hang or a traceback."""
    import ckptxform.engine.output.verify as verify_module

    out = tmp_path / "out"
    shutil.copytree(headline_out, out)
    real_preadv = os.preadv

    def preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        return 0 if os.readlink(f"/proc/self/fd/{fd}").endswith("model.safetensors") else real_preadv(fd, buffers, offset)

    monkeypatch.setattr(verify_module.os, "preadv", preadv)
    with pytest.raises(VerifyError) as caught:
        verify(out)
    lines = str(caught.value).splitlines()
    assert len(lines) == len(_written(out))  # one per tensor of the file, each naming it
    offset, _ = tensor_span(out / "model.safetensors", "lm_head.weight")
    assert (f"{out / 'model.safetensors'}: tensor 'lm_head.weight': cannot read: the file ends at byte {offset}, "
            "inside the tensor") in lines


def test_verify_refuses_to_hash_a_weight_file_replaced_after_its_header_was_read(headline_out: Path) -> None:
    """Headers are read through one descriptor, bytes hashed through others: a file
    replaced in between would pair one file's header with another's bytes."""
    from ckptxform.engine.output.verify import _digest

    weights = headline_out / "model.safetensors"
    stat = weights.stat()
    assert _digest(weights, (stat.st_dev, stat.st_ino), 0, 64, "blake3") == blake3_of(weights, 0, 64)
    with pytest.raises(OSError, match="replaced while verify read it"):
        _digest(weights, (stat.st_dev, stat.st_ino + 1), 0, 64, "blake3")


def test_verify_reports_a_deleted_shard_once_with_its_tensors(
        headline: HeadlineStandins, rule_variant: Callable[..., Path], run_cli: Any, tmp_path: Path) -> None:
    out = _sharded_out(headline, rule_variant, tmp_path / "out")
    written = _written(out)
    shard = sorted({e["file"] for e in written.values()})[1]
    lost = sorted(k for k, e in written.items() if e["file"] == shard)
    assert len(lost) > 1
    (out / shard).unlink()
    proc = run_cli("verify", out)
    shown = ", ".join(map(repr, lost[:3])) + (f" and {len(lost) - 3} more" if len(lost) > 3 else "")
    assert one_error(proc) == (f"error: {out / shard}: No such file or directory; the output is incomplete: the "
                               f"audit puts {len(lost)} tensor(s) there ({shown})")


def test_verify_reports_a_modified_index(headline: HeadlineStandins, rule_variant: Callable[..., Path],
                                         run_cli: Any, tmp_path: Path) -> None:
    out = _sharded_out(headline, rule_variant, tmp_path / "out")
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    files = sorted(set(index["weight_map"].values()))
    key = min(index["weight_map"])
    index["weight_map"][key] = next(f for f in files if f != index["weight_map"][key])
    index_path.write_text(json.dumps(index))
    proc = run_cli("verify", out)
    assert one_error(proc) == f"error: {index_path}: weight_map disagrees with the audit for 1 key(s), e.g. {key!r}"

    index_path.unlink()
    proc = run_cli("verify", out)
    assert one_error(proc) == f"error: {index_path}: missing; the output has {len(files)} shards"


def test_verify_reports_a_modified_config(headline_out: Path, run_cli: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(headline_out, out)
    config = json.loads((out / "config.json").read_text())
    config["draft_vocab_size"] += 1
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    proc = run_cli("verify", out)
    assert one_error(proc) == f"error: {out / 'config.json'}: changed after apply (sha256 differs from the audit)"


def _no_audit(audit: Path) -> str:
    audit.unlink()
    return f"error: {audit}: no audit log; '{audit.parent}' was not written by ckptxform apply"


def _no_summary(audit: Path) -> str:
    audit.write_text("".join(audit.read_text().splitlines(keepends=True)[:-1]))
    return (f"error: {audit}: the audit log has no successful summary; the run that wrote it did not finish: "
            "rerun apply with --force")


def _cut_mid_line(audit: Path) -> str:
    lines = audit.read_text().splitlines(keepends=True)
    audit.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    try:
        json.loads(lines[-1][: len(lines[-1]) // 2])
    except json.JSONDecodeError as err:
        msg = err.msg
    return f"error: {audit}:{len(lines)}: not JSON ({msg}); the audit log is damaged"


def _escaping_file(audit: Path) -> str:
    lines = audit.read_text().splitlines(keepends=True)
    number, event = next((i, json.loads(line)) for i, line in enumerate(lines, 1) if '"written"' in line)
    event["file"] = "../../outside.safetensors"
    lines[number - 1] = json.dumps(event) + "\n"
    audit.write_text("".join(lines))
    return (f"error: {audit}:{number}: a 'written' event needs key, file (a plain file name), shape, dtype, "
            "its digest (blake3 or sha256) and from; the audit log is damaged")


AUDIT_DAMAGE = {"deleted": _no_audit, "no summary": _no_summary, "cut mid-line": _cut_mid_line,
                "file outside OUT": _escaping_file}


@pytest.mark.parametrize("damage", AUDIT_DAMAGE)
def test_verify_reports_a_missing_or_damaged_audit_log(damage: str, headline_out: Path, run_cli: Any,
                                                      tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(headline_out, out)
    expected = AUDIT_DAMAGE[damage](out / AUDIT)
    assert one_error(run_cli("verify", out)) == expected


# ============================================================================ full disk, file-size limit


def test_file_size_limit_through_the_cli_is_one_clean_error_and_leaves_nothing(
        headline: HeadlineStandins, headline_rule: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    sources_before = tree_digest(*(Path(p) for p in headline.sources.values()))
    limit = 64 << 10  # the audit's first records fit, the 0.6 MB weight file does not

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = {k: v for k, v in os.environ.items() if k != "CKPTXFORM_DEBUG"}
    proc = subprocess.run([sys.executable, "-m", "ckptxform", *apply_args(headline_rule, headline.sources, out)],
                          capture_output=True, text=True, timeout=120, env=env, preexec_fn=limit_file_size,
                          check=False)
    assert one_error(proc) == (f"error: writing '{out}/model.safetensors' failed: File too large; raise the file "
                               "size limit (ulimit -f) or set a smaller output.max_shard_size")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no OUT, no temporary sibling, no lock
    assert tree_digest(*(Path(p) for p in headline.sources.values())) == sources_before


def test_full_disk_through_the_cli_is_one_clean_error_and_leaves_nothing(
        headline: HeadlineStandins, headline_rule: Path, tmp_path: Path) -> None:
    """OUT on a 256 KiB tmpfs (a private mount namespace): the audit fits, the 0.6 MB
    weight file does not, so the run fails in the middle of writing it."""
    if not shutil.which("unshare"):
        pytest.skip("needs unshare to mount a small tmpfs")
    mnt = tmp_path / "small"
    mnt.mkdir()
    sources_before = tree_digest(*(Path(p) for p in headline.sources.values()))
    shell = ('mount -t tmpfs -o size=256k tmpfs "$1" || exit 99; shift; "$@"; rc=$?; '
             'echo "left: $(ls -A "$0")"; exit $rc')
    args = apply_args(headline_rule, headline.sources, mnt / "out")
    env = {k: v for k, v in os.environ.items() if k != "CKPTXFORM_DEBUG"}
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", shell,
                           str(mnt), str(mnt), sys.executable, "-m", "ckptxform", *args],
                          capture_output=True, text=True, timeout=120, env=env, check=False)
    if proc.returncode == 99 or "unshare:" in proc.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    assert one_error(proc) == (f"error: writing '{mnt}/out/model.safetensors' failed: No space left on device; "
                               "free space or choose another --out")
    assert proc.stdout.splitlines()[-1] == "left: "  # no OUT, no temporary sibling, no lock
    assert tree_digest(*(Path(p) for p in headline.sources.values())) == sources_before


# ============================================================================ Hub faults and secrets

REPOS = {"drafter": "ORG/D", "target_vocab": "ORG/T", "verifier": "ORG/V"}
GATED = "ORG/G"
#: the token of every Hub run here, and the key to the gated copy of the drafter
SENTINEL = "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42"

#: the real command, with huggingface retries at 10 ms instead of 1-8 s (the only change)
FAST_CLI = """
import ckptxform.sources.hub.checkpoint as hub
hub.open_hub.__kwdefaults__["retry"] = FAST
from ckptxform.cli import main
main(ARGS, prog_name="ckptxform")
"""


@dataclass
class Hub:
    server: HubServer
    trap: ProxyTrap
    shard: str  # the verifier shard holding language_model.lm_head.weight

    def env(self, home: Path, **extra: str) -> dict[str, str]:
        env = client_env(self.server, home, self.trap, HF_TOKEN=SENTINEL, NO_COLOR="1", **extra)
        env.pop("CKPTXFORM_DEBUG", None)
        return env

    def cli(self, env: dict[str, str], *args: str | Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ckptxform", *map(str, args)], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=120, check=False)

    def fast_cli(self, env: dict[str, str], *args: str | Path) -> ClientRun:
        return run_client(FAST_CLI.replace("ARGS", repr([str(a) for a in args])), env)


def hub_sources(**override: str) -> list[str]:
    locations = {name: f"{repo}@main" for name, repo in REPOS.items()} | override
    return [a for name, loc in locations.items() for a in ("--source", f"{name}={loc}")]


@pytest.fixture(scope="module")
def hub(headline: HeadlineStandins) -> Iterator[Hub]:
    folders = {REPOS["drafter"]: headline.drafter.path, REPOS["target_vocab"]: headline.target_vocab.path,
               REPOS["verifier"]: headline.verifier.path}
    index = json.loads((headline.verifier.path / "model.safetensors.index.json").read_text())
    trap = ProxyTrap()
    with HubServer() as server:
        for repo, folder in folders.items():
            server.add_repo(repo, folder)
        server.add_repo(GATED, headline.drafter.path, gated_token=SENTINEL)
        yield Hub(server, trap, index["weight_map"]["language_model.lm_head.weight"])
    trap.close()


@pytest.fixture
def fresh_hub(hub: Hub) -> Iterator[Hub]:
    hub.server.clear_faults()
    hub.server.clear_log()
    hub.trap.lines.clear()
    yield hub
    hub.server.clear_faults()
    assert hub.trap.lines == [], "a request left 127.0.0.1"


def assert_no_secret(*texts: str) -> None:
    for text in texts:
        assert SENTINEL not in text
        assert SENTINEL[3:15] not in text  # nor a recognisable part of it


def test_persistent_5xx_on_the_verifier_during_apply_fails_cleanly_with_no_output(
        fresh_hub: Hub, headline_rule: Path, tmp_path: Path) -> None:
    hub = fresh_hub
    env = hub.env(tmp_path / "home")
    # plan first: the headers are cached, so apply gets past planning and starts writing
    # before its first read of the verifier's rows fails
    planned = hub.cli(env, "plan", headline_rule, *hub_sources())
    assert planned.returncode == 0, planned.stderr
    hub.server.clear_log()
    hub.server.fail(f"/{REPOS['verifier']}/resolve/*/{hub.shard}", status=500, times=10_000, method="GET")
    out = tmp_path / "out"
    proc = hub.fast_cli(env, "apply", headline_rule, *hub_sources(), "--out", out)
    assert one_error(proc) == (
        f"error: source 'verifier' (Hub repo {REPOS['verifier']}@main): could not read file '{hub.shard}' after 5 "
        f"tries (last: HTTP 500); check the network and HF_ENDPOINT ({hub.server.endpoint}) and rerun")
    failed = [r for r in hub.server.log if r.fault == "status 500"]
    assert len(failed) >= 5  # each row request tried 5 times
    assert all(r.range is not None and not r.range.startswith("bytes=0-") for r in failed)  # rows, not headers
    # the rows are fetched once OUT's temporary sibling and audit exist: both are gone
    assert not out.exists() and beside(out) == []
    assert_no_secret(proc.stdout, proc.stderr)


def test_connection_resets_mid_transfer_are_retried_and_the_output_is_correct(
        fresh_hub: Hub, headline_rule: Path, headline_out: Path, tmp_path: Path) -> None:
    hub = fresh_hub
    env = hub.env(tmp_path / "home")
    planned = hub.cli(env, "plan", headline_rule, *hub_sources())
    assert planned.returncode == 0, planned.stderr
    hub.server.clear_log()
    # the drafter's whole-file download and the verifier's row read, each cut once
    hub.server.reset(f"/{REPOS['drafter']}/resolve/*/model.safetensors", after_bytes=4096)
    hub.server.reset(f"/{REPOS['verifier']}/resolve/*/{hub.shard}", after_bytes=100)
    out = tmp_path / "out"
    proc = hub.fast_cli(env, "apply", headline_rule, *hub_sources(), "--out", out)
    assert proc.returncode == 0, proc.stderr
    resets = sorted(r.path.rsplit("/", 1)[1] for r in hub.server.log if r.fault and r.fault.startswith("reset"))
    assert resets == sorted(["model.safetensors", hub.shard])
    assert (out / "model.safetensors").read_bytes() == (headline_out / "model.safetensors").read_bytes()
    assert hub.cli(env, "verify", out).returncode == 0
    assert beside(out) == []
    assert_no_secret(proc.stdout, proc.stderr, (out / AUDIT).read_text())


def test_the_token_never_appears_in_output_logs_errors_or_the_audit(
        fresh_hub: Hub, headline: HeadlineStandins, headline_rule: Path, headline_out: Path,
        tmp_path: Path) -> None:
    hub = fresh_hub
    env = hub.env(tmp_path / "home")
    # the drafter from a repo gated by the token itself: the run works only if it is sent
    sources = hub_sources(drafter=f"{GATED}@main")
    planned = hub.cli(env, "-v", "plan", headline_rule, *sources, "--json")
    assert planned.returncode == 0, planned.stderr
    assert json.loads(planned.stdout)["sources"]["drafter"]["location"] == f"{GATED}@main"
    out = tmp_path / "out"
    applied = hub.cli(env, "-v", "apply", headline_rule, *sources, "--out", out, "--json")
    assert applied.returncode == 0, applied.stderr
    assert (out / "model.safetensors").read_bytes() == (headline_out / "model.safetensors").read_bytes()
    sent = [r for r in hub.server.log if r.path.startswith(f"/{GATED}/resolve/")]
    # the token was used on the Hub, so its absence means something; never on the CDN
    assert [r for r in sent if r.host == "hub"] and all(r.authorized == (r.host == "hub") for r in sent)
    # a failure with the token set: a repo gated by another token refuses it
    hub.server.add_repo("ORG/OTHER", headline.drafter.path, gated_token="hf_someoneElsesToken")
    refused = hub.cli(env, "-v", "apply", headline_rule, *hub_sources(drafter="ORG/OTHER@main"),
                      "--out", tmp_path / "refused")
    assert "the repo is gated and the token has no access to it" in one_error(refused)
    assert_no_secret(planned.stdout, planned.stderr, applied.stdout, applied.stderr,
                     *(p.read_text() for p in out.iterdir() if p.suffix in (".json", ".jsonl")),
                     refused.stdout, refused.stderr)


# ============================================================================ output keys


@dataclass(frozen=True)
class KeyCase:
    """A one-place edit of the headline rule and the exact stderr it must cause. ``at``
    names the lines the message cites: placeholder -> text of that line (in the edited
    file), so that the expectation does not hard-code the shipped rule's line numbers."""

    old: str
    new: str
    exit_code: int
    message: str
    at: dict[str, str]

    def rule(self, headline_rule: Path, directory: Path) -> Path:
        text = headline_rule.read_text()
        assert text.count(self.old) == 1, self.old
        path = directory / "keys.yaml"
        path.write_text(text.replace(self.old, self.new))
        return path

    def expected(self, rule: Path) -> str:
        lines = rule.read_text().splitlines()
        numbers = {name: 1 + next(i for i, line in enumerate(lines) if line.startswith(start))
                   for name, start in self.at.items()}
        return self.message.format(rule=rule, **numbers)


KEEP = "  - match: 'fc\\.weight|norm\\.weight'\n"
FIX = "change the rule's rename (or the add entry's name) so that it writes another key"
KEY_CASES = {
    "two tensors to one key (found by plan)": KeyCase(
        "    rename: 'layers.0.\\1'\n", "    rename: 'layers.0'\n", 1,
        ("error: tensors[0] ({rule}:{m}) (from drafter:midlayer.input_layernorm.weight) and tensors[0] ({rule}:{m}) "
         "(from drafter:midlayer.hidden_norm.weight) both write output key 'layers.0'; two tensors cannot be "
         "written to one key: rename one of them"),
        {"m": "  - match: 'midlayer"}),
    "two rules to one key (found by validate)": KeyCase(
        KEEP, "  - match: 'fc\\.weight'\n    rename: norm.weight\n  - match: 'norm\\.weight'\n", 2,
        ("{rule}:{n}:12: tensors[2].match: produces output key 'norm.weight', already produced by tensors[1] "
         "({rule}:{f}); two tensors cannot be written to one key"),
        {"f": "  - match: 'fc", "n": "  - match: 'norm"}),
    "an add over a renamed tensor": KeyCase(
        "  t2d: {vocab: k25, field: t2d}\n", "  fc.weight: {vocab: k25, field: t2d}\n", 1,
        ("error: add.fc.weight ({rule}:{a}) and tensors[1] ({rule}:{f}) (from drafter:fc.weight) both write output "
         "key 'fc.weight'; two tensors cannot be written to one key: rename one of them"),
        {"a": "  fc.weight:", "f": "  - match: 'fc"}),
    "__metadata__": KeyCase(
        KEEP, KEEP + "    rename: __metadata__\n", 1,
        ("error: tensors[1] ({rule}:{f}) (from drafter:fc.weight): output key '__metadata__' is not a valid tensor "
         f"name: safetensors reserves '__metadata__' for the file's metadata; {FIX}"),
        {"f": "  - match: 'fc"}),
    "empty": KeyCase(
        KEEP, "  - match: 'fc\\.weight(.*)|norm\\.weight'\n    rename: '\\1'\n", 1,
        ("error: tensors[1] ({rule}:{f}) (from drafter:fc.weight): output key '' is not a valid tensor name: it is "
         f"empty; {FIX}"),
        {"f": "  - match: 'fc"}),
    "control character": KeyCase(
        KEEP, "  - match: '(fc)\\.weight|norm\\.weight'\n    rename: \"\\\\1\\tweight\"\n", 1,
        ("error: tensors[1] ({rule}:{f}) (from drafter:fc.weight): output key 'fc\\tweight' is not a valid tensor "
         f"name: it contains a control character; {FIX}"),
        {"f": "  - match: '(fc)"}),
    "a weight file name escaping OUT": KeyCase(
        "  max_shard_size: 5GB\n", "  max_shard_size: 5GB\n  file_name: ../escaped.safetensors\n", 2,
        "{rule}:{o}:14: output.file_name: '../escaped.safetensors' is not of the form ^[A-Za-z0-9_.-]+\\.(safetensors|gguf)$",
        {"o": "  file_name:"}),
}


@pytest.mark.parametrize("case", KEY_CASES)
def test_output_keys_that_collide_or_cannot_be_written_are_refused_before_any_output(
        case: str, headline: HeadlineStandins, headline_rule: Path, run_cli: Any, tmp_path: Path) -> None:
    rule = KEY_CASES[case].rule(headline_rule, tmp_path)
    proc = run_cli(*apply_args(rule, headline.sources, tmp_path / "out"))
    assert_clean_failure(proc, KEY_CASES[case].exit_code)
    assert proc.stderr.splitlines() == [KEY_CASES[case].expected(rule)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keys.yaml"]  # no OUT, no sibling, no lock


# ============================================================================ pickled code


class WritesMarker:
    """Unpickling this runs ``exec`` and writes a file: what a malicious .bin does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (builtins.exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))


def test_a_pytorch_model_bin_with_pickled_code_is_refused_by_apply_and_never_run(
        headline: HeadlineStandins, headline_rule: Path, run_cli: Any, tmp_path: Path) -> None:
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    shutil.copy(headline.drafter.path / "config.json", drafter / "config.json")
    marker = tmp_path / "marker"
    tensors: dict[str, Any] = load_file(str(headline.drafter.path / "model.safetensors"))
    torch.save({**tensors, "payload": WritesMarker(marker)}, drafter / "pytorch_model.bin")
    out = tmp_path / "out"
    proc = run_cli(*apply_args(headline_rule, {**headline.sources, "drafter": str(drafter)}, out))
    assert one_error(proc) == (
        f"error: {drafter / 'pytorch_model.bin'}: the pickle names '__builtin__.exec', which a torch.save'd state "
        "dict never holds; refusing to load it (a pickle's globals can run code): re-save it as safetensors from a "
        "trusted environment (torch.load there, then safetensors.torch.save_file)")
    assert not marker.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]
    # guard: the same file does run code when loaded unsafely, so the refusal is what saved us
    torch.load(drafter / "pytorch_model.bin", weights_only=False)
    assert marker.read_text() == "pwned"
