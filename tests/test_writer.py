"""The output writer: layout, safetensors loadability, hashes, atomic directory, lock, I/O errors."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import reference_digest
from loguru import logger
from safetensors import safe_open
from safetensors.torch import load_file

from ckptxform.tensor_digest import DIGESTS
from ckptxform.dtypes import from_torch_dtype
from ckptxform.engine.plan.layout import OutputLayout, OutputTensorSpec, plan_layout
from ckptxform.engine.output.outdir import OutputDir
from ckptxform.engine.run.writer import ShardWriter, write_index
from ckptxform.quant.pipeline import then_in_order
from ckptxform.errors import CkptxformError, OutputError, PlanError, UsageError

MiB = 1 << 20


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def spec_of(key: str, t: torch.Tensor) -> OutputTensorSpec:
    return OutputTensorSpec(key, from_torch_dtype(t.dtype), tuple(t.shape))


# Mixed dtypes in an order that leaves later tensors unaligned (3 BF16 = 6 bytes before
# an F32), a scalar, an empty tensor and bools: all must load.
def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "layers.0.norm.weight": torch.randn(3, generator=g).to(torch.bfloat16),
        "fc.weight": torch.randn(4, 6, generator=g),
        "scale": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 5, dtype=torch.float16),
        "t2d": torch.tensor([True, False, True]),
        "d2t": torch.arange(7, dtype=torch.int64) * 3,
        "fp8": torch.randn(5, generator=g).to(torch.float8_e4m3fn),
    }


def write_all(out: Path, tensors: dict[str, torch.Tensor], *, max_shard_size: int | None = None,
              chunk: int = 5, force: bool = False) -> tuple[OutputLayout, dict[str, str]]:
    layout = plan_layout([spec_of(k, t) for k, t in tensors.items()], max_shard_size=max_shard_size)
    with OutputDir(out, force=force) as od:
        with ShardWriter(od, layout) as shards:
            for key, t in tensors.items():
                data = tensor_bytes(t)
                for i in range(0, len(data), chunk):
                    shards.write(key, data[i : i + chunk])
                shards.finish_tensor(key)
        digests = {key: shards.digest(key) for key in tensors}
        od.commit()
    return layout, digests


def mark_as_earlier_output(out: Path, files: list[str]) -> None:
    """Give ``out`` the audit log of a completed run writing ``files``: what makes it an
    earlier output of ckptxform, the only kind --force replaces."""
    (out / "ckptxform_audit.jsonl").write_text(json.dumps({"event": "run"}) + "\n" + json.dumps(
        {"event": "summary", "status": "ok", "files": files}) + "\n")


def siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name != out.name)


def run_script(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args],
                          capture_output=True, text=True, timeout=60)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# --- layout ---------------------------------------------------------------------------

def u8(key: str, n: int) -> OutputTensorSpec:
    return OutputTensorSpec(key, "U8", (n,))


def shard_keys(layout: OutputLayout) -> list[list[str]]:
    return [[p.spec.key for p in s.tensors] for s in layout.shards]


def test_layout_packs_greedily_in_order_and_exact_fit_stays_in_one_shard() -> None:
    layout = plan_layout([u8("a", 40), u8("b", 60), u8("c", 1), u8("d", 99)], max_shard_size=100)
    assert shard_keys(layout) == [["a", "b"], ["c", "d"]]
    assert [s.file for s in layout.shards] == ["model-00001-of-00002.safetensors",
                                                 "model-00002-of-00002.safetensors"]
    assert layout.index_file == "model.safetensors.index.json"
    assert layout.total_bytes == 200


def test_layout_splits_when_one_more_byte_would_pass_the_limit() -> None:
    layout = plan_layout([u8("a", 40), u8("b", 61)], max_shard_size=100)
    assert shard_keys(layout) == [["a"], ["b"]]


def test_layout_gives_an_oversized_tensor_its_own_shard_without_reordering() -> None:
    layout = plan_layout([u8("a", 10), u8("big", 500), u8("none", 0), u8("b", 10)], max_shard_size=100)
    assert shard_keys(layout) == [["a"], ["big"], ["none", "b"]]
    assert layout.shards[2].file == "model-00003-of-00003.safetensors"
    assert shard_keys(plan_layout([u8("big", 500)], max_shard_size=100)) == [["big"]]


def test_layout_single_shard_uses_file_name_and_offsets_follow_the_header() -> None:
    layout = plan_layout([u8("a", 3), OutputTensorSpec("b", "F32", (2, 2))], max_shard_size=None,
                         file_name="drafter.safetensors")
    (shard,) = layout.shards
    assert shard.file == "drafter.safetensors" and layout.index_file is None
    header_len = int.from_bytes(shard.header[:8], "little")
    assert header_len % 8 == 0 and len(shard.header) == 8 + header_len
    assert [p.offset for p in shard.tensors] == [len(shard.header), len(shard.header) + 3]
    assert shard.file_nbytes == len(shard.header) + 3 + 16
    header = json.loads(shard.header[8:])
    assert list(header) == ["__metadata__", "a", "b"]
    assert header["b"] == {"dtype": "F32", "shape": [2, 2], "data_offsets": [3, 19]}


def test_layout_sharded_names_derive_from_the_file_name_stem() -> None:
    layout = plan_layout([u8("a", 8), u8("b", 8)], max_shard_size=8, file_name="drafter.safetensors")
    assert [s.file for s in layout.shards] == ["drafter-00001-of-00002.safetensors",
                                                 "drafter-00002-of-00002.safetensors"]
    assert layout.index_file == "drafter.safetensors.index.json"


def test_the_index_of_a_layout_is_the_index_json_of_json_dump_byte_for_byte(tmp_path: Path) -> None:
    # keys out of order across shards and within one, escapes and non-ASCII, a zero-size one
    keys = ["z.w", "b\"quote", "a.\u00e9t\u00e9", "m\\back", "a.0", "\u4e2d.w", "ctl\x01", "A.w", "y"]
    layout = plan_layout([u8(key, 7 * (i % 3)) for i, key in enumerate(keys)], max_shard_size=10)
    assert len(layout.shards) > 2 and layout.index_file is not None
    expected = json.dumps(layout.index_json(), indent=2) + "\n"
    assert json.loads(expected)["weight_map"] == {p.spec.key: s.file for s in layout.shards for p in s.tensors}
    assert [key for key, _ in layout.keys_with_files()] == sorted(keys)
    out = tmp_path / "out"
    out.mkdir()
    write_index(SimpleNamespace(tmp_path=out, out=out), layout)  # what ShardWriter.close writes
    assert (out / layout.index_file).read_text(encoding="utf-8") == expected


def test_the_index_written_a_key_at_a_time_is_json_dump_s_byte_for_byte(tmp_path: Path) -> None:
    """The commit's index (engine/output/index_file.py): the keys handed over in order."""
    from ckptxform.engine.output.index_file import IndexFile

    keys = ["z.w", "b\"quote", "a.\u00e9t\u00e9", "m\\back", "a.0", "\u4e2d.w", "ctl\x01", "A.w", "y"]
    layout = plan_layout([u8(key, 7 * (i % 3)) for i, key in enumerate(keys)], max_shard_size=10)
    for tested in (layout, plan_layout([], max_shard_size=10)):
        index = IndexFile(tmp_path / "index.json", tested.total_bytes)
        for key, file in tested.index_json()["weight_map"].items():
            index.add(key, file)
        index.close()
        assert (tmp_path / "index.json").read_text() == json.dumps(tested.index_json(), indent=2) + "\n"


