"""apply: the audit log, bounded memory, and every rule feature through the engine.

Each feature runs the real engine on real safetensors stand-ins and compares the output
with values computed here with torch from the source files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    LM_HEAD,
    expected_conversion,
    file_keys,
    read_audit,
    read_output,
    reference_digest,
    same_bits,
    tensor_bytes,
    verifier_tensor,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import ckptxform
from ckptxform import api
from ckptxform.standins import (
    HeadlineStandins,
    build_eagle3_drafter,
    build_full_vocab_drafter,
    build_headline_standins,
    build_kimi_k25_verifier,
)

ACTIONS = {"loaded", "renamed", "permuted", "skipped", "vocab", "rows", "unused", "cast", "copied"}
MISSING_ROWS_FROM_VERIFIER = "missing_rows: {rows_of: verifier, tensor: language_model.lm_head.weight}"


def apply_variant(rule: Path, out: Path, sources: dict[str, str]) -> dict[str, Any]:
    api.apply(rule, out=out, sources=sources, progress=False)
    return read_output(out)


# --------------------------------------------------------------------------- audit log


def test_audit_run_event(headline: HeadlineStandins, headline_rule: Path, headline_out: Path) -> None:
    events = read_audit(headline_out)
    run = events[0]
    assert run["event"] == "run"
    assert run["rules"] == str(headline_rule)
    assert run["rules_sha256"] == hashlib.sha256(headline_rule.read_bytes()).hexdigest()
    assert {n: {k: v for k, v in s.items() if k != "fingerprint"} for n, s in run["sources"].items()} == {
        name: {"location": loc, "revision": None, "commit": None} for name, loc in headline.sources.items()}
    # local sources: a digest of each weight file's name, size and mtime identifies the weights
    assert all(len(s["fingerprint"]) == 64 for s in run["sources"].values())
    assert run["version"] == ckptxform.__version__
    started = datetime.fromisoformat(run["started"])
    assert started.tzinfo is not None
    assert timedelta(0) <= datetime.now(timezone.utc) - started < timedelta(hours=1)


def test_audit_accounts_for_every_tensor_of_every_file_opened(
        headline: HeadlineStandins, headline_out: Path) -> None:
    events = read_audit(headline_out)
    tensors = [e for e in events if e["event"] == "tensor"]
    seen = [(e["source"], e["key"]) for e in tensors]
    assert len(seen) == len(set(seen)), "a tensor is recorded twice"

    index = json.loads((headline.verifier.path / "model.safetensors.index.json").read_text())
    lm_shard = index["weight_map"][LM_HEAD]
    opened = {
        "drafter": file_keys(headline.drafter.path / "model.safetensors"),
        "target_vocab": file_keys(headline.target_vocab.path / "model.safetensors"),
        "verifier": file_keys(headline.verifier.path / lm_shard),
    }
    assert set(seen) == {(source, key) for source, keys in opened.items() for key in keys}
    other_shards = {k for k, f in index["weight_map"].items() if f != lm_shard}
    assert other_shards and not other_shards & {key for source, key in seen if source == "verifier"}

    by_key = {(e["source"], e["key"]): e for e in tensors}
    for (source, key), event in by_key.items():
        assert event["action"] in ACTIONS, event
        assert (event["shape"], event["dtype"]) == opened[source][key], event
        if event["action"] != "unused":
            assert event["rule"].rsplit(":", 1)[1].isdigit(), event
        assert event["reason"], event
    drafter = {k: e for (s, k), e in by_key.items() if s == "drafter"}
    for key, event in drafter.items():
        if key.startswith("midlayer."):
            assert (event["action"], event["target"]) == ("renamed", "layers.0." + key[len("midlayer."):])
    assert (drafter["fc.weight"]["action"], drafter["fc.weight"]["target"]) == ("loaded", "fc.weight")
    assert drafter["lm_head.weight"]["action"] == "permuted"
    assert drafter["d2t"]["action"] == drafter["t2d"]["action"] == "skipped"
    assert by_key[("target_vocab", "d2t")]["action"] == by_key[("target_vocab", "t2d")]["action"] == "vocab"
    assert by_key[("verifier", LM_HEAD)]["action"] == "rows"
    assert by_key[("target_vocab", "lm_head.weight")]["action"] == "unused"


def test_audit_written_events_hash_the_tensors_as_read_back(headline_out: Path) -> None:
    events = read_audit(headline_out)
    written = [e for e in events if e["event"] == "written"]
    output = read_output(headline_out)
    assert sorted(e["key"] for e in written) == sorted(output)
    for event in written:
        tensor = output[event["key"]]
        assert event["digest"] == "blake3" and "sha256" not in event, event
        assert event["blake3"] == reference_digest("blake3", tensor_bytes(tensor)), event["key"]
        assert event["shape"] == list(tensor.shape)
        assert event["file"] == "model.safetensors"
    lm = next(e for e in written if e["key"] == "lm_head.weight")
    assert lm["from"]["source"] == "drafter" and lm["from"]["fill"] == f"verifier:{LM_HEAD}"
    assert lm["from"]["rows_from_source"] + lm["from"]["rows_filled"] == lm["shape"][0]


def test_audit_order_and_summary(headline_out: Path) -> None:
    kinds = [e["event"] for e in read_audit(headline_out)]
    assert kinds[0] == "run" and kinds[-1] == "summary"
    # run, then every tensor record, then every written record, then the summary
    assert kinds == sorted(kinds, key=["run", "tensor", "written", "summary"].index)
    summary = read_audit(headline_out)[-1]
    assert summary["status"] == "ok"
    assert summary["written"] == kinds.count("written")
    assert sum(summary["tensors"].values()) == kinds.count("tensor")
    assert summary["files"] == ["model.safetensors"]


# ---------------------------------------------------------------------------- features


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> HeadlineStandins:
    return build_headline_standins(tmp_path_factory.mktemp("small"), seed=5)


@pytest.fixture(scope="module")
def small_expected(small: HeadlineStandins) -> dict[str, Any]:
    return expected_conversion(small.drafter.path, small.target_vocab.path, small.verifier.path)


def missing_positions(standins: HeadlineStandins) -> tuple[list[int], list[int]]:
    """K2.5 draft indices whose token K2 lacks, and those it has."""
    k2 = set(standins.k2_ids)
    missing = [j for j, t in enumerate(standins.k25_ids) if t not in k2]
    carried = [j for j, t in enumerate(standins.k25_ids) if t in k2]
    return missing, carried


def test_cast_decodes_only_the_tensors_it_names(small: HeadlineStandins, small_expected: dict[str, Any],
                                                 rule_variant: Callable[..., Path], tmp_path: Path) -> None:
    rule = rule_variant({"  - match: 'fc\\.weight|norm\\.weight'\n":
                         "  - match: 'fc\\.weight|norm\\.weight'\n    cast: float32\n"})
    got = apply_variant(rule, tmp_path / "out", small.sources)
    for key in ("fc.weight", "norm.weight"):
        assert got[key].dtype == torch.float32
        assert torch.equal(got[key], small_expected[key].to(torch.float32))
    for key in set(got) - {"fc.weight", "norm.weight"}:
        assert same_bits(got[key], small_expected[key]), key
    events = read_audit(tmp_path / "out")
    fc = next(e for e in events if e["event"] == "tensor" and e["key"] == "fc.weight")
    assert fc["action"] == "cast" and "BF16 -> F32" in fc["reason"]
    written = next(e for e in events if e["event"] == "written" and e["key"] == "fc.weight")
    assert (written["dtype"], written["from"]["cast_from"]) == ("F32", "BF16")


def test_output_dtype_casts_every_float_tensor(small: HeadlineStandins, small_expected: dict[str, Any],
                                               rule_variant: Callable[..., Path], tmp_path: Path) -> None:
    rule = rule_variant({"output:\n  max_shard_size: 5GB": "output:\n  dtype: float16"})
    got = apply_variant(rule, tmp_path / "out", small.sources)
    assert sorted(got) == sorted(small_expected)
    for key, want in small_expected.items():
        if want.is_floating_point():
            assert got[key].dtype == torch.float16, key
            assert torch.equal(got[key], want.to(torch.float16)), key
        else:  # d2t and t2d keep their integer and bool dtypes
            assert same_bits(got[key], want), key


def test_missing_rows_zeros(small: HeadlineStandins, small_expected: dict[str, Any],
                            rule_variant: Callable[..., Path], tmp_path: Path) -> None:
    rule = rule_variant({MISSING_ROWS_FROM_VERIFIER: "missing_rows: {init: zeros}"})
    lm = apply_variant(rule, tmp_path / "out", small.sources)["lm_head.weight"]
    missing, carried = missing_positions(small)
    assert missing and lm.dtype == torch.bfloat16
    assert same_bits(lm[carried], small_expected["lm_head.weight"][carried])
    assert same_bits(lm[missing], torch.zeros(len(missing), lm.shape[1], dtype=torch.bfloat16))
    # the verifier is not needed any more, so none of its files is opened
    assert not any(e.get("source") == "verifier" for e in read_audit(tmp_path / "out"))


def test_missing_rows_mean(small: HeadlineStandins, small_expected: dict[str, Any],
                           rule_variant: Callable[..., Path], tmp_path: Path) -> None:
    rule = rule_variant({MISSING_ROWS_FROM_VERIFIER: "missing_rows: {init: mean}"})
    lm = apply_variant(rule, tmp_path / "out", small.sources)["lm_head.weight"]
    missing, carried = missing_positions(small)
    carried_rows = small_expected["lm_head.weight"][carried]
    assert same_bits(lm[carried], carried_rows)
    mean = carried_rows.to(torch.float64).mean(dim=0)
    for j in missing:
        torch.testing.assert_close(lm[j].to(torch.float64), mean, rtol=2**-8, atol=1e-6)
    assert all(same_bits(lm[j], lm[missing[0]]) for j in missing)


def test_missing_rows_normal_is_seeded(small: HeadlineStandins, small_expected: dict[str, Any],
                                       rule_variant: Callable[..., Path], tmp_path: Path) -> None:
    rule = rule_variant({MISSING_ROWS_FROM_VERIFIER: "missing_rows: {init: normal, seed: 7}"}, "n7.yaml")
    rule_again = rule_variant({MISSING_ROWS_FROM_VERIFIER: "missing_rows: {init: normal, seed: 7}"}, "n7b.yaml")
    other = rule_variant({MISSING_ROWS_FROM_VERIFIER: "missing_rows: {init: normal, seed: 8}"}, "n8.yaml")
    first = apply_variant(rule, tmp_path / "a", small.sources)["lm_head.weight"]
    second = apply_variant(rule_again, tmp_path / "b", small.sources)["lm_head.weight"]
    third = apply_variant(other, tmp_path / "c", small.sources)["lm_head.weight"]
    missing, carried = missing_positions(small)
    assert same_bits(first, second)
    assert same_bits(first[carried], third[carried])
    assert same_bits(first[carried], small_expected["lm_head.weight"][carried])
    assert not torch.equal(first[missing], third[missing])
    std = first[missing].to(torch.float64).std().item()
    assert 0.015 < std < 0.025  # default std 0.02 over thousands of values


@pytest.mark.parametrize("fill", [MISSING_ROWS_FROM_VERIFIER, "missing_rows: {init: zeros}",
                                  "missing_rows: {init: mean}", "missing_rows: {init: normal, seed: 3}"])
def test_permuted_rows_are_the_same_bytes_by_kernel_copies_or_the_stream(
        fill: str, small: HeadlineStandins, small_expected: dict[str, Any], rule_variant: Callable[..., Path],
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A local lm_head is gathered by kernel copies of its row runs, a Hub one (or with a
    cast) streamed through memory: the same bytes."""
    from ckptxform.engine.plan.recipes import ByteProgram
    from ckptxform.engine.run.writer import ShardWriter

    rule = rule_variant({MISSING_ROWS_FROM_VERIFIER: fill}) if fill != MISSING_ROWS_FROM_VERIFIER else rule_variant({})
    copied: list[str] = []
    real_copy = ShardWriter.copy_runs

    def copy_runs(self: ShardWriter, key: str, *args: Any) -> None:
        copied.append(key)
        real_copy(self, key, *args)

    monkeypatch.setattr(ShardWriter, "copy_runs", copy_runs)
    outputs = {}
    for how in ("kernel", "stream"):
        if how == "stream":
            monkeypatch.setattr(ByteProgram, "local_pieces", lambda self, plan: None)
        copied.clear()
        outputs[how] = apply_variant(rule, tmp_path / how, small.sources)["lm_head.weight"]
        assert ("lm_head.weight" in copied) == (how == "kernel"), how
    assert same_bits(outputs["kernel"], outputs["stream"])
    missing, carried = missing_positions(small)
    assert same_bits(outputs["kernel"][carried], small_expected["lm_head.weight"][carried])
    if fill == MISSING_ROWS_FROM_VERIFIER:
        assert same_bits(outputs["kernel"], small_expected["lm_head.weight"])


