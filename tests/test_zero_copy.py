"""Zero-copy outputs: on a filesystem that shares extents (XFS with reflink, btrfs) a
tensor copied unchanged is cloned, byte for byte what a copy writes, and copy-on-write.

Each filesystem is a loop-mounted image this module makes and removes itself (root, loop
devices and mkfs.xfs / mkfs.btrfs needed: skipped with the reason elsewhere).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import read_audit
from safetensors.torch import load_file, save_file

from ckptxform import api
from ckptxform.engine.output.verify import verify
from ckptxform.engine.plan.layout import CLONE_BLOCK, OutputTensorSpec, plan_layout

RULE = """version: 1
name: rename-only
sources: {src: {path: unused}}
convert: src
output: {max_shard_size: 7000000}
tensors:
  - match: 'layers\\.(.+)'
    rename: 'model.layers.\\1'
  - match: '.*'
"""
MKFS = {"xfs": ["mkfs.xfs", "-q", "-m", "reflink=1"], "btrfs": ["mkfs.btrfs", "-q"]}


def _cannot_mount(fs: str) -> str | None:
    if os.geteuid() != 0:
        return "mounting a loop filesystem needs root"
    if shutil.which(MKFS[fs][0]) is None:
        return f"{MKFS[fs][0]} is not installed (apt-get install xfsprogs btrfs-progs)"
    if not os.path.exists("/dev/loop-control"):
        return "no loop devices (/dev/loop-control)"
    return None


@pytest.fixture(params=sorted(MKFS))
def mount(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh loop-mounted filesystem of the parameter's kind, unmounted and removed after."""
    fs: str = request.param
    reason = _cannot_mount(fs)
    if reason:
        pytest.skip(reason)
    base = tmp_path_factory.mktemp(f"loop-{fs}")
    image, point = base / "image", base / "mnt"
    point.mkdir()
    with open(image, "wb") as f:
        f.truncate(512 << 20)  # sparse; XFS wants at least 300 MB
    made = subprocess.run([*MKFS[fs], str(image)], capture_output=True, text=True)
    if made.returncode:
        pytest.skip(f"{MKFS[fs][0]} failed: {made.stderr.strip()[:200]}")
    mounted = subprocess.run(["mount", "-o", "loop", str(image), str(point)], capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"mount -o loop failed: {mounted.stderr.strip()[:200]}")
    try:
        yield point
    finally:
        subprocess.run(["umount", str(point)], check=True)
        image.unlink()