def test_layout_rejects_duplicate_and_reserved_keys_and_bad_limits() -> None:
    with pytest.raises(PlanError, match="output tensor 'a' is produced twice"):
        plan_layout([u8("a", 1), u8("a", 2)], max_shard_size=None)
    with pytest.raises(PlanError, match="'__metadata__' is reserved"):
        u8("__metadata__", 1)
    with pytest.raises(PlanError, match="unknown dtype 'F12'"):
        OutputTensorSpec("a", "F12", (1,))
    with pytest.raises(UsageError, match="max_shard_size must be positive, got 0"):
        plan_layout([u8("a", 1)], max_shard_size=0)
    with pytest.raises(UsageError, match="must be a plain name ending in '.safetensors'"):
        plan_layout([u8("a", 1)], max_shard_size=None, file_name="model.bin")


# --- what gets written ----------------------------------------------------------------

def test_single_file_loads_bit_exact_with_safe_open_and_load_file(tmp_path: Path) -> None:
    tensors = sample_tensors()
    out = tmp_path / "out"
    write_all(out, tensors)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    loaded = load_file(out / "model.safetensors")
    assert set(loaded) == set(tensors)
    for key, t in tensors.items():
        assert loaded[key].dtype == t.dtype and loaded[key].shape == t.shape
        assert tensor_bytes(loaded[key]) == tensor_bytes(t), key
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == set(tensors)
        assert tensor_bytes(f.get_tensor("fc.weight")) == tensor_bytes(tensors["fc.weight"])
        assert torch.equal(f.get_slice("d2t")[2:4], tensors["d2t"][2:4])


