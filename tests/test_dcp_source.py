"""The DCP source (issue 27 item 1): a torch.distributed.checkpoint directory read without
torch, its tensors assembled from their chunks by byte range, and each bad input one clear
error with no output: a .metadata naming another class, a chunk shorter than the metadata
says, chunks that overlap or leave a gap.

Checkpoints are written by torch's own ``dcp.save``; the multi-rank ones are two real
single-process saves whose metadata is joined as a 2-rank save's is (each half a chunk at
its offset, in its own ``__R_0.distcp``), so a split along any dim can be tested here
without a process group (tests/test_dcp_torchtitan.py has real 2-rank FSDP2 saves).
"""

from __future__ import annotations

import pickle
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptxform import api
from ckptxform.errors import CheckpointFormatError
from ckptxform.sources.chunks import ChunkGrid
from ckptxform.sources.resolve import open_location


def test_chunk_grid_reads_every_byte_range_as_numpy_slices_it() -> None:
    """Random tensors cut into random grids of boxes (any dims, uneven, empty rows): every
    byte range read through the pieces equals the global tensor's bytes."""
    rng = random.Random(0)
    for _ in range(60):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 3)))
        values = np.arange(int(np.prod(shape)), dtype=np.int16).reshape(shape)
        cuts = [sorted({0, dim, *rng.sample(range(dim + 1), min(dim + 1, rng.randint(0, 2)))}) for dim in shape]
        boxes, records = [], []
        for corner in np.ndindex(*[len(c) - 1 for c in cuts]):
            offsets = tuple(cuts[d][i] for d, i in enumerate(corner))
            sizes = tuple(cuts[d][i + 1] - cuts[d][i] for d, i in enumerate(corner))
            boxes.append((offsets, sizes))
            records.append(values[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].tobytes())
        grid = ChunkGrid(shape, 2, boxes, label="t", names=[str(b) for b in boxes])
        whole = values.tobytes()
        for _ in range(10):
            start = rng.randrange(len(whole))
            length = rng.randint(0, len(whole) - start)
            out = bytearray(length)
            for p in grid.pieces(start, length):
                out[p.out:p.out + p.length] = records[p.chunk][p.at:p.at + p.length]
            assert bytes(out) == whole[start:start + length], (shape, boxes, start, length)


torch = pytest.importorskip("torch")  # the fixtures are written by torch's dcp.save


def _save(state: dict[str, Any], path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(path))


def _metadata(path: Path) -> Any:
    with open(path / ".metadata", "rb") as f:
        return pickle.load(f)  # the test's own file: torch's classes, trusted


def _write_metadata(path: Path, meta: Any) -> None:
    with open(path / ".metadata", "wb") as f:
        pickle.dump(meta, f)


