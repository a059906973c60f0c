"""Issue 28's shard guarantees of the MTP rules on local verifiers: ``mtp_extract`` opens
only the shards holding ``mtp.*`` (the others are listed from the index, never opened), and
``mtp_graft`` keeps the verifier's shard files (``output.shards.like``), rewriting only
the shard holding the MTP layer.

Which files a run opens is measured with a Python audit hook (``sys.addaudithook``: every
``open()`` and ``os.open`` raises an ``open`` event) in a fresh interpreter; a control
read in the same process shows the hook sees a header read of a main-stack shard.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, read_audit, read_output, same_bits

from ckptxform import api
from ckptxform.engine.output.verify import verify
from ckptxform.standins.mtp import build_qwen3_next_verifier

RULES = REPO / "rules"
EXTRACT = RULES / "mtp_extract.yaml"
GRAFT = RULES / "mtp_graft.yaml"

#: apply RULE with SOURCES to OUT, then the control: read one main-stack shard's header;
#: print every path opened during each part
_OPENS_SCRIPT = textwrap.dedent("""
    import json, os, sys
    opened = []
    def hook(event, args):
        if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            opened.append(os.fsdecode(args[0]))
    sys.addaudithook(hook)
    from ckptxform import api
    from ckptxform.sources.local import open_local
    rule, sources, out, control = json.loads(sys.argv[1])
    api.apply(rule, out=out, sources=sources, progress=False)
    during_apply = list(opened)
    with open_local(sources["verifier"]) as ckpt:
        ckpt.tensors_of_file(control)
    print(json.dumps({"apply": during_apply, "control": opened[len(during_apply):]}))