def test_sharded_output_has_a_correct_index_and_every_shard_loads(tmp_path: Path) -> None:
    tensors = sample_tensors()
    out = tmp_path / "out"
    layout, _ = write_all(out, tensors, max_shard_size=64)
    assert len(layout.shards) > 2
    index = json.loads((out / "model.safetensors.index.json").read_text())
    expected_files = {p.name for p in out.glob("*.safetensors")}
    assert index["metadata"] == {"total_size": sum(len(tensor_bytes(t)) for t in tensors.values())}
    assert set(index["weight_map"]) == set(tensors)
    assert set(index["weight_map"].values()) == expected_files
    for key, t in tensors.items():
        with safe_open(out / index["weight_map"][key], "pt") as f:
            assert tensor_bytes(f.get_tensor(key)) == tensor_bytes(t), key
    for shard in layout.shards:
        assert (out / shard.file).stat().st_size == shard.file_nbytes
        assert sum(t.nbytes for t in load_file(out / shard.file).values()) <= max(
            64, max(p.nbytes for p in shard.tensors))


def test_empty_layout_writes_a_loadable_file(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_all(out, {})
    assert load_file(out / "model.safetensors") == {}


@pytest.mark.parametrize("algorithm", DIGESTS)
def test_digests_match_the_reference_for_large_small_and_reused_buffer_chunks(algorithm: str,
                                                                              tmp_path: Path) -> None:
    big = os.urandom(5 * MiB + 123)
    layout = plan_layout([u8("big", len(big)), u8("reused", len(big))], max_shard_size=None)
    with OutputDir(tmp_path / "out") as od:
        with ShardWriter(od, layout, algorithm=algorithm) as shards:
            # large chunks are hashed from memory as written, the odd small one read back inline
            shards.write("big", big[: 2 * MiB])
            shards.write("big", memoryview(big)[2 * MiB : 2 * MiB + 100])
            shards.write("big", big[2 * MiB + 100 :])
            shards.finish_tensor("big")
            assert shards.digest("big") == reference_digest(algorithm, big)
            # a writable buffer refilled after each write must still hash what was written
            buf = bytearray(2 * MiB)
            for i in range(0, len(big), len(buf)):
                n = min(len(buf), len(big) - i)
                buf[:n] = big[i : i + n]
                shards.write("reused", memoryview(buf)[:n])
                buf[:] = b"\xff" * len(buf)
            shards.finish_tensor("reused")
            assert shards.digest("reused") == reference_digest(algorithm, big)
            assert shards.bytes_written == 2 * len(big)
        od.commit()
    data = (tmp_path / "out" / "model.safetensors").read_bytes()
    start = layout.placement("big").offset
    assert data[start : start + len(big)] == big
    assert data[start + len(big) :] == big


def _refuse_across_filesystems(*args: object) -> int:
    raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))


@pytest.mark.parametrize(("kernel", "algorithm"), [("copy_file_range", "blake3"), ("copy_file_range", "sha256"),
                                                   ("EXDEV", "blake3"), ("absent (macOS)", "blake3"),
                                                   ("absent, and no preadv", "sha256")])
