"""``diff A B`` compares values (issue 35 item 7): a digest per tensor, streamed in bands,
from a trusted audit or hashed; it names the tensors holding other bytes, exits 1 when A
and B differ and 0 when they hold the same tensors (however sharded), pairs renamed
tensors by digest for ``--emit-rules``; ``--structure-only`` reads headers only."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from blake3 import blake3
from conftest import read_output
from safetensors.torch import save_file
from test_structural_engine import assert_same, rand, rule_file, write_model

from ckptxform import api
from ckptxform.diff import values
from ckptxform.diff.checkpoint import checkpoint_diff
from ckptxform.filenames import AUDIT_FILE
from ckptxform.sources.local import LocalCheckpoint
from ckptxform.sources.resolve import open_location

RunCli = Callable[..., subprocess.CompletedProcess[str]]


def model() -> dict[str, torch.Tensor]:
    """Odd sizes, several dtypes, a tensor far larger than the bands the tests use."""
    return {"embed.weight": rand(37, 11, seed=1), "norm.weight": rand(11, seed=2, dtype=torch.float32),
            "layers.0.w": rand(13, 7, seed=3, dtype=torch.float16), "layers.1.w": rand(13, 7, seed=4),
            "big": rand(301, 17, seed=5, dtype=torch.float32), "count": torch.arange(5, dtype=torch.int64)}


def converted(tmp_path: Path, src: Path, name: str, digest: str = "blake3", shard: str = "2KB") -> Path:
    """``src`` kept as it is by ``apply``, in shards of ``shard``: an output with an audit."""
    rules = rule_file(tmp_path, f"tensors:\n  - match: '.+'\noutput: {{max_shard_size: {shard}}}\n",
                      name=f"{name}.yaml")
    rules.write_text(rules.read_text().replace("{path: src}", f"{{path: {src.name}}}"))
    api.apply(rules, out=tmp_path / name, progress=False, digest=digest)
    return tmp_path / name


def flip_byte(path: Path, key: str, at: int) -> None:
    """Change byte ``at`` of tensor ``key`` in the safetensors file ``path``, in place."""
    with open_location(str(path.parent)) as checkpoint:
        info = checkpoint.tensors[key]
        assert (path.parent / info.file) == path
        offset = info.offset + at
    with open(path, "r+b") as file:
        file.seek(offset)
        old = file.read(1)
        file.seek(offset)
        file.write(bytes([old[0] ^ 0x5A]))


def shard_of(out: Path, key: str) -> Path:
    return out / json.loads((out / "model.safetensors.index.json").read_text())["weight_map"][key]


@pytest.fixture(autouse=True)
def small_bands(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(values, "BAND", 97)  # every tensor read in several bands, the last one short


def test_equal_checkpoints_sharded_otherwise_exit_0(tmp_path: Path, run_cli: RunCli) -> None:
    write_model(tmp_path / "a", model(), {})
    b = converted(tmp_path, tmp_path / "a", "b")
    assert len(list(b.glob("*.safetensors"))) > 1
    result = checkpoint_diff(str(tmp_path / "a"), str(b))
    assert result.values is not None and not result.differs
    assert (result.values.compared, result.values.differ, result.values.renamed) == (6, (), ())
    assert result.values.sources[0] == f"hashed (6 tensors, {sum(t.nbytes for t in model().values()):,} bytes)"
    assert result.values.sources[1] == "read from its audit (6 tensors)"
    proc = run_cli("diff", tmp_path / "a", b)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("equal: the same keys, shapes, dtypes and bytes\n")
    assert json.loads(run_cli("diff", tmp_path / "a", b, "--json").stdout)["differ"] is False


def test_tensors_with_other_bytes_are_named_and_exit_1(tmp_path: Path, run_cli: RunCli) -> None:
    a = model()
    write_model(tmp_path / "a", a, {})
    write_model(tmp_path / "b", a, {})
    b_file = tmp_path / "b" / "model.safetensors"
    flip_byte(b_file, "big", a["big"].nbytes - 1)  # the last byte of the last, short band
    flip_byte(b_file, "layers.0.w", 0)
    result = checkpoint_diff(str(tmp_path / "a"), str(tmp_path / "b"), jobs=3)
    assert result.values is not None and result.differs
    assert result.values.differ == (("big", "big"), ("layers.0.w", "layers.0.w"))
    assert checkpoint_diff(str(tmp_path / "a"), str(tmp_path / "b"), jobs=1).values == result.values
    proc = run_cli("diff", tmp_path / "a", tmp_path / "b")
    assert proc.returncode == 1, proc.stderr
    assert ("6 keys in both with the same shape and dtype: 4 hold the same bytes\n"
            "2 in both with the same shape and dtype but other bytes:\n  'big'\n  'layers.0.w'\n") in proc.stdout
    assert proc.stdout.endswith("different: 0 only in A, 0 only in B, 0 with another shape or dtype, "
                                "2 with other bytes\n")


def test_structure_only_reads_headers_only(tmp_path: Path, run_cli: RunCli, monkeypatch: pytest.MonkeyPatch) -> None:
    write_model(tmp_path / "a", model(), {})
    write_model(tmp_path / "b", model(), {})
    flip_byte(tmp_path / "b" / "model.safetensors", "norm.weight", 3)

    def no_read(*_args: object) -> bytes:
        raise AssertionError("--structure-only read tensor bytes")

    monkeypatch.setattr(LocalCheckpoint, "read", no_read)
    result = checkpoint_diff(str(tmp_path / "a"), str(tmp_path / "b"), values=False)
    assert result.values is None and not result.differs
    proc = run_cli("diff", tmp_path / "a", tmp_path / "b", "--structure-only")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("6 keys in both with the same shape and dtype\n0 only in A\n0 only in B\n"
                                "0 in both with another shape or dtype\n"
                                "headers agree (values not compared: drop --structure-only to compare them)\n")


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
def test_a_digest_is_of_the_whole_tensor_read_in_bounded_bands(tmp_path: Path, algorithm: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = model()
    write_model(tmp_path / "a", tensors, {})
    reads: list[int] = []
    read = LocalCheckpoint.read

    def spy(self: LocalCheckpoint, info, start=0, length=None):  # type: ignore[no-untyped-def]
        reads.append(length)
        return read(self, info, start, length)

    monkeypatch.setattr(LocalCheckpoint, "read", spy)
    reference = {"blake3": lambda b: blake3(b).hexdigest(), "sha256": lambda b: hashlib.sha256(b).hexdigest()}
    with open_location(str(tmp_path / "a")) as checkpoint:
        for key, tensor in tensors.items():
            reads.clear()
            whole = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            assert values.tensor_digest(checkpoint, checkpoint.tensors[key], algorithm) == \
                reference[algorithm](whole), key
            assert max(reads) <= 97 and sum(reads) == len(whole), key


def test_a_renamed_tensor_is_paired_by_digest_and_becomes_a_rename_rule(tmp_path: Path, run_cli: RunCli) -> None:
    """``lm_head.weight`` -> ``head.weight``, byte-identical: a rename rule, and the rule file
    reproduces B. Same bytes under another shape is no rename; of two equal tensors (tied
    weights), each goes to the closest name."""
    a = model() | {"lm_head.weight": rand(37, 11, seed=9), "p": rand(4, 6, seed=10),
                   "tied.x.bias": torch.zeros(8), "tied.y.bias": torch.zeros(8)}
    b = {k: v for k, v in a.items() if k not in ("lm_head.weight", "p", "tied.x.bias", "tied.y.bias")}
    b |= {"head.weight": a["lm_head.weight"], "q": a["p"].reshape(6, 4), "tie.x.b": a["tied.x.bias"],
          "tie.y.b": a["tied.y.bias"]}
    write_model(tmp_path / "a", a, {"hidden_size": 11})
    write_model(tmp_path / "b", b)
    result = checkpoint_diff(str(tmp_path / "a"), str(tmp_path / "b"))
    assert result.renamed_by_digest == (("lm_head.weight", "head.weight"), ("tied.x.bias", "tie.x.b"),
                                        ("tied.y.bias", "tie.y.b"))
    assert (result.unexplained_a, result.unexplained_b) == (["p"], ["q"])
    assert "renamed, same bytes: 'lm_head.weight' -> 'head.weight'\n" in run_cli("diff", tmp_path / "a",
                                                                                   tmp_path / "b").stdout
    del b["q"]  # B's reshaped tensor no rule makes: the rest is reproduced
    save_file({k: v.contiguous() for k, v in b.items()}, str(tmp_path / "b" / "model.safetensors"))
    rules = tmp_path / "emitted.yaml"
    proc = run_cli("diff", tmp_path / "a", tmp_path / "b", "--emit-rules", "--out", rules)
    assert proc.returncode == 0, proc.stderr
    assert '  - match: "lm_head\\\\.weight"\n    rename: "head.weight"\n' in rules.read_text()
    api.apply(rules, out=tmp_path / "out", progress=False)
    assert_same(read_output(tmp_path / "out"), b)


def test_an_audit_is_trusted_only_while_its_files_are_unchanged(tmp_path: Path) -> None:
    write_model(tmp_path / "a", model(), {})
    b = converted(tmp_path, tmp_path / "a", "b")
    shard = shard_of(b, "big")
    audit_time = (b / AUDIT_FILE).stat().st_mtime_ns
    flip_byte(shard, "big", 5)
    os.utime(shard, ns=(audit_time + 10**9, audit_time + 10**9))  # edited a second after the audit
    result = checkpoint_diff(str(tmp_path / "a"), str(b))
    assert result.values is not None and result.values.differ == (("big", "big"),)
    assert result.values.sources[1].startswith("hashed (6 tensors, ")
    assert result.values.sources[1].endswith(f"; its audit is not used: {shard.name!r} was modified after its "
                                             "audit was written")
    # an edit whose mtime was put back is not seen in the audit; --rehash reads every byte
    os.utime(shard, ns=(audit_time - 10**9, audit_time - 10**9))
    assert checkpoint_diff(str(tmp_path / "a"), str(b)).values.sources[1] == "read from its audit (6 tensors)"
    rehashed = checkpoint_diff(str(tmp_path / "a"), str(b), use_audits=False).values
    assert rehashed is not None and rehashed.differ == (("big", "big"),)
    assert rehashed.sources[1].startswith("hashed (6 tensors, ")


def test_an_audit_without_digests_is_not_used(tmp_path: Path) -> None:
    write_model(tmp_path / "a", model(), {})
    b = converted(tmp_path, tmp_path / "a", "b", digest="none")
    result = checkpoint_diff(str(tmp_path / "a"), str(b))
    assert result.values is not None and not result.differs
    assert result.values.sources[1].endswith(
        "; its audit is not used: its audit records no digest for some tensors (apply --digest none)")


def test_audits_of_two_algorithms(tmp_path: Path) -> None:
    """A's audit records sha256, B's BLAKE3: the comparison takes sha256 from A's audit and
    hashes B, saying why."""
    write_model(tmp_path / "src", model(), {})
    a = converted(tmp_path, tmp_path / "src", "a", digest="sha256")
    b = converted(tmp_path, tmp_path / "src", "b", shard="1KB")
    result = checkpoint_diff(str(a), str(b))
    assert result.values is not None and not result.differs
    assert result.values.algorithm == "sha256"
    assert result.values.sources[0] == "read from its audit (6 tensors)"
    assert result.values.sources[1].endswith("; its audit records blake3, the other side's sha256")


def test_tensors_structural_ops_move_are_said_not_compared(tmp_path: Path, run_cli: RunCli) -> None:
    a = model()
    write_model(tmp_path / "a", a, {})
    write_model(tmp_path / "b", a | {"layers.0.w": a["layers.0.w"].t()})
    proc = run_cli("diff", tmp_path / "a", tmp_path / "b")
    assert proc.returncode == 1, proc.stderr
    assert ("{transpose: [0, 1]}: 'layers.{L}.w' -> 'layers.{L}.w' explains 1 keys of A, 1 of B\n"
            "1 tensors of A that structural ops move: values not compared (--emit-rules applies the ops and "
            "compares the result with B)\n") in proc.stdout
    assert "5 keys in both with the same shape and dtype: 5 hold the same bytes\n" in proc.stdout


def test_values_compare_across_formats(tmp_path: Path) -> None:
    """A ``pytorch_model.bin`` and a safetensors file of the same tensors are equal; a
    tensor changed in the .bin is named."""
    tensors = model()
    (tmp_path / "bin").mkdir()
    torch.save(tensors, tmp_path / "bin" / "pytorch_model.bin")
    write_model(tmp_path / "st", tensors, {})
    result = checkpoint_diff(str(tmp_path / "bin"), str(tmp_path / "st"), jobs=4)
    assert result.values is not None and not result.differs and result.values.compared == 6
    changed = tensors | {"norm.weight": tensors["norm.weight"] + 1}
    torch.save(changed, tmp_path / "bin" / "pytorch_model.bin")
    result = checkpoint_diff(str(tmp_path / "bin"), str(tmp_path / "st"), jobs=4)
    assert result.values is not None and result.values.differ == (("norm.weight", "norm.weight"),)


@pytest.mark.parametrize(("damage", "why"), [
    (lambda out: (out / AUDIT_FILE).write_text((out / AUDIT_FILE).read_text() + "not json\n"),
     "its audit cannot be read ("),
    (lambda out: save_file(model() | {"count": torch.arange(5, dtype=torch.int32)}, str(out / "model.safetensors")),
     "its audit describes tensor 'count' otherwise than its header"),
])
def test_an_audit_that_does_not_describe_the_checkpoint_is_not_used(tmp_path: Path, damage: Callable[[Path], object],
                                                                   why: str) -> None:
    write_model(tmp_path / "a", model(), {})
    b = converted(tmp_path, tmp_path / "a", "b", shard="100MB")
    damage(b)
    result = checkpoint_diff(str(tmp_path / "a"), str(b))
    assert result.values is not None and result.values.sources[1].startswith("hashed (")
    assert f"; its audit is not used: {why}" in result.values.sources[1]