def two_ranks(tmp: Path, key: str, full: Any, dim: int, at: int, *, shift: int = 0) -> Path:
    """A DCP directory where rank 0 saved ``full[:at]`` along ``dim`` and rank 1 the rest
    (its chunk placed ``shift`` further along ``dim``: an overlap or a gap)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    low, high = full.split([at, full.shape[dim] - at], dim=dim)
    out = tmp / "ckpt"
    _save({key: low.contiguous()}, out)
    _save({key: high.contiguous()}, tmp / "rank1")
    shutil.copy(tmp / "rank1" / "__0_0.distcp", out / "__1_0.distcp")
    meta, other = _metadata(out), _metadata(tmp / "rank1")
    offsets = [0] * full.dim()
    offsets[dim] = at + shift
    item = meta.state_dict_metadata[key]
    item.size = torch.Size(full.shape)
    item.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(high.shape)))
    info = next(v for k, v in other.storage_data.items() if k.fqn == key)
    info.relative_path = "__1_0.distcp"
    meta.storage_data[MetadataIndex(key, offsets)] = info
    _write_metadata(out, meta)
    return out


@pytest.mark.parametrize(("dim", "at"), [(0, 3), (1, 2), (1, 5), (2, 1)])
def test_a_tensor_split_across_rank_files_reads_as_the_whole(tmp_path: Path, dim: int, at: int) -> None:
    full = torch.randn(5, 7, 3).to(torch.bfloat16)  # odd sizes; dims 1 and 2 split rows into runs
    with open_location(str(two_ranks(tmp_path, "w", full, dim, at))) as ckpt:
        info = ckpt.tensors["w"]
        assert (info.dtype, info.shape, info.offset) == ("BF16", (5, 7, 3), -1)
        whole = full.view(torch.uint8).numpy().tobytes()
        assert ckpt.read(info) == whole
        assert ckpt.read(info, 17, 40) == whole[17:57]
        out = memoryview(bytearray(3 * info.row_nbytes))
        ckpt.read_runs_into(info, [(3, 2), (0, 1)], out, [0, 2])
        assert bytes(out) == whole[3 * info.row_nbytes:5 * info.row_nbytes] + whole[:info.row_nbytes]


def test_one_chunk_tensors_are_byte_ranges_and_pickled_objects_are_listed_unread(tmp_path: Path) -> None:
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    _save({"w": w, "scalar": torch.tensor(2.5), "step": 7, "lr_scheduler": {"last_epoch": 3},
           "optimizer": {"state": {"w": {"exp_avg": torch.ones(3, 4)}}}}, tmp_path / "c")
    with open_location(str(tmp_path / "c")) as ckpt:
        assert sorted(ckpt.tensors) == ["scalar", "w"]
        info = ckpt.tensors["w"]
        assert info.offset > 0 and ckpt.local_path(info.file) is not None  # a plain range: kernel copies
        assert ckpt.read(info) == w.numpy().tobytes()
        assert ckpt.read(ckpt.tensors["scalar"]) == np.float32(2.5).tobytes()
        unread = {u.key: u for u in ckpt.unread}
        assert sorted(unread) == ["lr_scheduler.last_epoch", "optimizer.state.w.exp_avg", "step"]
        assert unread["optimizer.state.w.exp_avg"].shape == (3, 4)
        assert "never read" in unread["step"].reason


def _refused(path: Path) -> str:
    with pytest.raises(CheckpointFormatError) as err:
        open_location(str(path))
    return str(err.value)


def test_a_metadata_pickle_naming_another_class_is_refused_by_name(tmp_path: Path) -> None:
    import os

    _save({"w": torch.ones(2)}, tmp_path / "c")
    meta = _metadata(tmp_path / "c")
    meta.planner_data = os.system  # pickled as the global posix.system: code, if it were loaded
    _write_metadata(tmp_path / "c", meta)
    message = _refused(tmp_path / "c")
    assert message.startswith(f"{tmp_path / 'c' / '.metadata'}: the pickle names 'posix.system', which a DCP "
                              ".metadata file never holds; refusing to load it"), message


def test_a_chunk_shorter_than_the_metadata_says_is_refused(tmp_path: Path) -> None:
    path = two_ranks(tmp_path, "w", torch.randn(6, 4), 0, 3)
    rank1 = path / "__1_0.distcp"
    rank1.write_bytes(rank1.read_bytes()[:-100])
    message = _refused(path)
    assert message.startswith(f"{rank1}: tensor 'w', chunk at [3, 0]: the chunk holds "), message
    assert "but the metadata says" in message and "truncated" in message


@pytest.mark.parametrize(("shift", "words"), [(-1, "overlap"), (1, "cover")])
def test_overlapping_chunks_and_a_gap_are_refused(tmp_path: Path, shift: int, words: str, run_cli: Any) -> None:
    path = two_ranks(tmp_path, "w", torch.randn(6, 4), 0, 3, shift=shift)
    if shift > 0:  # a gap: the second chunk moved past the end is outside; shrink the tensor's claim instead
        meta = _metadata(path)
        meta.state_dict_metadata["w"].size = torch.Size([7, 4])
        _write_metadata(path, meta)
    message = _refused(path)
    assert message.startswith(f"{path}: tensor 'w': "), message
    if words == "overlap":
        assert "chunks at [0, 0] (__0_0.distcp) and at [2, 0] (__1_0.distcp) overlap" in message
    else:
        assert "its chunks cover 24 of its 28 elements (shape [7, 4])" in message
    rule = tmp_path / "keep.yaml"
    rule.write_text("version: 1\nname: keep\nsources:\n  model: {example: DIR}\nconvert: model\n"
                    "tensors:\n  - key: w\n")
    done = run_cli("apply", rule, "--source", f"model={path}", "--out", tmp_path / "out")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert message in done.stderr and not (tmp_path / "out").exists()


def test_inspect_says_the_kind_and_lists_a_dcp_directory_from_its_metadata(tmp_path: Path, run_cli: Any) -> None:
    import json

    path = two_ranks(tmp_path, "w", torch.randn(6, 4), 0, 3)
    meta = _metadata(path)
    (path / "__0_0.distcp").write_bytes(b"")  # never opened: the metadata alone is listed
    done = run_cli("inspect", path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[:2] == [f"{path}: torch.distributed.checkpoint (DCP) (2 .distcp file(s))",
                                            "  w  F32   [6, 4]           __0_0.distcp +1"]
    assert meta.state_dict_metadata["w"].size == torch.Size([6, 4])
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    save = tmp_path / "megatron"
    save.mkdir()
    path.rename(save / "iter_0000020")
    (save / "latest_checkpointed_iteration.txt").write_text("20\n")
    data = json.loads(run_cli("inspect", "--json", save).stdout)
    assert (data["kind"], data["kind_detail"]) == (
        "torch_dist", f"latest iteration '20': {save / 'iter_0000020'}, 2 .distcp file(s)")
    assert [t["key"] for t in data["tensors"]] == ["w"]


def test_kinds_are_told_apart_by_file_names_alone(tmp_path: Path) -> None:
    from ckptxform.sources.kind import detect_kind

    for name, files, kind in [("meta", ["consolidated.00.pth", "consolidated.01.pth", "params.json"], "consolidated"),
                              ("hf", ["model-00001-of-00002.safetensors", "config.json"], "safetensors"),
                              ("bin", ["pytorch_model.bin"], "bin"), ("assets", ["config.json"], "assets")]:
        (tmp_path / name).mkdir()
        for file in files:
            (tmp_path / name / file).write_bytes(b"")
        assert detect_kind(tmp_path / name).kind == kind, name
    assert detect_kind(tmp_path / "meta").detail == "MP=2, params.json"


RENAME = """version: 1
name: dcp-rename
sources: {src: {path: unused}}
convert: src
tensors:
  - {key: w, to: x}