def test_kernel_copies_land_in_place_and_hash_what_was_copied(kernel: str, algorithm: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # several tensors from two source files, one copied in two parts, one mixed with writes:
    # hashing runs on other threads after copy_runs returns and must still follow byte order.
    # Where the kernel cannot copy (another filesystem, no copy_file_range), a buffer does.
    if kernel == "EXDEV":
        monkeypatch.setattr(os, "copy_file_range", _refuse_across_filesystems)
    elif kernel.startswith("absent"):
        monkeypatch.delattr(os, "copy_file_range")
    if kernel.endswith("no preadv"):
        monkeypatch.delattr(os, "preadv")
    a, b = os.urandom(3 * MiB + 7), os.urandom(2 * MiB + 1)
    (tmp_path / "a.bin").write_bytes(b"HEAD" + a)
    (tmp_path / "b.bin").write_bytes(b)
    tensors = {"x": a, "y": b[:MiB], "z": b[MiB:] + a[:5], "w": a[1:]}
    layout = plan_layout([u8(k, len(v)) for k, v in tensors.items()], max_shard_size=4 * MiB)
    with OutputDir(tmp_path / "out") as od:
        with ShardWriter(od, layout, algorithm=algorithm) as shards:
            shards.copy_runs("x", tmp_path / "a.bin", [(4, MiB)])
            shards.copy_runs("x", tmp_path / "a.bin", [(4 + MiB, len(a) - MiB)])
            shards.copy_runs("y", tmp_path / "b.bin", [(0, MiB)])
            shards.copy_runs("z", tmp_path / "b.bin", [(MiB, len(b) - MiB)])
            shards.write("z", a[:5])
            shards.write("w", a[1:MiB])
            shards.copy_runs("w", tmp_path / "a.bin", [(4 + MiB, len(a) - MiB)])
            for key in tensors:
                shards.finish_tensor(key)
        od.commit()
    assert {k: shards.digest(k) for k in tensors} == {k: reference_digest(algorithm, v) for k, v in tensors.items()}
    for key, value in tensors.items():
        with safe_open(tmp_path / "out" / layout.placement(key).file, "pt") as f:
            assert tensor_bytes(f.get_tensor(key)) == value, key


@pytest.mark.parametrize("algorithm", DIGESTS)
def test_a_tensor_hashed_on_every_core_has_the_one_call_digest(algorithm: str, tmp_path: Path) -> None:
    """From PARALLEL_MIN bytes on BLAKE3 hashes a tensor on every core, a few MiB per
    update: the digest is still the reference's of the bytes (audits verify either way),
    written in uneven chunks and copied alike."""
    from ckptxform.tensor_digest import PARALLEL_MIN

    data = os.urandom(PARALLEL_MIN + 12345)
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 7 + data)
    layout = plan_layout([u8("w", len(data)), u8("c", len(data))], max_shard_size=None)
    with OutputDir(tmp_path / "out") as od:
        with ShardWriter(od, layout, algorithm=algorithm) as shards:
            for i in range(0, len(data), 3 * MiB + 1):
                shards.write("w", data[i:i + 3 * MiB + 1])
            shards.finish_tensor("w")
            shards.copy_runs("c", src, [(7, len(data))])
            shards.finish_tensor("c")
        od.commit()
    assert shards.digest("w") == shards.digest("c") == reference_digest(algorithm, data)


def test_a_source_truncated_under_a_copy_is_one_clear_error_and_no_output(tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(2 * MiB))
    layout = plan_layout([u8("w", 4 * MiB)], max_shard_size=None)
    with pytest.raises(CkptxformError) as err:
        with OutputDir(tmp_path / "out") as od:
            with ShardWriter(od, layout) as shards:
                shards.copy_runs("w", src, [(0, 4 * MiB)])  # past the end of the source
                shards.finish_tensor("w")
            od.commit()
    assert "src.bin" in str(err.value) and "truncated" in str(err.value)
    assert not (tmp_path / "out").exists() and siblings(tmp_path / "out") == ["src.bin"]