def _source(root: Path) -> Path:
    """Two shards of tensors whose sizes are not whole blocks (so edges are copied too), of
    two dtypes (the library orders the F32 one first); the rule's shard size keeps each
    source shard's tensors together."""
    src = root / "src"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    weight_map = {}
    for i, names in enumerate([("a", "b", "c"), ("d", "e")]):
        tensors = {f"layers.{n}.weight": torch.randn(1000 + 7 * j, 1023, generator=g).to(torch.bfloat16)
                   for j, n in enumerate(names)}
        tensors[f"layers.{names[-1]}.norm"] = torch.randn(77, generator=g)
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file(tensors, src / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return src


def _apply(rule: Path, src: Path, out: Path) -> dict[str, int]:
    api.apply(rule, out=out, sources={"src": str(src)}, progress=False, fsync=False)
    summary = read_audit(out)[-1]
    assert summary["event"] == "summary"
    cloned: dict[str, int] = summary["cloned_bytes"]
    return cloned


def _weights(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}


def test_a_clone_is_byte_for_byte_a_copy_and_copy_on_write(mount: Path, tmp_path: Path) -> None:
    rule = tmp_path / "rename.yaml"
    rule.write_text(RULE)
    src = _source(mount)
    copied_cloned = _apply(rule, src, tmp_path / "copied")  # tmp_path: another filesystem
    os.sync()  # the filesystems count delayed allocations once they are made
    used_before = shutil.disk_usage(mount).used
    cloned = _apply(rule, src, mount / "out")
    os.sync()
    grown = shutil.disk_usage(mount).used - used_before

    copied = _weights(tmp_path / "copied")
    assert _weights(mount / "out") == copied
    # the library reads the padded headers (and tensors at their source's alignment)
    expected = {k.replace("layers.", "model.layers."): v for f in sorted(src.glob("*.safetensors"))
                for k, v in load_file(f).items()}
    got = {k: v for f in sorted((mount / "out").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    assert copied_cloned == dict.fromkeys(copied, 0)
    # every shard is lined up with its source: all but the partial blocks at a tensor's
    # edges (and one between the copy's 16 MiB pieces) is cloned
    data = sum(len(b) - 8 - int.from_bytes(b[:8], "little") for b in copied.values())
    assert set(cloned) == set(copied)
    assert all(n % CLONE_BLOCK == 0 for n in cloned.values())
    assert data - 6 * 2 * CLONE_BLOCK <= sum(cloned.values()) <= data
    assert grown < data // 4, f"the output's {data} bytes of data took {grown} more bytes of disk"
    # per tensor, the audit says how its bytes got there: cloned here, kernel-copied there
    for out, shard_cloned in ((mount / "out", cloned), (tmp_path / "copied", copied_cloned)):
        moved = [(e["file"], e["moved"]) for e in read_audit(out) if e["event"] == "written"]
        assert sum(m["written"] for _, m in moved) == 0
        assert {f: sum(m["cloned"] for g, m in moved if g == f) for f in shard_cloned} == shard_cloned
        assert sum(m["cloned"] + m["copied"] for _, m in moved) == data

    # copy-on-write: rewriting the source where it was cloned leaves OUT as it was
    for shard in sorted(src.glob("*.safetensors")):
        with open(shard, "r+b") as f:
            f.seek(CLONE_BLOCK * 4)
            f.write(os.urandom(CLONE_BLOCK * 8))
            os.fsync(f.fileno())
    assert _weights(mount / "out") == copied
    assert verify(mount / "out").tensors == 7


def test_the_layout_lines_copied_tensors_up_with_their_source_in_source_order() -> None:
    """Without a filesystem: the tensors copied unchanged lead their shard in source order,
    the header's padding puts the source giving the most bytes at its offsets modulo the
    block, and a layout without copies is the library's (8-aligned data, plan order)."""
    specs = [OutputTensorSpec("made", "F32", (3,)), OutputTensorSpec("b", "BF16", (4096,)),
             OutputTensorSpec("a", "BF16", (2048, 3)), OutputTensorSpec("c", "BF16", (5000,))]
    copied_from = {"a": ("/src/1.safetensors", 1000), "b": ("/src/1.safetensors", 1000 + 12288),
                   "c": ("/src/2.safetensors", 77)}
    layout = plan_layout(specs, max_shard_size=None, copied_from=copied_from)
    (shard,) = layout.shards
    assert [p.spec.key for p in shard.tensors] == ["a", "b", "c", "made"]
    assert [p.offset % CLONE_BLOCK for p in shard.tensors[:2]] == [1000, (1000 + 12288) % CLONE_BLOCK]
    header = json.loads(shard.header[8:])  # spaces after the JSON: still one JSON object
    assert list(header)[1:] == ["a", "b", "c", "made"]
    plain = plan_layout(specs, max_shard_size=None).shards[0]
    assert [p.spec.key for p in plain.tensors] == ["made", "b", "a", "c"] and len(plain.header) % 8 == 0


def test_without_the_digest_a_clone_reads_no_byte_and_verify_says_so(mount: Path, tmp_path: Path) -> None:
    rule = tmp_path / "rename.yaml"
    rule.write_text(RULE)
    src = _source(mount)
    _apply(rule, src, tmp_path / "copied")
    api.apply(rule, out=mount / "out", sources={"src": str(src)}, progress=False, fsync=False, digest="none")
    assert _weights(mount / "out") == _weights(tmp_path / "copied")
    written = [e for e in read_audit(mount / "out") if e["event"] == "written"]
    assert {e["digest"] for e in written} == {"none"}
    assert all(e["moved"]["cloned"] for e in written if e["key"].endswith(".weight"))  # not the 308-byte norms
    result = verify(mount / "out")
    assert (result.bytes_checked, result.bytes_unchecked) == (0, sum(e["bytes"][1] - e["bytes"][0] for e in written))