def test_add_copies_another_sources_tensor(small: HeadlineStandins, small_expected: dict[str, Any],
                                           rule_variant: Callable[..., Path], tmp_path: Path) -> None:
    embed = "language_model.model.embed_tokens.weight"
    rule = rule_variant({
        "  - match: 'embed_tokens\\.weight'\n    optional: true": "  - match: 'embed_tokens\\.weight'\n"
                                                                   "    optional: true\n"
                                                                   "    skip: taken from the verifier",
        "add:\n": f"add:\n  embed_tokens.weight: {{source: verifier, tensor: {embed}}}\n",
    })
    got = apply_variant(rule, tmp_path / "out", small.sources)
    assert same_bits(got["embed_tokens.weight"], verifier_tensor(small.verifier.path, embed))
    assert sorted(set(got) - {"embed_tokens.weight"}) == sorted(small_expected)
    events = read_audit(tmp_path / "out")
    record = next(e for e in events if e["event"] == "tensor" and e["key"] == embed)
    assert (record["action"], record["target"]) == ("copied", "embed_tokens.weight")
    # the embedding's shard was opened, so its other tensors are accounted for too
    index = json.loads((small.verifier.path / "model.safetensors.index.json").read_text())
    shard = index["weight_map"][embed]
    shard_keys = {k for k, f in index["weight_map"].items() if f == shard}
    recorded = {e["key"] for e in events if e["event"] == "tensor" and e["source"] == "verifier"}
    assert shard_keys <= recorded