@pytest.mark.parametrize("algorithm", DIGESTS)
def test_copied_bytes_are_hashed_where_they_landed_not_read_from_the_source_again(
        algorithm: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The digest is of the bytes in the output: a source cut short (or rewritten) after
    its range was copied changes nothing the writer records (the run's pin check reports
    the source: test_trust_output.py), and a copy of several pieces hashes them in order."""
    import ckptxform.engine.run.writer as writer

    monkeypatch.setattr(writer, "_COPY_PIECE", MiB)  # 3.5 pieces
    data = os.urandom(3 * MiB + MiB // 2)
    src = tmp_path / "src.bin"
    src.write_bytes(b"head" + data)
    real_copy = writer.KernelCopier.copy
    copies = []

    def copy_then_cut(*args: object) -> int:
        cloned = real_copy(*args)  # type: ignore[arg-type]
        copies.append(args)
        if len(copies) == 4:  # the last piece is copied: nothing of the source is left to read
            os.truncate(src, 0)
        return cloned

    monkeypatch.setattr(writer.KernelCopier, "copy", copy_then_cut)
    layout = plan_layout([u8("w", len(data))], max_shard_size=None)
    with OutputDir(tmp_path / "out") as od:
        with ShardWriter(od, layout, algorithm=algorithm) as shards:
            shards.copy_runs("w", src, [(4, len(data))])
            shards.finish_tensor("w")
        od.commit()
    assert len(copies) == 4
    assert shards.digest("w") == reference_digest(algorithm, data)
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert tensor_bytes(f.get_tensor("w")) == data


@pytest.mark.parametrize("chunk", [MiB, 32 << 10])
def test_an_output_cut_short_under_the_run_is_one_clear_error_and_no_output(
        chunk: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The output must hold what was written: a file cut short under the run is an error
    naming it, not a digest of less (nor SIGBUS); whether the tensor was hashed from memory
    as it was written (a large chunk) or is read back to be hashed (small chunks): the
    file's size is checked when the tensor is finished."""
    import ckptxform.engine.run.writer as writer

    monkeypatch.setattr(writer, "_HASH_WINDOW", 1 << 40)  # read back only when the tensor is finished
    layout = plan_layout([u8("w", MiB)], max_shard_size=None)
    data = os.urandom(MiB)
    with pytest.raises(OutputError) as err:
        with OutputDir(tmp_path / "out") as od:
            with ShardWriter(od, layout) as shards:
                for at in range(0, MiB, chunk):
                    shards.write("w", data[at:at + chunk])
                os.truncate(od.tmp_path / "model.safetensors", MiB // 2)
                shards.finish_tensor("w")
            od.commit()
    assert str(err.value) == (f"checking {str(tmp_path / 'out' / 'model.safetensors')!r} failed: the file "
                              "is shorter than what was written to it; check the output directory or choose "
                              "another --out")
    assert not (tmp_path / "out").exists() and siblings(tmp_path / "out") == []


@pytest.mark.parametrize("algorithm", DIGESTS)
def test_copy_runs_places_scattered_runs_in_order(algorithm: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A row gather's runs: short ones batched into pieces, a long one split, in order."""
    import ckptxform.engine.run.writer as writer

    monkeypatch.setattr(writer, "_COPY_PIECE", 64 << 10)
    src = tmp_path / "rows.bin"
    data = os.urandom(MiB)
    src.write_bytes(data)
    runs = [(7 * 4096, 4096), (0, 100), (500_000, 200_000), (3, 1), (900_000, 30_000)] * 3
    want = b"".join(data[offset:offset + length] for offset, length in runs)
    layout = plan_layout([u8("rows", len(want)), u8("after", 3)], max_shard_size=None)
    with OutputDir(tmp_path / "out") as od:
        with ShardWriter(od, layout, algorithm=algorithm) as shards:
            shards.copy_runs("rows", src, runs)
            shards.finish_tensor("rows")
            shards.write("after", b"xyz")
            shards.finish_tensor("after")
        od.commit()
    assert shards.digest("rows") == reference_digest(algorithm, want)
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert tensor_bytes(f.get_tensor("rows")) == want
        assert tensor_bytes(f.get_tensor("after")) == b"xyz"


# --- a tensor's blocks written in order from several threads (quant/pipeline.py then_in_order) ---

def _block_tasks(data: bytes, size: int) -> Iterator[Callable[[], np.ndarray]]:
    """``data`` as tasks each making a new array of ``size`` bytes (a decoded block)."""
    for at in range(0, len(data), size):
        yield lambda at=at: np.frombuffer(data[at:at + size], dtype=np.uint8).copy()


@pytest.mark.parametrize("algorithm", DIGESTS)
def test_blocks_written_in_turn_by_the_threads_that_made_them_land_in_order(algorithm: str,
                                                                            tmp_path: Path) -> None:
    """Each block is hashed from memory and written by its own thread, after the one before
    it: the file and the digest are the bytes in order, beside a tensor the caller writes
    meanwhile (the last block short, under the from-memory size; empty tensors too)."""
    big, other = os.urandom(5 * MiB + 7), os.urandom(2 * MiB + 1)
    layout = plan_layout([u8("big", len(big)), u8("other", len(other)),
                          OutputTensorSpec("none", "F16", (0, 5))], max_shard_size=None)
    with OutputDir(tmp_path / "out") as od:
        with ShardWriter(od, layout, algorithm=algorithm) as shards:
            writing = threading.Thread(target=then_in_order,
                                       args=(_block_tasks(big, MiB + 3), lambda b: shards.write("big", b)))
            writing.start()
            shards.write("other", other)  # on the caller's thread meanwhile
            shards.finish_tensor("other")
            writing.join()
            shards.finish_tensor("big")
            then_in_order(_block_tasks(b"", MiB), lambda b: shards.write("none", b))
            shards.finish_tensor("none")
        od.commit()
    assert [shards.digest(k) for k in ("big", "other", "none")] == [
        reference_digest(algorithm, data) for data in (big, other, b"")]
    loaded = load_file(tmp_path / "out" / "model.safetensors")
    assert [loaded[k].numpy().tobytes() for k in ("big", "other")] == [big, other]
    assert loaded["none"].shape == (0, 5)


def test_a_write_error_in_a_blocks_turn_is_the_one_error_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pwrite_all = ShardWriter._pwrite_all

    def full_disk(fd: int, view: memoryview, offset: int) -> None:
        if offset < 4 * MiB:  # the header and the first blocks fit
            return pwrite_all(fd, view, offset)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ShardWriter, "_pwrite_all", staticmethod(full_disk))
    data = os.urandom(16 * MiB)
    layout = plan_layout([u8("w", len(data))], max_shard_size=None)
    out = tmp_path / "out"
    written: list[int] = []
    with pytest.raises(OutputError) as err:
        with OutputDir(out) as od:
            with ShardWriter(od, layout) as shards:
                then_in_order(_block_tasks(data, MiB), lambda b: (shards.write("w", b), written.append(len(b))))
                shards.finish_tensor("w")
            od.commit()
    assert str(err.value) == (f"writing '{out}/model.safetensors' failed: No space left on device; "
                              "free space or choose another --out")
    assert len(written) <= 4 and not out.exists() and siblings(out) == []


def test_write_json_puts_config_next_to_the_weights_and_refuses_weight_names(tmp_path: Path) -> None:
    layout = plan_layout([], max_shard_size=None)
    with OutputDir(tmp_path / "out") as od:
        with ShardWriter(od, layout) as shards:
            shards.write_json("config.json", {"architectures": ["LlamaForCausalLMEagle3"]})
            with pytest.raises(UsageError, match="cannot write 'model.safetensors' into the output"):
                shards.write_json("model.safetensors", {})
        od.commit()
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == {
        "architectures": ["LlamaForCausalLMEagle3"]}


# --- missing and extra bytes ----------------------------------------------------------

def test_short_write_is_detected_by_finish_tensor(tmp_path: Path) -> None:
    layout = plan_layout([OutputTensorSpec("lm_head.weight", "BF16", (4, 8))], max_shard_size=None)
    with OutputDir(tmp_path / "out") as od, ShardWriter(od, layout) as shards:
        shards.write("lm_head.weight", bytes(60))
        with pytest.raises(OutputError) as err:
            shards.finish_tensor("lm_head.weight")
        assert str(err.value) == "tensor 'lm_head.weight': wrote 60 bytes, expected 64 (BF16 [4, 8])"
        assert err.value.key == "lm_head.weight"
        shards.write("lm_head.weight", bytes(4))
        shards.finish_tensor("lm_head.weight")


def test_write_past_the_end_is_refused_before_touching_the_next_tensor(tmp_path: Path) -> None:
    layout = plan_layout([u8("a", 4), u8("b", 4)], max_shard_size=None)
    with OutputDir(tmp_path / "out") as od:
        with ShardWriter(od, layout) as shards:
            shards.write("b", b"BBBB")
            shards.write("a", b"AAA")
            with pytest.raises(OutputError, match=r"tensor 'a': got 5 bytes, expected 4 \(U8 \[4\]\)"):
                shards.write("a", b"AA")
            shards.write("a", b"A")
            shards.finish_tensor("a")
            shards.finish_tensor("b")
        od.commit()
    assert load_file(tmp_path / "out" / "model.safetensors")["b"].tolist() == list(b"BBBB")


def test_a_tensor_never_written_fails_close_and_leaves_no_output(tmp_path: Path) -> None:
    out = tmp_path / "out"
    layout = plan_layout([u8("fc.weight", 4), u8("norm.weight", 4), u8("lm_head.weight", 8)],
                         max_shard_size=None)
    with pytest.raises(OutputError) as err:
        with OutputDir(out) as od:
            with ShardWriter(od, layout) as shards:
                shards.write("fc.weight", bytes(4))
                shards.finish_tensor("fc.weight")
                shards.write("lm_head.weight", bytes(3))
            od.commit()
    assert str(err.value) == (
        "2 output tensor(s) were not written completely: 'lm_head.weight', 'norm.weight' "
        "('lm_head.weight' 3 of 8 bytes; 'norm.weight' 0 of 4 bytes); this is a bug in the "
        "executor, please report it")
    assert not out.exists() and siblings(out) == []


def test_writing_an_unknown_key_names_it(tmp_path: Path) -> None:
    layout = plan_layout([u8("a", 1)], max_shard_size=None)
    with OutputDir(tmp_path / "out") as od, ShardWriter(od, layout) as shards:
        with pytest.raises(OutputError, match=r"tensor 'lm_head' is not in the output layout"):
            shards.write("lm_head", b"x")
        shards.write("a", b"x")
        shards.finish_tensor("a")


# --- the atomic directory -------------------------------------------------------------

def test_exception_inside_leaves_no_output_no_temporary_and_no_lock(tmp_path: Path) -> None:
    out = tmp_path / "out"
    layout = plan_layout([u8("a", 4)], max_shard_size=None)
    with pytest.raises(RuntimeError, match="boom"):
        with OutputDir(out) as od, ShardWriter(od, layout) as shards:
            shards.write("a", b"ab")
            assert od.tmp_path.is_dir() and (od.tmp_path / "model.safetensors").exists()
            raise RuntimeError("boom")
    assert not out.exists()
    assert siblings(out) == []


def test_leaving_without_commit_discards_the_output(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with OutputDir(out) as od:
        (od.tmp_path / "x").write_text("x")
    assert not out.exists() and siblings(out) == []


def test_existing_output_is_refused_without_force_and_left_untouched(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(OutputError) as err:
        OutputDir(out).__enter__()
    assert str(err.value) == (f"'{out}' already exists and has no ckptxform_audit.jsonl, so ckptxform did not "
                              "write it; ckptxform replaces only its own earlier outputs (with --force): move it "
                              "away or choose another --out")
    assert (out / "precious.txt").read_text() == "keep me"
    assert siblings(out) == []


def test_force_replaces_the_old_output_whole(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_all(out, {"old.a": torch.ones(3), "old.b": torch.ones(3)}, max_shard_size=12)
    shards = sorted(p.name for p in out.glob("model-0000?-of-00002.safetensors"))
    assert len(shards) == 2
    mark_as_earlier_output(out, shards)
    tensors = sample_tensors()
    write_all(out, tensors, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    loaded = load_file(out / "model.safetensors")
    assert {k: tensor_bytes(v) for k, v in loaded.items()} == {k: tensor_bytes(t) for k, t in tensors.items()}
    assert siblings(out) == []


def test_force_refuses_to_replace_a_directory_holding_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "project"
    write_all(out, {"a": torch.ones(3)})
    mark_as_earlier_output(out, ["model.safetensors"])
    monkeypatch.chdir(out)  # an earlier output the user works in (a subdirectory would make it foreign)
    with pytest.raises(OutputError, match="it contains the current directory; choose another --out"):
        OutputDir(out, force=True).__enter__()
    assert sorted(p.name for p in out.iterdir()) == ["ckptxform_audit.jsonl", "model.safetensors"]


def test_output_created_by_someone_else_meanwhile_is_not_overwritten(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(OutputError, match="already exists and has no ckptxform_audit.jsonl"):
        with OutputDir(out) as od:
            (od.tmp_path / "new").write_text("new")
            out.mkdir()
            (out / "theirs").write_text("theirs")
            od.commit()
    assert [p.name for p in out.iterdir()] == ["theirs"]
    assert siblings(out) == []


def test_stale_temporaries_of_dead_runs_are_removed_and_reported(tmp_path: Path) -> None:
    out = tmp_path / "out"
    pid = dead_pid()
    stale = tmp_path / f".out.ckptxform-tmp-{pid}"
    (stale / "deep").mkdir(parents=True)
    (stale / "deep" / "model.safetensors").write_bytes(b"partial")
    live = tmp_path / f".out.ckptxform-tmp-{os.getppid()}"  # a live process other than us
    live.mkdir()
    other = tmp_path / f".other.ckptxform-tmp-{pid}"  # belongs to another OUT
    other.mkdir()
    messages: list[str] = []
    sink = logger.add(lambda m: messages.append(str(m).strip()), format="{message}")
    logger.enable("ckptxform")  # as a library ckptxform logs only when asked
    try:
        with OutputDir(out) as od:
            assert od.stale_removed == (stale,)
            od.commit()
    finally:
        logger.disable("ckptxform")
        logger.remove(sink)
    assert not stale.exists() and live.exists() and other.exists()
    assert f"removed {stale} left by a killed ckptxform run (pid {pid})" in messages


def test_an_interrupted_replacement_keeps_the_old_output_when_out_is_missing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    aside = tmp_path / f".out.ckptxform-old-{dead_pid()}.0badc0de"
    aside.mkdir()
    with OutputDir(out) as od:
        assert od.stale_removed == ()
    assert aside.exists()


LOCK_HOLDER = """
    import sys
    from ckptxform.engine.output.outdir import OutputDir
    with OutputDir(sys.argv[1]):
        print("locked", flush=True)
        sys.stdin.read()
"""


def test_a_second_run_on_the_same_output_is_refused_while_the_lock_is_held(tmp_path: Path) -> None:
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(LOCK_HOLDER), str(out)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        with pytest.raises(OutputError) as err:
            OutputDir(out).__enter__()
        assert str(err.value) == (f"another ckptxform apply is writing to '{out}' (lock held by "
                                  f"pid {holder.pid}); wait for it or choose another --out")
        # the refused run must not have touched the holder's temporary directory
        assert (tmp_path / f".out.ckptxform-tmp-{holder.pid}").is_dir()
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)
    with OutputDir(out) as od:
        od.commit()
    assert out.is_dir() and siblings(out) == []


# --- I/O errors -----------------------------------------------------------------------

WRITE_4MIB = """
    import resource, signal, sys
    from pathlib import Path
    from ckptxform.engine.plan.layout import OutputTensorSpec, plan_layout
    from ckptxform.engine.output.outdir import OutputDir
    from ckptxform.engine.run.writer import ShardWriter
    from ckptxform.errors import OutputError
    if len(sys.argv) > 2:
        # CPython ignores SIGXFSZ at startup; restore the default an embedding host may
        # have, so that only the writer's own SIG_IGN keeps the process alive
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), int(sys.argv[2])))
    layout = plan_layout([OutputTensorSpec("w", "U8", (4 << 20,))], max_shard_size=None)
    try:
        with OutputDir(Path(sys.argv[1])) as od:
            with ShardWriter(od, layout) as shards:
                for _ in range(4):
                    shards.write("w", bytes(1 << 20))
                shards.finish_tensor("w")
            od.commit()
    except OutputError as err:
        print(err)
        sys.exit(3)
"""


def test_file_size_limit_gives_a_clean_error_and_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run_script(WRITE_4MIB, str(out), str(1 << 20))
    assert result.returncode == 3, result.stderr
    assert result.stdout.strip() == (
        f"writing '{out}/model.safetensors' failed: File too large; raise the file size limit "
        "(ulimit -f) or set a smaller output.max_shard_size")
    assert "Traceback" not in result.stderr
    assert not out.exists() and siblings(out) == []


def test_full_disk_gives_a_clean_error_and_leaves_nothing(tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    mnt.mkdir()
    if not shutil.which("unshare"):
        pytest.skip("needs unshare to mount a 1 MiB tmpfs")
    script = textwrap.dedent(WRITE_4MIB)
    # A private mount namespace: the 1 MiB tmpfs is visible only to this shell.
    shell = ('mount -t tmpfs -o size=1m tmpfs "$1" || exit 99; '
             '"$2" -c "$3" "$1/out"; rc=$?; ls -A "$1"; exit $rc')
    result = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", shell,
                             "sh", str(mnt), sys.executable, script],
                            capture_output=True, text=True, timeout=60)
    if result.returncode == 99 or "unshare" in result.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    assert result.returncode == 3, result.stderr
    message, *left = result.stdout.strip().splitlines()
    assert message == (f"writing '{mnt}/out/model.safetensors' failed: No space left on device; "
                       "free space or choose another --out")
    assert left == []  # no OUT, no temporary directory, no lock file
