"""Fuzzing the record layer of every source reader (issue 37): checkpoints written by the
tools' own writers (``dcp.save``, Megatron's ``common.pt`` through ``torch.save``, Meta's
``consolidated.NN.pth``, ``safetensors``, gguf-py's ``GGUFWriter``), then damaged: truncated,
bytes flipped, a zip member re-stored deflated to inflate, a pickle replaced by a deeply
nested or self-referencing one, a GGUF header's counts, lengths, type ids and offsets
changed or its arrays nested. Whatever the damage, opening the source, reading its config and
every tensor either succeeds or raises ckptxform's own error (``CkptxformError``): never an
internal one. Seeded and bounded (a few hundred cases, a few seconds).
"""

from __future__ import annotations

import io
import json
import pickle
import random
import shutil
import struct
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptxform.errors import CkptxformError
from ckptxform.sources.resolve import open_location

torch = pytest.importorskip("torch")


def _dcp(root: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    state = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16),
             "step": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(root))
    return root


def _torch_dist(root: Path) -> Path:
    import argparse

    iteration = _dcp(root / "iter_0000001")
    (iteration / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    args = argparse.Namespace(num_layers=2, hidden_size=4, ffn_hidden_size=8, params_dtype=torch.bfloat16,
                              rotary_base=10000.0, names=["a", "b"])
    torch.save({"args": args, "iteration": 1}, iteration / "common.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    return root


def _pth(root: Path) -> Path:
    root.mkdir(parents=True)
    torch.save({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "n": torch.ones(3)}, root / "model.pth")
    return root / "model.pth"


def _model_parallel(root: Path) -> Path:
    root.mkdir(parents=True)
    for rank in range(2):
        torch.save({"wq.weight": torch.full((2, 4), 2.0), "norm.weight": torch.ones(4)},
                   root / f"consolidated.0{rank}.pth")
    (root / "params.json").write_text(json.dumps({"dim": 4, "n_heads": 1, "n_layers": 1}))
    return root


def _safetensors(root: Path) -> Path:
    from safetensors.torch import save_file

    root.mkdir(parents=True)
    save_file({"w": torch.ones(2, 3), "v": torch.zeros(4, dtype=torch.bfloat16)}, str(root / "model.safetensors"))
    (root / "config.json").write_text('{"hidden_size": 4}')
    return root


def _gguf(root: Path) -> Path:
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    root.mkdir(parents=True)
    writer = GGUFWriter(root / "m.gguf", "llama")
    writer.add_block_count(1)
    writer.add_rope_freq_base(10000.0)
    writer.add_token_list(["a", "bb", "ccc"])
    writer.add_array("x.ints", [1, 2, 3])
    writer.add_array("x.nested", [[1, 2], [3]])
    writer.add_tensor("a.weight", np.arange(32, dtype=np.float32).reshape(4, 8))
    writer.add_tensor("b.weight", np.ones(8, dtype=np.float16))
    q8 = quants.quantize(np.ones((2, 32), dtype=np.float32), GGMLQuantizationType.Q8_0)
    writer.add_tensor("c.weight", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return root / "m.gguf"


BUILDERS: dict[str, Callable[[Path], Path]] = {"dcp": _dcp, "torch_dist": _torch_dist, "pth": _pth,
                                               "model_parallel": _model_parallel, "safetensors": _safetensors,
                                               "gguf": _gguf}


def _open_and_read_all(location: Path) -> None:
    with open_location(str(location)) as ckpt:
        for name in ("config.json", "common.pt", "params.json"):
            try:
                ckpt.config(name)
            except CkptxformError:
                pass
        for key in list(ckpt.tensors):
            ckpt.read(ckpt.tensors[key])


# ---------------------------------------------------------------- damage


def _truncate(blob: bytes, rng: random.Random) -> bytes:
    return blob[:rng.randrange(len(blob))]


def _flip(blob: bytes, rng: random.Random) -> bytes:
    data = bytearray(blob)
    for _ in range(rng.randint(1, 4)):
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    return bytes(data)


def _deep_pickle(depth: int) -> bytes:
    """A pickle of a list nested ``depth`` deep, built by opcodes (pickle.dumps would recurse)."""
    return b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."


def _self_pickle() -> bytes:
    loop: list[Any] = []
    loop.append(loop)
    return pickle.dumps({"args": loop, "state_dict_metadata": loop, "loop": loop}, protocol=2)


def _rezip(blob: bytes, rng: random.Random, *, nest: bool) -> bytes | None:
    """The zip archive ``blob`` written again: its pickle nested or looped (``nest``), or a
    member deflated (stored records must stay stored, an inflated one bounded)."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(blob))
        members = [(info, archive.read(info)) for info in archive.infolist()]
    except zipfile.BadZipFile:
        return None
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as new:
        for info, data in members:
            kind = zipfile.ZIP_STORED
            if info.filename.endswith("data.pkl") and nest:
                data = _deep_pickle(rng.choice((50, 5000, 200_000))) if rng.random() < 0.6 else _self_pickle()
            elif not nest and rng.random() < 0.5:
                kind = zipfile.ZIP_DEFLATED
            new.writestr(info.filename, data, compress_type=kind)
    return out.getvalue()


def _zip_flags(blob: bytes, rng: random.Random) -> bytes:
    """Every zip header's flags or compression method changed (an "encrypted" flag, a
    deflated or unknown method over stored bytes), lengths unchanged."""
    data = bytearray(blob)
    field, value = rng.choice(((6, 1), (8, 8), (8, 12), (8, 99)))  # local header offsets; +2 in the central one
    for magic, at in ((b"PK\x03\x04", field), (b"PK\x01\x02", field + 2)):
        start = data.find(magic)
        while start >= 0:
            if start + at + 2 <= len(data):
                data[start + at:start + at + 2] = struct.pack("<H", value)
            start = data.find(magic, start + 4)
    return bytes(data)


def _damaged_metadata(blob: bytes, rng: random.Random) -> bytes:
    """A DCP ``.metadata`` whose objects (torch's classes, loaded trusted: the test's own
    file) are changed where the record layer reads them: a storage entry or a chunk that
    is not a record, a self-referencing list, a key with a lone surrogate."""
    meta = pickle.loads(blob)
    storage, tensors = meta.storage_data, meta.state_dict_metadata
    index = rng.choice(list(storage))
    key = rng.choice(list(tensors))
    loop: list[Any] = []
    loop.append(loop)
    choice = rng.randrange(7)
    if choice == 0:
        storage[index] = rng.choice(("__0_0.distcp", 7, None, loop))
    elif choice == 1 and hasattr(tensors[key], "chunks"):
        tensors[key].chunks = rng.choice(([7], ["x"], loop, 5, [loop]))
    elif choice == 2 and hasattr(tensors[key], "chunks"):
        tensors[key].chunks[0].offsets = rng.choice((loop, "ab", (1.5,), (-1,) * len(tensors[key].size)))
    elif choice == 3:
        tensors["\udc80" + key] = tensors.pop(key)
    elif choice == 4:
        storage[index].relative_path = rng.choice((loop, 3, "\udc80", "a\x00b"))
    elif choice == 5:
        storage[index].offset = rng.choice((loop, -5, 2 ** 70, 1.5))
    else:
        meta.storage_data = rng.choice((loop, "x", {index: loop}))
    return pickle.dumps(meta)


def _damaged_common(path: Path, rng: random.Random) -> None:
    """Megatron's common.pt written again by torch.save with a hostile args value."""
    import argparse

    loop: list[Any] = []
    loop.append(loop)
    value = rng.choice((float("nan"), float("inf"), -float("inf"), loop, [1, [2, loop]], "\udc80", 10 ** 5000,
                        {"a": loop}))
    args = argparse.Namespace(num_layers=2, hidden_size=4, bad=value)
    torch.save({"args": args, "iteration": 1}, path)


def _gguf_header_numbers(path: Path) -> list[tuple[int, int]]:
    """(offset, width) of every count, length, type id, dim and offset of a GGUF header,
    found by gguf-py's reader on the undamaged file."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    base = reader.data.__array_interface__["data"][0]
    found = set()
    for field in [*reader.fields.values(), *(t.field for t in reader.tensors)]:
        for part in field.parts:
            if part.dtype.kind == "u" and part.dtype.itemsize in (4, 8):
                at = part.__array_interface__["data"][0] - base
                found.update((at + i * part.dtype.itemsize, part.dtype.itemsize) for i in range(part.size))
    return sorted(found)


def _gguf_numbers_changed(path: Path, blob: bytes, rng: random.Random) -> bytes:
    data = bytearray(blob)
    at, width = rng.choice(_gguf_header_numbers(path))
    was = int.from_bytes(blob[at:at + width], "little")
    value = rng.choice((0, 1, 3, 13, was + 1, was - 1, was + 7, was + 31, 2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 40,
                        2 ** 62, 2 ** 63, 2 ** 64 - 1))
    data[at:at + width] = (value % 2 ** (8 * width)).to_bytes(width, "little")
    return bytes(data)


def _gguf_nested_array(depth: int, item: int = 4) -> bytes:
    """A GGUF v3 whose one key holds an array of arrays ``depth`` deep (innermost of value type ``item``)."""
    key = b"x.deep"
    body = struct.pack("<Q", len(key)) + key + struct.pack("<I", 9)
    body += struct.pack("<IQ", 9, 1) * (depth - 1) + struct.pack("<IQ", item, 1) + struct.pack("<I", 7)
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + body


def _damage_gguf(path: Path, blob: bytes, how: str, rng: random.Random) -> bool:
    if how in ("inflate", "record", "zip"):
        path.write_bytes(_gguf_numbers_changed(path, blob, rng))
    elif how == "nest":
        path.write_bytes(_gguf_nested_array(rng.choice((2, 17, 5000, 100_000)), rng.choice((4, 8, 13, 99))))
    else:
        return False
    return True


def _damage(path: Path, rng: random.Random) -> None:
    blob = path.read_bytes()
    how = rng.choice(("truncate", "flip", "flip", "inflate", "nest", "zip", "record"))
    if path.suffix == ".gguf" and _damage_gguf(path, blob, how, rng):
        return
    if how == "zip" and blob[:2] == b"PK":
        path.write_bytes(_zip_flags(blob, rng))
        return
    if how == "record" and path.name == ".metadata":
        path.write_bytes(_damaged_metadata(blob, rng))
        return
    if how == "record" and path.name == "common.pt":
        _damaged_common(path, rng)
        return
    if how in ("inflate", "nest") and blob[:2] == b"PK":
        changed = _rezip(blob, rng, nest=how == "nest")
        if changed is not None:
            path.write_bytes(changed)
            return
    if how == "nest" and path.name == ".metadata":
        path.write_bytes(_deep_pickle(rng.choice((50, 5000, 200_000))) if rng.random() < 0.6 else _self_pickle())
        return
    path.write_bytes(_truncate(blob, rng) if how == "truncate" else _flip(blob, rng))


def _record_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in ("", ".distcp", ".pt", ".pth",
                                                                             ".safetensors", ".metadata", ".gguf"))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    built = {}
    for kind, build in BUILDERS.items():
        root = tmp_path_factory.mktemp(kind)
        location = build(root / "src")
        _open_and_read_all(location)  # undamaged: reads whole
        built[kind] = (root / "src", location)
    return built


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_no_damaged_record_reaches_an_internal_error(kind: str, pristine: dict[str, tuple[Path, Path]],
                                                     tmp_path: Path) -> None:
    source, location = pristine[kind]
    rng = random.Random(f"record-fuzz-{kind}")
    for case in range({"model_parallel": 25, "gguf": 200}.get(kind, 50)):
        work = tmp_path / str(case)
        shutil.copytree(source, work)
        target = rng.choice(_record_files(work))
        _damage(target, rng)
        try:
            _open_and_read_all(work / location.relative_to(source))
        except CkptxformError:
            pass
        except Exception as exc:  # noqa: BLE001 - the failure this test exists to find
            pytest.fail(f"case {case}: {target.relative_to(work)} damaged: internal {type(exc).__name__}: {exc}"[:600])
        shutil.rmtree(work)
