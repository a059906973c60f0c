"""torch's zip-format state dicts indexed without torch (``ckptxform.sources.torch_zip``).

Files written by the real ``torch.save`` are indexed and read, and compared with what
``torch.load`` makes of them: the same keys in the same order, dtypes, shapes, sizes, and
each tensor's bytes at its offset in the file. Hostile archives are assembled here opcode
by opcode (no writer makes them, and torch is not needed to): each is one golden error,
and the pickled call that would run code never runs.
"""

from __future__ import annotations

import struct
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest

from ckptxform.errors import CheckpointFormatError
from ckptxform.sources.local import open_local
from ckptxform.sources.torch_zip import NeedsTorch, read_zip_state_dict

# torch's own files are written where torch is installed (skipped without it); the
# assembled ones run in CI's venv without torch too
pytestmark = pytest.mark.notorch

RESAVE = "re-save it as safetensors from a trusted environment (torch.load there, then safetensors.torch.save_file)"
DAMAGED = "the file is damaged or hostile: copy it again from where it was saved"


# ---------------------------------------------------------------- files torch.save wrote


def torch_cases() -> dict[str, object]:
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(35)
    base = torch.randn(5, 7, generator=g)
    tied = torch.randn(3, 4, generator=g)
    state = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4)).state_dict()
    # model.state_dict(): an OrderedDict with _metadata; a Parameter saved as one; a tensor needing grad
    state["param"] = torch.nn.Parameter(torch.randn(4, generator=g))
    state["grad"] = torch.randn(3, generator=g).requires_grad_()
    assert hasattr(state, "_metadata")
    return {
        "dtypes": {  # a plain dict, odd shapes, every dtype safetensors holds
            "f32": torch.randn(3, 5, 7, generator=g),
            "bf16": torch.randn(7, 3, generator=g).to(torch.bfloat16),
            "f16": torch.randn(11, generator=g).to(torch.float16),
            "f64": torch.randn(2, 3, generator=g).to(torch.float64),
            "i64": torch.randint(-2**40, 2**40, (5,), generator=g),
            "i32": torch.randint(-2**30, 2**30, (3, 1), generator=g, dtype=torch.int32),
            "i16": torch.randint(-2**14, 2**14, (3,), generator=g, dtype=torch.int16),
            "i8": torch.randint(-100, 100, (9,), generator=g, dtype=torch.int8),
            "u8": torch.randint(0, 255, (2, 2), generator=g, dtype=torch.uint8),
            "bool": torch.rand(13, generator=g) > 0.5,
            "f8": torch.randn(6, generator=g).to(torch.float8_e4m3fn),
            "f8e5": torch.randn(6, generator=g).to(torch.float8_e5m2),
            "scalar": torch.tensor(2.5),
            "empty": torch.zeros(0, 3),
            "empty_bf16": torch.zeros(4, 0, dtype=torch.bfloat16),
        },
        "views": OrderedDict([  # one storage: views at offsets, a tied weight saved twice, strided views
            ("base", base), ("row", base[2]), ("rows", base[1:4]), ("last", base[4, 3:]), ("one", base[3, 5]),
            ("col", base[:, 1:2]), ("lm_head.weight", tied), ("embed.weight", tied),
            ("t", base.t()), ("every_other", base[::2]), ("column", base[:, 4]),
        ]),
        "state_dict": state,
    }