def test_extends_builds_a_variant_in_a_few_lines(small: HeadlineStandins, small_expected: dict[str, Any],
                                                 headline_rule: Path, tmp_path: Path) -> None:
    """A native-layout (SGLang) variant: keep ``midlayer.*`` names, same lm_head."""
    child = tmp_path / "rules" / "native.yaml"
    child.parent.mkdir()
    child.write_text(textwrap.dedent(f"""\
        version: 1
        extends: {os.path.relpath(headline_rule, child.parent)}
        name: aqmedai-k2-to-k25-native
        tensors:
          - match: 'midlayer\\..+'
        require:
          loaded: ['midlayer\\..+', 'lm_head\\.weight']
        config:
          from: drafter
        """))
    out = tmp_path / "out"
    got = apply_variant(child, out, small.sources)
    renamed = {("midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k): v
               for k, v in small_expected.items()}
    assert sorted(got) == sorted(renamed)
    assert all(same_bits(got[k], renamed[k]) for k in renamed)
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (small.drafter.path / "config.json").read_text())
    assert read_audit(out)[0]["rules"] == str(child)


def test_sharded_output(small: HeadlineStandins, small_expected: dict[str, Any],
                        rule_variant: Callable[..., Path], tmp_path: Path) -> None:
    limit = 48_000
    rule = rule_variant({"max_shard_size: 5GB": "max_shard_size: 48KB"})
    out = tmp_path / "out"
    api.apply(rule, out=out, sources=small.sources, progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    assert sorted(p.name for p in out.glob("*.safetensors")) == files
    assert sorted(index["weight_map"]) == sorted(small_expected)
    total = 0
    for name in files:
        with safe_open(str(out / name), framework="pt") as f:
            keys = set(f.keys())
            assert keys == {k for k, v in index["weight_map"].items() if v == name}
            sizes = [f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in keys]
        total += sum(sizes)
        assert sum(sizes) <= limit or len(keys) == 1, (name, sizes)
    assert index["metadata"]["total_size"] == total
    got = read_output(out)
    assert all(same_bits(got[k], small_expected[k]) for k in small_expected)
    written = {e["key"]: e["file"] for e in read_audit(out) if e["event"] == "written"}
    assert written == index["weight_map"]
    assert read_audit(out)[-1]["files"] == files


def test_not_strict_skips_and_audits_unmatched_tensors(small: HeadlineStandins, small_expected: dict[str, Any],
                                                      rule_variant: Callable[..., Path], tmp_path: Path) -> None:
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    tensors = load_file(str(small.drafter.path / "model.safetensors"))
    tensors["extra_head.weight"] = torch.ones(3, 2, dtype=torch.bfloat16)
    save_file(tensors, str(drafter / "model.safetensors"), metadata={"format": "pt"})
    (drafter / "config.json").write_bytes((small.drafter.path / "config.json").read_bytes())
    rule = rule_variant({"require:\n": "require:\n  strict: false\n"})
    got = apply_variant(rule, tmp_path / "out", {**small.sources, "drafter": str(drafter)})
    assert sorted(got) == sorted(small_expected)
    record = next(e for e in read_audit(tmp_path / "out") if e.get("key") == "extra_head.weight")
    assert (record["action"], record["target"], record["shape"]) == ("skipped", None, [3, 2])
    assert "strict" in record["reason"]


def test_identity_rows_of_prunes_a_full_vocabulary_lm_head(small: HeadlineStandins, tmp_path: Path) -> None:
    """lightseekorg-style drafter: lm_head over all target ids, pruned to a draft vocab by
    target id (j + d2t[j]), not by the raw offsets."""
    dims = small.drafter.dims
    build_full_vocab_drafter(tmp_path / "full", dims, seed=3)
    rule = tmp_path / "prune.yaml"
    rule.write_text(textwrap.dedent("""\
        version: 1
        name: prune-full-vocab
        sources:
          drafter: {path: full}
          target_vocab: {path: k25}
        convert: drafter
        vocab:
          full: {source: drafter, identity_rows_of: lm_head.weight}
          k25: {source: target_vocab, encoding: offset}
        tensors:
          - match: 'lm_head\\.weight'
            permute_rows: {from: full, to: k25}
          - match: '.+'
        add:
          d2t: {vocab: k25, field: d2t}
          t2d: {vocab: k25, field: t2d}
        require:
          min_rows_from_source: {lm_head.weight: 1.0}
        """))
    os.symlink(small.target_vocab.path, tmp_path / "k25")
    got = apply_variant(rule, tmp_path / "out", {})  # sources: paths relative to the rule file
    full = load_file(str(tmp_path / "full" / "model.safetensors"))
    d2t = load_file(str(small.target_vocab.path / "model.safetensors"))["d2t"]
    ids = torch.arange(len(d2t)) + d2t
    assert same_bits(got["lm_head.weight"], full["lm_head.weight"][ids])
    assert not torch.equal(got["lm_head.weight"], full["lm_head.weight"][d2t])
    assert same_bits(got["d2t"], d2t)
    for key in set(full) - {"lm_head.weight"}:
        assert same_bits(got[key], full[key]), key


# ------------------------------------------------------------------------------ memory

_CHECKPOINT_TENSORS = 12
_TENSOR_BYTES = 24 << 20


def _write_big_checkpoint(directory: Path) -> int:
    """One safetensors file of 12 BF16 tensors of 24 MiB each, written without holding it
    in memory; returns its data size."""
    directory.mkdir()
    rows, cols = _TENSOR_BYTES // (2 * 4096), 4096
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    for i in range(_CHECKPOINT_TENSORS):
        start = i * _TENSOR_BYTES
        header[f"midlayer.block{i:02d}.weight"] = {"dtype": "BF16", "shape": [rows, cols],
                                                   "data_offsets": [start, start + _TENSOR_BYTES]}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with (directory / "model.safetensors").open("wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for i in range(_CHECKPOINT_TENSORS):
            # distinct content per tensor, cheap to make: a 1 MiB pattern repeated
            f.write(bytes((i + j) % 251 for j in range(1 << 20)) * (_TENSOR_BYTES >> 20))
    return _CHECKPOINT_TENSORS * _TENSOR_BYTES


def test_peak_memory_stays_well_below_the_checkpoint_size(tmp_path: Path) -> None:
    size = _write_big_checkpoint(tmp_path / "big")
    rule = tmp_path / "rename.yaml"
    rule.write_text(textwrap.dedent("""\
        version: 1
        name: rename-only
        sources:
          drafter: {path: big}
        convert: drafter
        tensors:
          - match: 'midlayer\\.(.+)'
            rename: 'layers.0.\\1'
        """))
    # The peak RSS of the apply process itself: VmHWM of /proc/self/status. (ru_maxrss
    # would not do: Linux carries it over exec from the forked pytest process, torch and all.)
    script = textwrap.dedent("""
        import sys
        from ckptxform import api

        def peak_kib():
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

        baseline = peak_kib()
        api.apply(sys.argv[1], out=sys.argv[2], progress=False)
        print(baseline, peak_kib(), "torch" in sys.modules, "numpy" in sys.modules)
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(rule), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    baseline_kib, peak_kib, torch_loaded, numpy_loaded = proc.stdout.split()
    growth = (int(peak_kib) - int(baseline_kib)) * 1024
    assert growth < size / 3, f"peak RSS grew by {growth >> 20} MiB converting {size >> 20} MiB"
    assert torch_loaded == "False"  # a rename copies bytes; it decodes nothing
    assert numpy_loaded == "False"  # nor does it import numpy (0.08 s of start-up here)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == [f"layers.0.block{i:02d}.weight" for i in range(_CHECKPOINT_TENSORS)]
        last = f.get_slice("layers.0.block11.weight")[0:1]
    assert tensor_bytes(last)[:4] == bytes([11, 12, 13, 14])


# ------------------------------------------------------------------ other source layouts


def _shard_drafter(src: Path, dest: Path) -> None:
    """The same drafter as two shards with an index (d2t/t2d and lm_head in different shards)."""
    dest.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    keys = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, part in halves.items():
        save_file({k: tensors[k] for k in part}, str(dest / name), metadata={"format": "pt"})
    weight_map = {k: name for name, part in halves.items() for k in part}
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    shutil.copy(src / "config.json", dest / "config.json")


@pytest.mark.parametrize("layout", ["pytorch_model.bin", "sharded"])
def test_other_drafter_layouts_convert_bit_exact(layout: str, small: HeadlineStandins, headline_rule: Path,
                                                 tmp_path: Path) -> None:
    reference = build_eagle3_drafter(tmp_path / "reference", small.drafter.dims, small.k2_ids, seed=42)
    if layout == "sharded":
        drafter = tmp_path / "drafter"
        _shard_drafter(reference.path, drafter)
    else:
        drafter = build_eagle3_drafter(tmp_path / "drafter", small.drafter.dims, small.k2_ids, seed=42,
                                       fmt="bin").path
    got = apply_variant(headline_rule, tmp_path / "out", {**small.sources, "drafter": str(drafter)})
    want = expected_conversion(reference.path, small.target_vocab.path, small.verifier.path)
    assert sorted(got) == sorted(want)
    assert all(same_bits(got[k], want[k]) for k in want)
    opened = {e["key"] for e in read_audit(tmp_path / "out") if e["event"] == "tensor" and e["source"] == "drafter"}
    assert opened == set(reference.keys)  # every tensor of every drafter file is accounted for


def test_fallback_rows_are_cast_to_the_drafters_dtype(small: HeadlineStandins, headline_rule: Path,
                                                      tmp_path: Path) -> None:
    """A float32 verifier lends rows to a bfloat16 lm_head: rows are cast, the rest untouched."""
    verifier = build_kimi_k25_verifier(tmp_path / "verifier", dataclasses.replace(small.drafter.dims, dtype="float32"),
                                       seed=4)
    got = apply_variant(headline_rule, tmp_path / "out", {**small.sources, "verifier": str(verifier.path)})
    lm = got["lm_head.weight"]
    assert lm.dtype == torch.bfloat16
    rows = verifier_tensor(verifier.path, LM_HEAD)
    assert rows.dtype == torch.float32
    missing, carried = missing_positions(small)
    want = expected_conversion(small.drafter.path, small.target_vocab.path, small.verifier.path)
    assert same_bits(lm[carried], want["lm_head.weight"][carried])
    assert same_bits(lm[missing], rows[[small.k25_ids[j] for j in missing]].to(torch.bfloat16))
    record = next(e for e in read_audit(tmp_path / "out") if e.get("key") == LM_HEAD)
    assert record["action"] == "rows" and "cast F32 -> BF16" in record["reason"]


def test_add_d2t_in_absolute_encoding(small: HeadlineStandins, rule_variant: Callable[..., Path],
                                      tmp_path: Path) -> None:
    rule = rule_variant({"d2t: {vocab: k25, field: d2t}": "d2t: {vocab: k25, field: d2t, encoding: absolute}"})
    got = apply_variant(rule, tmp_path / "out", small.sources)
    assert same_bits(got["d2t"], torch.tensor(small.k25_ids, dtype=torch.int64))