""")


def _opened_by_apply(rule: Path, sources: dict[str, str], out: Path, control: str) -> dict[str, set[str]]:
    proc = subprocess.run([sys.executable, "-c", _OPENS_SCRIPT, json.dumps([str(rule), sources, str(out), control])],
                          capture_output=True, text=True, timeout=300, cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    return {part: {Path(p).resolve().name for p in paths if Path(p).suffix == ".safetensors"}
            for part, paths in report.items()}


def _weight_map(folder: Path) -> dict[str, str]:
    return dict(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"])


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("mtp_shard_alone", [False, True])
def test_mtp_extract_opens_only_the_shards_holding_mtp_tensors(tmp_path: Path, mtp_shard_alone: bool) -> None:
    verifier = build_qwen3_next_verifier(tmp_path / "Qwen3-Next", seed=11, num_shards=6,
                                         mtp_shard_alone=mtp_shard_alone).path
    weight_map = _weight_map(verifier)
    mtp_files = {f for k, f in weight_map.items() if k.startswith("mtp.")}
    main_files = set(weight_map.values()) - mtp_files
    assert len(mtp_files) == 1 and len(main_files) == 5
    opened = _opened_by_apply(EXTRACT, {"verifier": str(verifier)}, tmp_path / "drafter", min(main_files))
    assert opened["apply"] & {f for f in weight_map.values()} == mtp_files
    assert opened["control"] == {min(main_files)}  # the hook sees a header read when there is one

    # the audit still accounts for every verifier key: those of unopened shards from the index
    records = {e["key"]: e for e in read_audit(tmp_path / "drafter") if e["event"] == "tensor"}
    assert sorted(records) == sorted(weight_map)
    for key, record in records.items():
        if weight_map[key] in main_files:
            assert record["action"] == "skipped" and "shape" not in record and "dtype" not in record, record
            assert (record["file"], record["header"]) == (weight_map[key], "not read")
            assert record["reason"].startswith("the verifier's main stack")
        else:
            assert isinstance(record["shape"], list) and record["dtype"] == "BF16" and "header" not in record
    assert {k for k, r in records.items() if r["action"] != "skipped"} == {k for k in weight_map
                                                                           if k.startswith("mtp.")}


def test_plan_says_which_shards_it_did_not_open(run_cli: Any, tmp_path: Path) -> None:
    verifier = build_qwen3_next_verifier(tmp_path / "Qwen3-Next", seed=15, num_shards=4).path
    weight_map = _weight_map(verifier)
    main_files = sorted(set(weight_map.values()) - {f for k, f in weight_map.items() if k.startswith("mtp.")})
    proc = run_cli("plan", EXTRACT, "--source", f"verifier={verifier}")
    assert proc.returncode == 0, proc.stderr
    assert ("  verifier: 3 shards not opened (every key its index gives them is skipped): "
            + ", ".join(map(repr, main_files))) in proc.stdout.splitlines()


def test_a_shard_the_plan_needs_after_all_is_read_and_recorded_whole(tmp_path: Path) -> None:
    """require.strict: false, a main-stack shard's keys matched by no rule (not read), and
    an ``add`` of a tensor in another main-stack shard: that shard is read, its keys get
    their shapes (the plan reads what it needs, and the audit says what it read)."""
    verifier = build_qwen3_next_verifier(tmp_path / "Qwen3-Next", seed=12, num_shards=4).path
    weight_map = _weight_map(verifier)
    norm_file = weight_map["model.norm.weight"]
    rule = tmp_path / "rule.yaml"
    rule.write_text(textwrap.dedent(f"""\
        version: 1
        name: mtp-norm
        sources:
          verifier: {{path: {verifier}}}
        tensors:
          - match: 'mtp\\.norm\\.weight'
          - match: 'mtp\\..+'
            skip: not this one
        add:
          model.norm.weight: {{source: verifier, tensor: model.norm.weight}}
        require:
          strict: false
        """))
    plan = api.plan(rule)
    by_key = {r.key: r for r in plan.records}
    assert sorted(by_key) == sorted(weight_map)
    for key, record in by_key.items():
        read = weight_map[key] == norm_file or weight_map[key] == weight_map["mtp.norm.weight"]
        assert (record.shape is not None) == read, record
        assert (record.unread_file is None) == read
    assert by_key["model.norm.weight"].action == "copied"


def test_an_index_naming_a_missing_shard_fails_in_one_line_before_any_output(run_cli: Any, tmp_path: Path) -> None:
    verifier = build_qwen3_next_verifier(tmp_path / "Qwen3-Next", seed=13, num_shards=4).path
    weight_map = _weight_map(verifier)
    gone = min(f for k, f in weight_map.items() if not k.startswith("mtp."))
    (verifier / gone).unlink()
    proc = run_cli("apply", EXTRACT, "--source", f"verifier={verifier}", "--out", tmp_path / "out")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1
    assert f"to shard '{gone}', which does not exist in {verifier}" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_an_index_that_lies_about_a_shard_it_reads_fails_the_plan(run_cli: Any, tmp_path: Path) -> None:
    """The index puts an mtp.* key in a main-stack shard: that shard is read (a non-skip
    rule needs the key), and its header does not hold it. (A lie about a shard never read,
    one whose every key is skipped, cannot be seen without reading it.)"""
    verifier = build_qwen3_next_verifier(tmp_path / "Qwen3-Next", seed=14, num_shards=4).path
    index_path = verifier / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    liar = min(f for k, f in index["weight_map"].items() if not k.startswith("mtp."))
    index["weight_map"]["mtp.fc.weight"] = liar
    index_path.write_text(json.dumps(index))
    proc = run_cli("plan", EXTRACT, "--source", f"verifier={verifier}")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1
    assert f"maps 'mtp.fc.weight' to shard '{liar}', which does not hold it" in proc.stderr


def _extract(tmp_path: Path, verifier: Path, name: str) -> Path:
    return api.apply(EXTRACT, out=tmp_path / name, sources={"verifier": str(verifier)}, progress=False).out


def _graft(tmp_path: Path, drafter: Path, verifier: Path, jobs: int | None = None) -> Path:
    return api.apply(GRAFT, out=tmp_path / "grafted", sources={"drafter": str(drafter), "verifier": str(verifier)},
                     progress=False, jobs=jobs).out


@pytest.mark.parametrize(("seed", "jobs"), [(21, None), (22, 2)])
def test_mtp_graft_of_the_unchanged_drafter_writes_the_verifiers_files_byte_for_byte(
        tmp_path: Path, seed: int, jobs: int | None) -> None:
    verifier = build_qwen3_next_verifier(tmp_path / "Qwen3-Next", seed=seed, num_shards=4).path
    out = _graft(tmp_path, _extract(tmp_path, verifier, "drafter"), verifier, jobs)
    weights = sorted(p.name for p in verifier.glob("*.safetensors"))
    assert sorted(p.name for p in out.glob("*.safetensors")) == weights
    assert {name: _sha256(out / name) for name in weights} == {name: _sha256(verifier / name) for name in weights}
    assert _weight_map(out) == _weight_map(verifier)


def test_mtp_graft_of_a_changed_drafter_rewrites_only_the_mtp_shard(tmp_path: Path) -> None:
    verifier = build_qwen3_next_verifier(tmp_path / "Qwen3-Next", seed=23, num_shards=5).path
    tuned = build_qwen3_next_verifier(tmp_path / "tuned", seed=23, mtp_seed=230, num_shards=5).path
    out = _graft(tmp_path, _extract(tmp_path, tuned, "drafter"), verifier)
    weight_map = _weight_map(verifier)
    (mtp_file,) = {f for k, f in weight_map.items() if k.startswith("mtp.")}
    for name in sorted(set(weight_map.values())):
        assert (_sha256(out / name) == _sha256(verifier / name)) == (name != mtp_file), name
    assert _weight_map(out) == weight_map
    grafted, original, expected = read_output(out), read_output(verifier), read_output(tuned)
    changed = {k for k in original if not same_bits(grafted[k], original[k])}
    assert changed == {k for k in original if k.startswith("mtp.")}
    assert all(same_bits(grafted[k], expected[k]) for k in changed)
    # the MTP shard keeps its header: the same tensors at the same offsets, other values
    head = (verifier / mtp_file).read_bytes()[:8]
    n = int.from_bytes(head, "little")
    assert (out / mtp_file).read_bytes()[:8 + n] == (verifier / mtp_file).read_bytes()[:8 + n]
    assert verify(out).tensors == len(weight_map)


def test_shards_like_puts_a_new_key_in_the_last_file_and_writes_a_new_header_there(tmp_path: Path) -> None:
    """A rule that keeps a sharded source's layout and adds a tensor the source lacks (and
    casts the last file's norm): the other files stay byte-identical, the last one gets a
    header of its own with the new key after the source's."""
    verifier = build_qwen3_next_verifier(tmp_path / "Qwen3-Next", seed=24, num_shards=3).path
    weight_map = _weight_map(verifier)
    files = sorted(set(weight_map.values()))
    rule = tmp_path / "rule.yaml"
    rule.write_text(textwrap.dedent(f"""\
        version: 1
        name: keep-layout
        sources:
          verifier: {{path: {verifier}}}
        tensors:
          - match: 'mtp\\.norm\\.weight'
            cast: float32
          - match: '.+'
        add:
          extra.norm.weight: {{source: verifier, tensor: model.norm.weight}}
        output:
          shards: {{like: verifier}}
        """))
    out = api.apply(rule, out=tmp_path / "out", progress=False).out
    assert _weight_map(out) == {**weight_map, "extra.norm.weight": files[-1]}
    for name in files[:-1]:
        assert _sha256(out / name) == _sha256(verifier / name)
    from safetensors import safe_open

    with safe_open(str(out / files[-1]), "np") as f:
        keys = list(f.keys())
        assert f.get_slice("mtp.norm.weight").get_dtype() == "F32"
    assert sorted(keys) == sorted([*(k for k, f in weight_map.items() if f == files[-1]), "extra.norm.weight"])
    header = json.loads((out / files[-1]).read_bytes()[8:8 + int.from_bytes((out / files[-1]).read_bytes()[:8],
                                                                             "little")])
    order = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    assert order[-1] == "extra.norm.weight"
    assert verify(out).tensors == len(weight_map) + 1