@pytest.mark.parametrize("case", ["dtypes", "views", "state_dict"])
def test_index_matches_what_torch_loads(tmp_path: Path, case: str) -> None:
    torch = pytest.importorskip("torch")
    from ckptxform.dtypes import from_torch_dtype

    state = torch_cases()[case]
    path = tmp_path / "pytorch_model.bin"
    torch.save(state, path)
    loaded = torch.load(path, weights_only=True)
    blob = path.read_bytes()
    infos, strided = read_zip_state_dict(path, "pytorch_model.bin")
    assert [i.key for i in infos] == list(loaded)
    with open_local(path) as ckpt:
        for info in infos:
            tensor = loaded[info.key]
            raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            assert (info.dtype, info.shape, info.nbytes) == (from_torch_dtype(tensor.dtype), tuple(tensor.shape),
                                                             len(raw)), info.key
            assert ckpt.tensors[info.key] == info
            assert ckpt.read(info) == raw, info.key
            if tensor.is_contiguous() and raw:  # by byte range: the very bytes of the file
                assert info.key not in strided and blob[info.offset:info.offset + info.nbytes] == raw, info.key
                item = tensor.element_size()
                assert info.offset % item == 0
            elif raw:  # a strided view: gathered from its storage, row by row too
                assert info.offset == -1 and info.key in strided
                assert b"".join(ckpt.read_rows(info, list(range(tensor.shape[0]))).values()) == raw
    if case == "views":  # views of one storage lie at their storage offsets; a tied weight is one range
        at = {i.key: i.offset for i in infos}
        assert at["row"] == at["base"] + 2 * 7 * 4 and at["last"] == at["base"] + (4 * 7 + 3) * 4
        assert at["lm_head.weight"] == at["embed.weight"]


def test_zip_bin_index_is_the_one_torch_mmap_gave(tmp_path: Path) -> None:
    """The offsets are where torch's memory-mapped load puts each storage in the file."""
    torch = pytest.importorskip("torch")
    state = torch_cases()["dtypes"]
    path = tmp_path / "model.bin"
    torch.save(state, path)
    with path.open("rb") as f:
        mapped = torch.load(path, mmap=True, weights_only=True)
        infos, _ = read_zip_state_dict(path, "model.bin")
        # the smallest storage address is the first storage's member data: the map's base
        ptrs = {key: t.untyped_storage().data_ptr() for key, t in mapped.items() if t.numel()}
        base = min(ptrs.values()) - min(i.offset for i in infos if i.nbytes)
        assert {i.key: i.offset for i in infos if i.nbytes} == {k: p - base for k, p in ptrs.items()}
        assert f.read(4) == b"PK\x03\x04"


def test_a_big_endian_archive_is_left_to_torch(tmp_path: Path) -> None:
    """A big-endian archive needs its bytes swapped: torch loads it (and says it is needed)."""
    path = write_archive(tmp_path, {"w": tensor("0", numel=2, size=(2,), stride=(1,))},
                        {"0": struct.pack(">2f", 1.5, -2.0)}, byteorder=b"big")
    with pytest.raises(NeedsTorch, match="big-endian"):
        read_zip_state_dict(path, path.name)
    torch = pytest.importorskip("torch")
    with open_local(path) as ckpt:
        info = ckpt.tensors["w"]
        assert info.offset == -1 and ckpt.read(info) == struct.pack("<2f", 1.5, -2.0)
    assert torch.load(path, weights_only=True)["w"].tolist() == [1.5, -2.0]


# ---------------------------------------------------------------- archives assembled here