"""


@pytest.mark.parametrize(("dim", "at", "kernel"), [(0, 300, True), (1, 512, False)])
def test_a_tensor_split_across_rank_files_is_copied_by_the_kernel_from_each_chunk_file(
        tmp_path: Path, dim: int, at: int, kernel: bool) -> None:
    """An FSDP-style dim-0 split is two long byte ranges, one in each rank file: each a
    kernel copy (no trip through Python memory), as a local safetensors tensor is; a dim-1
    split is two short pieces a row, read through memory (a system call a piece would cost
    more). The output is the whole tensor either way."""
    full = torch.randn(600, 1024, generator=torch.Generator().manual_seed(3))  # rows of 4 KiB
    src = two_ranks(tmp_path, "w", full, dim, at)
    rule = tmp_path / "rename.yaml"
    rule.write_text(RENAME)
    the_plan, opened = api.plan_open(rule, sources={"src": str(src)})
    with opened:
        pieces = list(the_plan.outputs[0].recipe.local_pieces(opened))
    copies = [(path.name, offset >= 0, length) for path, offset, length in
              (p for p in pieces if isinstance(p, tuple))]
    assert copies == ([("__0_0.distcp", True, 300 * 4096), ("__1_0.distcp", True, 300 * 4096)] if kernel else [])
    api.apply(rule, out=tmp_path / "out", sources={"src": str(src)}, progress=False, fsync=False)
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "out" / "model.safetensors")["x"], full)