def test_shards_like_a_source_no_rule_reads_lists_its_tensors_and_pins_its_files(tmp_path: Path) -> None:
    """The layout comes from another source's headers: they are read by the plan (so a
    changed one makes the output stale) and each of its tensors is in the audit."""
    import shutil

    verifier = build_qwen3_next_verifier(tmp_path / "Qwen3-Next", seed=25, num_shards=3).path
    layout = tmp_path / "layout"
    shutil.copytree(verifier, layout)
    rule = tmp_path / "rule.yaml"
    rule.write_text(textwrap.dedent(f"""\
        version: 1
        name: copy-as-laid-out
        sources:
          verifier: {{path: {verifier}}}
          layout: {{path: {layout}}}
        convert: verifier
        tensors:
          - match: '.+'
        output:
          shards: {{like: layout}}
        """))
    out = api.apply(rule, out=tmp_path / "out", progress=False).out
    weight_map = _weight_map(layout)
    assert {name: _sha256(out / name) for name in set(weight_map.values())} == {
        name: _sha256(layout / name) for name in set(weight_map.values())}
    records = [e for e in read_audit(out) if e["event"] == "tensor" and e["source"] == "layout"]
    assert sorted(e["key"] for e in records) == sorted(weight_map)
    assert all(e["action"] == "unused" and "output.shards.like" in e["reason"] for e in records)
    read = set(read_audit(out)[0]["files_read"])
    assert {str((layout / name).resolve()) for name in set(weight_map.values())} <= read


@pytest.mark.parametrize(("output", "message"), [
    ("shards: {like: verifer}", "output.shards.like: unknown source 'verifer' (defined: verifier); did you mean 'verifier'?"),
    ("shards: {like: verifier}\n  max_shard_size: 5GB",
     "output.shards.like: the output's files are those of the source named here, so output.max_shard_size has "
     "nothing to decide; remove one of the two"),
    ("shards: {}", "output.shards: missing required key 'like'"),
])
def test_shards_like_is_validated(run_cli: Any, tmp_path: Path, output: str, message: str) -> None:
    rule = tmp_path / "rule.yaml"
    rule.write_text(f"version: 1\nsources:\n  verifier: {{path: v}}\ntensors:\n  - match: '.+'\noutput:\n  {output}\n")
    proc = run_cli("validate", rule)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr, proc.stderr