def _global(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


def _str(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _int(n: int) -> bytes:
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw  # LONG1: any size


def _tuple(items: list[bytes]) -> bytes:
    return b"(" + b"".join(items) + b"t"


def tensor(key: str, *, numel: int, size: tuple[int, ...], stride: tuple[int, ...], offset: int = 0,
           storage: str = "FloatStorage") -> bytes:
    """The opcodes torch.save writes for one tensor (``_rebuild_tensor_v2``)."""
    pid = _tuple([_str("storage"), _global("torch", storage), _str(key), _str("cpu"), _int(numel)]) + b"Q"
    hooks = _global("collections", "OrderedDict") + b")R"
    args = [pid, _int(offset), _tuple([_int(n) for n in size]), _tuple([_int(n) for n in stride]), b"\x89", hooks]
    return _global("torch._utils", "_rebuild_tensor_v2") + _tuple(args) + b"R"


def state_dict(entries: dict[str, bytes]) -> bytes:
    return b"\x80\x02}(" + b"".join(_str(k) + v for k, v in entries.items()) + b"u."


def write_archive(tmp_path: Path, entries: dict[str, bytes] | bytes, storages: dict[str, bytes], *,
                  byteorder: bytes = b"little", name: str = "pytorch_model.bin",
                  compress: int = zipfile.ZIP_STORED) -> Path:
    path = tmp_path / name
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", entries if isinstance(entries, bytes) else state_dict(entries))
        archive.writestr("archive/byteorder", byteorder)
        for key, data in storages.items():
            archive.writestr(f"archive/data/{key}", data, compress_type=compress)
        archive.writestr("archive/version", b"3\n")
    return path


FOUR_FLOATS = {"0": struct.pack("<4f", 1, 2, 3, 4)}


def test_an_assembled_archive_reads(tmp_path: Path) -> None:
    """The assembler writes what the reader reads: the hostile cases below differ by one thing."""
    path = write_archive(tmp_path, {"w": tensor("0", numel=4, size=(2, 2), stride=(2, 1)),
                                    "t": tensor("0", numel=4, size=(2, 2), stride=(1, 2)),
                                    "tail": tensor("0", numel=4, size=(1,), stride=(1,), offset=3)}, FOUR_FLOATS)
    with open_local(path) as ckpt:
        assert ckpt.read(ckpt.tensors["w"]) == struct.pack("<4f", 1, 2, 3, 4)
        assert ckpt.read(ckpt.tensors["t"]) == struct.pack("<4f", 1, 3, 2, 4)
        assert ckpt.read(ckpt.tensors["tail"]) == struct.pack("<f", 4)


def test_a_pickled_call_of_os_system_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    call = _global("os", "system") + _tuple([_str(f"touch {marker}")]) + b"R"
    path = write_archive(tmp_path, {"w": call}, FOUR_FLOATS)
    with pytest.raises(CheckpointFormatError) as err:
        open_local(path)
    assert str(err.value) == (f"{path}: the pickle names 'os.system', which a torch.save'd state dict never holds; "
                              f"refusing to load it (a pickle's globals can run code): {RESAVE}")
    assert not marker.exists()


def _hostile(tmp_path: Path, case: str) -> tuple[Path, str]:
    """A crafted archive and the end of its error message (after ``path: ``)."""
    ok = {"numel": 4, "size": (4,), "stride": (1,)}
    if case == "unknown callable":
        path = write_archive(tmp_path, state_dict({"w": tensor("0", **ok)}).replace(b"_rebuild_tensor_v2",
                                                                                     b"_load_from_bytes"), FOUR_FLOATS)
        return path, ("the pickle names 'torch._utils._load_from_bytes', which a torch.save'd state dict never "
                      f"holds; refusing to load it (a pickle's globals can run code): {RESAVE}")
    if case == "missing storage":
        path = write_archive(tmp_path, {"w": tensor("1", **ok)}, FOUR_FLOATS)
        why = "its data.pkl names storage '1', but the archive has no member 'archive/data/1'"
    elif case == "offset past the end":
        path = write_archive(tmp_path, {"w": tensor("0", numel=4, size=(2,), stride=(1,), offset=3)}, FOUR_FLOATS)
        why = "tensor 'w' reaches past the end of its storage '0'"
    elif case == "size past the end":
        path = write_archive(tmp_path, {"w": tensor("0", numel=4, size=(3, 2), stride=(1, 2))}, FOUR_FLOATS)
        why = "tensor 'w' reaches past the end of its storage '0'"
    elif case == "huge numel":
        path = write_archive(tmp_path, {"w": tensor("0", numel=1 << 62, size=(1 << 62,), stride=(1,))},
                             FOUR_FLOATS)
        why = "its member 'archive/data/0' holds 16 bytes, but data.pkl says 18,446,744,073,709,551,616"
    elif case == "negative stride":
        path = write_archive(tmp_path, {"w": tensor("0", numel=4, size=(4,), stride=(-1,), offset=3)}, FOUR_FLOATS)
        why = "tensor 'w' has storage offset 3, size [4], stride [-1] and dtype 'float32', which no tensor has"
    elif case == "not a storage":
        rebuilt = _global("torch._utils", "_rebuild_tensor_v2") + _tuple([_int(7), _int(0), _tuple([_int(4)]),
                                                                         _tuple([_int(1)])]) + b"R"
        path = write_archive(tmp_path, {"w": rebuilt}, FOUR_FLOATS)
        why = "tensor 'w' is rebuilt from a int, not a storage"
    elif case == "compressed":
        path = write_archive(tmp_path, {"w": tensor("0", **ok)}, FOUR_FLOATS, compress=zipfile.ZIP_DEFLATED)
        why = "its member 'archive/data/0' is compressed or encrypted, which torch.save never writes"
    else:
        raise AssertionError(case)
    return path, f"is not a torch.save'd state dict as torch.save writes it: {why}; {DAMAGED}"


HOSTILE = ["unknown callable", "missing storage", "offset past the end", "size past the end", "huge numel",
           "negative stride", "not a storage", "compressed"]


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_archive(tmp_path: Path, case: str) -> None:
    path, message = _hostile(tmp_path, case)
    with pytest.raises(CheckpointFormatError) as err:
        open_local(path)
    assert str(err.value) == f"{path}: {message}"


def test_a_truncated_archive(tmp_path: Path) -> None:
    path = write_archive(tmp_path, {"w": tensor("0", numel=4, size=(4,), stride=(1,))}, FOUR_FLOATS)
    whole = path.read_bytes()
    path.write_bytes(whole[:len(whole) // 2])
    with pytest.raises(CheckpointFormatError) as err:
        open_local(path)
    assert str(err.value) == (f"{path}: not a readable PyTorch checkpoint (BadZipFile: File is not a zip file); "
                              "re-download it, or re-save it as safetensors")


def test_an_archive_whose_storage_lies_past_the_end_of_the_file(tmp_path: Path) -> None:
    """The directory claims a 1 MiB storage (and data.pkl agrees), but the file ends first."""
    numel = 1 << 18
    path = write_archive(tmp_path, {"w": tensor("0", numel=numel, size=(numel,), stride=(1,))}, FOUR_FLOATS)
    whole = bytearray(path.read_bytes())
    entry = whole.find(b"PK\x01\x02")
    while whole[entry + 46:entry + 46 + struct.unpack_from("<H", whole, entry + 28)[0]] != b"archive/data/0":
        entry = whole.find(b"PK\x01\x02", entry + 4)
    struct.pack_into("<II", whole, entry + 20, 4 * numel, 4 * numel)  # compressed and uncompressed sizes
    path.write_bytes(bytes(whole))
    with pytest.raises(CheckpointFormatError) as err:
        open_local(path)
    message = str(err.value)
    assert message.startswith(f"{path}: is not a torch.save'd state dict as torch.save writes it: its member "
                              "'archive/data/0' ends at byte ")
    assert message.endswith(f", past the end of the {len(whole):,}-byte file (truncated?); {DAMAGED}")


def test_not_a_state_dict_and_a_key_that_is_not_a_name(tmp_path: Path) -> None:
    path = write_archive(tmp_path, b"\x80\x02]" + tensor("0", numel=4, size=(4,), stride=(1,)) + b"a.",
                         FOUR_FLOATS)
    with pytest.raises(CheckpointFormatError) as err:
        open_local(path)
    assert str(err.value) == f"{path}: holds a list, not a state dict (tensor name -> tensor); save model.state_dict()"
    path = write_archive(tmp_path, b"\x80\x02}(" + _int(3) + tensor("0", numel=4, size=(4,), stride=(1,)) + b"u.",
                         FOUR_FLOATS)
    with pytest.raises(CheckpointFormatError) as err:
        open_local(path)
    assert str(err.value) == (f"{path}: has a int key 3; a state dict maps tensor names (strings) to tensors")


def test_a_dtype_safetensors_cannot_hold(tmp_path: Path) -> None:
    path = write_archive(tmp_path, {"c": tensor("0", numel=2, size=(2,), stride=(1,), storage="ComplexFloatStorage")},
                         FOUR_FLOATS)
    with pytest.raises(CheckpointFormatError) as err:
        open_local(path)
    assert str(err.value) == f"{path}: tensor 'c' has dtype torch.complex64, which safetensors cannot hold"
