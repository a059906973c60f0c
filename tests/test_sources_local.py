"""Local sources: real checkpoints written to tmp_path, and one hostile file per check.

Hostile safetensors are crafted byte by byte (8-byte little-endian length, JSON, data)
because no writer would produce them; every error message is a golden string.
"""

from __future__ import annotations

import builtins
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ckptxform.errors import CheckpointFormatError, SourceNotFoundError, UsageError
from ckptxform.sources.base import TensorInfo
from ckptxform.sources.local import open_local

# A small drafter-like checkpoint covering the dtypes the EAGLE-3 rules touch.
TENSORS = {
    "fc.weight": torch.arange(24, dtype=torch.float32).reshape(4, 6),
    "lm_head.weight": torch.arange(40, dtype=torch.bfloat16).reshape(8, 5),
    "norm.weight": torch.ones(6, dtype=torch.float16),
    "d2t": torch.tensor([3, 3, 5, 7], dtype=torch.int64),
    "t2d": torch.tensor([False, True, True, False, True], dtype=torch.bool),
    "empty": torch.zeros(0, 3, dtype=torch.float32),
    "scalar": torch.tensor(2.5, dtype=torch.float64),
}
SHARD_1 = {k: TENSORS[k] for k in ("fc.weight", "lm_head.weight", "norm.weight")}
SHARD_2 = {k: TENSORS[k] for k in ("d2t", "t2d", "empty", "scalar")}
SHARD_NAMES = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
SHARDS = {SHARD_NAMES[0]: SHARD_1, SHARD_NAMES[1]: SHARD_2}
CONFIG = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 6}
EXPECTED_DTYPES = {
    "fc.weight": "F32",
    "lm_head.weight": "BF16",
    "norm.weight": "F16",
    "d2t": "I64",
    "t2d": "BOOL",
    "empty": "F32",
    "scalar": "F64",
}


def tensor_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


def write_index(
    directory: Path, weight_map: dict[str, str], name: str = "model.safetensors.index.json"
) -> Path:
    path = directory / name
    path.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return path


def write_sharded(
    directory: Path,
    shards: dict[str, dict[str, torch.Tensor]],
    weight_map: dict[str, str] | None = None,
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, tensors in shards.items():
        save_file(tensors, str(directory / name))
    if weight_map is None:
        weight_map = {key: name for name, tensors in shards.items() for key in tensors}
    write_index(directory, weight_map)
    return directory


def write_raw(
    path: Path, header: dict | bytes, data: bytes = b"", *, length: int | None = None
) -> Path:
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(blob) if length is None else length
    path.write_bytes(n.to_bytes(8, "little") + blob + data)
    return path


def assert_matches(ckpt, expected: dict[str, torch.Tensor]) -> None:
    assert set(ckpt.tensors) == set(expected)
    for key, tensor in expected.items():
        info = ckpt.tensors[key]
        assert info.key == key
        assert info.shape == tuple(tensor.shape)
        assert info.dtype == EXPECTED_DTYPES[key]
        assert info.nbytes == tensor.numel() * tensor.element_size()
        assert ckpt.read(info) == tensor_bytes(tensor)


# ---------------------------------------------------------------- valid layouts


def test_single_file(tmp_path: Path) -> None:
    path = tmp_path / "drafter.safetensors"
    save_file(TENSORS, str(path), metadata={"format": "pt"})
    with open_local(path) as ckpt:
        assert_matches(ckpt, TENSORS)
        assert ckpt.files == ("drafter.safetensors",)
        assert ckpt.location == str(path)
        assert ckpt.metadata == {"drafter.safetensors": {"format": "pt"}}
        assert ckpt.local_path("drafter.safetensors") == path.resolve()
        assert ckpt.config() is None
        raw = path.read_bytes()
        for info in ckpt.tensors.values():
            # offsets are absolute positions in the file
            assert raw[info.offset : info.offset + info.nbytes] == ckpt.read(info)
        offsets = [t.offset for t in ckpt.tensors.values()]
        assert offsets == sorted(offsets)


def test_model_safetensors_directory_with_config(tmp_path: Path) -> None:
    save_file(TENSORS, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    with open_local(tmp_path) as ckpt:
        assert_matches(ckpt, TENSORS)
        assert ckpt.files == ("model.safetensors",)
        assert ckpt.config() == CONFIG


def test_single_other_safetensors_in_directory(tmp_path: Path) -> None:
    save_file(SHARD_2, str(tmp_path / "consolidated.safetensors"))
    with open_local(tmp_path) as ckpt:
        assert ckpt.files == ("consolidated.safetensors",)
        assert_matches(ckpt, SHARD_2)


def test_two_shards_with_index(tmp_path: Path) -> None:
    write_sharded(tmp_path, SHARDS)
    with open_local(tmp_path) as ckpt:
        assert_matches(ckpt, TENSORS)
        assert ckpt.files == SHARD_NAMES
        assert {k: ckpt.tensors[k].file for k in SHARD_2} == dict.fromkeys(SHARD_2, SHARD_NAMES[1])
        # ordered by file, then offset
        order = [(SHARD_NAMES.index(t.file), t.offset) for t in ckpt.tensors.values()]
        assert order == sorted(order)
        for name in SHARD_NAMES:
            raw = (tmp_path / name).read_bytes()
            for info in (t for t in ckpt.tensors.values() if t.file == name):
                assert raw[info.offset : info.offset + info.nbytes] == ckpt.read(info)


def test_each_tensor_is_as_its_header_says_whichever_shard_is_read_first(tmp_path: Path) -> None:
    write_sharded(tmp_path, SHARDS)
    expected = {}
    for name in SHARD_NAMES:
        raw = (tmp_path / name).read_bytes()
        n = int.from_bytes(raw[:8], "little")
        for key, entry in json.loads(raw[8 : 8 + n]).items():
            if key != "__metadata__":
                begin, end = entry["data_offsets"]
                expected[key] = TensorInfo(key, entry["dtype"], tuple(entry["shape"]), name, 8 + n + begin, end - begin)
    with open_local(tmp_path) as ckpt:
        for key in [*reversed(SHARD_2), *SHARD_1, *SHARD_2]:  # the second shard read first, asked twice
            assert ckpt.tensors[key] == expected[key]
        for name in SHARD_NAMES:
            assert ckpt.tensors_of_file(name) == sorted(
                (info for info in expected.values() if info.file == name), key=lambda t: (t.offset, t.key))
        assert "no.such.key" not in ckpt.tensors
        with pytest.raises(KeyError):
            ckpt.tensors["no.such.key"]

def test_index_given_by_path_ignores_files_it_does_not_name(tmp_path: Path) -> None:
    write_sharded(tmp_path, SHARDS)
    save_file({"other": torch.zeros(2)}, str(tmp_path / "consolidated.safetensors"))
    with open_local(tmp_path / "model.safetensors.index.json") as ckpt:
        assert ckpt.files == SHARD_NAMES
        assert set(ckpt.tensors) == set(TENSORS)


def test_read_ranges_and_rows(tmp_path: Path) -> None:
    save_file(TENSORS, str(tmp_path / "model.safetensors"))
    with open_local(tmp_path) as ckpt:
        info = ckpt.tensors["lm_head.weight"]
        whole = tensor_bytes(TENSORS["lm_head.weight"])
        assert ckpt.read(info, 3, 7) == whole[3:10]
        assert ckpt.read(info, 70) == whole[70:]
        assert ckpt.read(info, 80, 0) == b""
        rows = ckpt.read_rows(info, [6, 0, 1, 2, 6, 7])
        assert sorted(rows) == [0, 1, 2, 6, 7]
        for row, blob in rows.items():
            assert blob == tensor_bytes(TENSORS["lm_head.weight"][row])


def test_runs_of_rows_are_read_straight_into_place(tmp_path: Path) -> None:
    save_file(TENSORS, str(tmp_path / "model.safetensors"))
    whole = TENSORS["lm_head.weight"]
    width = 10  # 5 bf16 values
    with open_local(tmp_path) as ckpt:
        info = ckpt.tensors["lm_head.weight"]
        out = bytearray(b"\xee" * 6 * width)
        ckpt.read_runs_into(info, [(6, 2), (0, 3)], memoryview(out), [0, 3])
        expected = tensor_bytes(whole[6:8]) + b"\xee" * width + tensor_bytes(whole[0:3])
        assert bytes(out) == expected
        with pytest.raises(UsageError, match=r"bytes \[60, 90\) are outside tensor 'lm_head.weight'"):
            ckpt.read_runs_into(info, [(6, 3)], memoryview(out), [0])
        os.truncate(tmp_path / "model.safetensors", info.offset + 7 * width)
        with pytest.raises(CheckpointFormatError, match="file ends before the end of tensor 'lm_head.weight'"):
            ckpt.read_runs_into(info, [(5, 3)], memoryview(out), [0])
    with pytest.raises(UsageError, match="read after close"):
        ckpt.read_runs_into(info, [(0, 1)], memoryview(out), [0])


def test_runs_into_a_buffer_too_small_or_from_a_deleted_file_are_clear_errors(tmp_path: Path) -> None:
    save_file(TENSORS, str(tmp_path / "model.safetensors"))
    with open_local(tmp_path) as ckpt:
        info = ckpt.tensors["lm_head.weight"]
        small = memoryview(bytearray(20))  # two rows of 10 bytes
        with pytest.raises(UsageError) as err:
            ckpt.read_runs_into(info, [(0, 3)], small, [1])
        assert str(err.value) == "read_runs_into: rows [1, 4) of 10 bytes do not fit a buffer of 20 bytes"
        with pytest.raises(UsageError) as err:
            ckpt.read_runs_into(info, [(0, 1), (1, 1)], small, [0])
        assert str(err.value) == "read_runs_into: 2 runs but 1 places"
        (tmp_path / "model.safetensors").unlink()  # before the first read opens it
        with pytest.raises(SourceNotFoundError):
            ckpt.read_runs_into(info, [(0, 2)], small, [0])


def test_hf_cache_snapshot_links_are_allowed(tmp_path: Path) -> None:
    # The Hub cache stores snapshots/REV/FILE as links to ../../blobs/HASH.
    repo = tmp_path / "models--org--drafter"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    save_file(TENSORS, str(blobs / "f00d"))
    (blobs / "c0nf").write_text(json.dumps(CONFIG))
    (snapshot / "model.safetensors").symlink_to("../../blobs/f00d")
    (snapshot / "config.json").symlink_to("../../blobs/c0nf")
    with open_local(snapshot) as ckpt:
        assert_matches(ckpt, TENSORS)
        assert ckpt.config() == CONFIG
        assert ckpt.local_path("model.safetensors") == (blobs / "f00d").resolve()


def test_safetensors_index_and_reads_do_not_import_torch(tmp_path: Path) -> None:
    write_sharded(tmp_path, SHARDS)
    script = (
        "import sys\n"
        "from ckptxform.sources.local import open_local\n"
        f"c = open_local({str(tmp_path)!r})\n"
        "c.read_rows(c.tensors['lm_head.weight'], [1, 2]); c.config(); c.close()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True)


def test_close_releases_descriptors_even_on_error(tmp_path: Path) -> None:
    write_sharded(tmp_path / "ok", SHARDS)
    write_sharded(tmp_path / "bad", SHARDS, {"fc.weight": SHARD_NAMES[0]})
    before = len(os.listdir("/proc/self/fd"))
    ckpt = open_local(tmp_path / "ok")
    ckpt.read(ckpt.tensors["d2t"])
    ckpt.close()
    with pytest.raises(CheckpointFormatError), open_local(tmp_path / "bad") as bad:
        list(bad.tensors)  # each shard's header is read (and checked) when it is first needed
    assert len(os.listdir("/proc/self/fd")) == before


def test_file_truncated_after_indexing(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file(TENSORS, str(path))
    with open_local(path) as ckpt:
        info = ckpt.tensors["lm_head.weight"]
        assert ckpt.read(info, 0, 10) == tensor_bytes(TENSORS["lm_head.weight"])[:10]
        # truncated while open (a file that moved before its first read is refused: test_trust_output.py)
        os.truncate(path, info.offset + 10)
        with pytest.raises(CheckpointFormatError) as err:
            ckpt.read(info)
    assert str(err.value) == (
        f"{path}: file ends before the end of tensor 'lm_head.weight'; it was truncated after "
        "it was indexed (re-download it)"
    )


def test_read_misuse_is_a_usage_error(tmp_path: Path) -> None:
    save_file(TENSORS, str(tmp_path / "model.safetensors"))
    save_file(TENSORS, str(tmp_path / "other.safetensors"))
    ckpt = open_local(tmp_path / "model.safetensors")
    other = open_local(tmp_path / "other.safetensors")
    info = ckpt.tensors["d2t"]
    with pytest.raises(UsageError) as err:
        ckpt.read(info, 30, 4)
    assert str(err.value) == (
        f"{tmp_path / 'model.safetensors'}: bytes [30, 34) are outside tensor 'd2t', which "
        "has 32 bytes"
    )
    with pytest.raises(UsageError) as err:
        ckpt.read(other.tensors["d2t"])
    assert str(err.value) == (
        f"{tmp_path / 'model.safetensors'}: tensor 'd2t' of file 'other.safetensors' is not part "
        "of this checkpoint; read a TensorInfo taken from its .tensors"
    )
    ckpt.close()
    other.close()
    with pytest.raises(UsageError, match="read after close"):
        ckpt.read(info)


# ---------------------------------------------------------------- where the weights are


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(SourceNotFoundError) as err:
        open_local(tmp_path / "nope", name="drafter")
    assert str(err.value) == (
        f"{tmp_path / 'nope'}: does not exist; give a local directory or file, or a Hub repo "
        "ORG/NAME[@REVISION]"
    )
    assert err.value.source == "drafter"
    assert isinstance(err.value, FileNotFoundError)


def test_directory_without_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "training_args.bin").write_bytes(b"not weights")
    with pytest.raises(SourceNotFoundError) as err:
        open_local(tmp_path)
    assert str(err.value) == (
        f"{tmp_path}: no checkpoint weights found (looked for model.safetensors.index.json, "
        "model.safetensors, *.safetensors, pytorch_model.bin.index.json, pytorch_model.bin, consolidated.NN.pth); "
        "give the directory or file that holds the weights"
    )


def test_several_safetensors_without_index(tmp_path: Path) -> None:
    for name, tensors in SHARDS.items():
        save_file(tensors, str(tmp_path / name))
    with pytest.raises(SourceNotFoundError) as err:
        open_local(tmp_path)
    assert str(err.value) == (
        f"{tmp_path}: holds 2 .safetensors files ('model-00001-of-00002.safetensors', "
        "'model-00002-of-00002.safetensors') but no model.safetensors.index.json saying which "
        "tensors each holds; download the index, or give one file's path"
    )


def test_not_a_checkpoint_file(tmp_path: Path) -> None:
    path = tmp_path / "weights.npz"
    path.write_bytes(b"PK")
    with pytest.raises(CheckpointFormatError) as err:
        open_local(path)
    assert str(err.value) == (
        f"{path}: not a checkpoint file; give a .safetensors, .bin, .pt or .pth file, a "
        "*.index.json shard index, or the directory holding them"
    )


def test_invalid_config_json(tmp_path: Path) -> None:
    save_file(SHARD_2, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text('{"hidden_size": 6,}')
    with open_local(tmp_path) as ckpt, pytest.raises(CheckpointFormatError) as err:
        ckpt.config()
    assert str(err.value) == (
        f"{tmp_path / 'config.json'}: config is not valid JSON (Expecting property name enclosed in "
        "double quotes at line 1 column 19); fix or remove the file"
    )


# ---------------------------------------------------------------- hostile headers

W = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
W_JSON = json.dumps(W).encode()

# (id, header, data, message after "PATH: ")
HOSTILE_HEADERS = [
    (
        "not-utf8",
        b'{"\xff": 1}',
        b"",
        "header is not UTF-8 (byte 2: invalid start byte); the file is corrupt or not safetensors",
    ),
    (
        "not-json",
        b"{not json",
        b"",
        "header is not valid JSON (Expecting property name enclosed in double quotes at line 1 "
        "column 2); the file is corrupt or not safetensors",
    ),
    (
        "nan",
        b'{"w": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 8]}}',
        bytes(8),
        "header is not valid JSON (NaN is not JSON); the file is corrupt or not safetensors",
    ),
    (
        "deep-nesting",
        b"[" * 200_000,
        b"",
        "header is not valid JSON (nested too deeply); the file is corrupt or not safetensors",
    ),
    (
        "not-object",
        b"[1, 2]",
        b"",
        "header must be a JSON object, got an array; the file is corrupt or not safetensors",
    ),
    (
        "duplicate-key",
        b'{"w": ' + W_JSON + b', "w": ' + W_JSON + b"}",
        bytes(8),
        "header has key 'w' twice in one JSON object; each name must appear once (the file is "
        "corrupt or crafted)",
    ),
    (
        "duplicate-field",
        b'{"w": {"dtype": "F32", "dtype": "I32", "shape": [2], "data_offsets": [0, 8]}}',
        bytes(8),
        "header has key 'dtype' twice in one JSON object; each name must appear once (the file "
        "is corrupt or crafted)",
    ),
    (
        "lone-surrogate",
        b'{"\\ud800": ' + W_JSON + b"}",
        bytes(8),
        "header key '\\ud800' is not valid Unicode (a lone surrogate escape); the file is "
        "corrupt or crafted",
    ),
    (
        "entry-not-object",
        {"w": [1]},
        b"",
        "tensor 'w': entry must be an object with dtype, shape and data_offsets, got an array",
    ),
    (
        "missing-fields",
        {"w": {"dtype": "F32"}},
        b"",
        "tensor 'w': entry has no 'shape', 'data_offsets'",
    ),
    (
        "unknown-dtype",
        {"w": {**W, "dtype": "F128"}},
        bytes(8),
        "tensor 'w': unknown dtype 'F128' (known: BF16, BOOL, F16, F32, F64, F8_E4M3, F8_E5M2, "
        "F8_E8M0, I16, I32, I64, I8, U16, U32, U64, U8)",
    ),
    (
        "negative-shape",
        {"w": {**W, "shape": [-2]}},
        bytes(8),
        "tensor 'w': shape must be a list of non-negative 64-bit integers, got [-2]",
    ),
    (
        "float-shape",
        {"w": {**W, "shape": [2.0]}},
        bytes(8),
        "tensor 'w': shape must be a list of non-negative 64-bit integers, got [2.0]",
    ),
    (
        "bool-shape",
        {"w": {**W, "shape": [True, True]}},
        bytes(8),
        "tensor 'w': shape must be a list of non-negative 64-bit integers, got [true, true]",
    ),
    (
        "huge-shape",
        {"w": {**W, "shape": [2**64, 0], "data_offsets": [0, 0]}},
        b"",
        "tensor 'w': shape must be a list of non-negative 64-bit integers, got "
        "[18446744073709551616, 0]",
    ),
    (
        "offsets-one-int",
        {"w": {**W, "data_offsets": [8]}},
        bytes(8),
        "tensor 'w': data_offsets must be two non-negative 64-bit integers [begin, end] with "
        "begin <= end, got [8]",
    ),
    (
        "offsets-reversed",
        {"w": {**W, "data_offsets": [8, 0]}},
        bytes(8),
        "tensor 'w': data_offsets must be two non-negative 64-bit integers [begin, end] with "
        "begin <= end, got [8, 0]",
    ),
    (
        "offsets-strings",
        {"w": {**W, "data_offsets": ["0", "8"]}},
        bytes(8),
        "tensor 'w': data_offsets must be two non-negative 64-bit integers [begin, end] with "
        'begin <= end, got ["0", "8"]',
    ),
    (
        "offsets-past-end",
        {"w": W},
        bytes(4),
        "tensor 'w': data_offsets [0, 8] run past the end of the data (4 bytes); the file is "
        "truncated (re-download it)",
    ),
    (
        "length-mismatch",
        {"w": {**W, "shape": [3]}},
        bytes(8),
        "tensor 'w': data_offsets [0, 8] span 8 bytes but dtype F32 with shape [3] needs 12",
    ),
    (
        "overlap",
        {"a": W, "b": {**W, "data_offsets": [4, 12]}},
        bytes(12),
        "tensors 'a' [0, 8] and 'b' [4, 12] overlap; each tensor needs its own bytes (the file "
        "is corrupt or crafted)",
    ),
    (
        "metadata-not-object",
        {"__metadata__": ["x"], "w": W},
        bytes(8),
        "__metadata__ must be an object of strings, got an array",
    ),
    (
        "metadata-not-str",
        {"__metadata__": {"epoch": 3}, "w": W},
        bytes(8),
        "__metadata__ must map strings to strings; 'epoch' holds a number 3",
    ),
]


@pytest.mark.parametrize(
    ("header", "data", "message"),
    [pytest.param(h, d, m, id=i) for i, h, d, m in HOSTILE_HEADERS],
)
def test_hostile_header(tmp_path: Path, header: dict | bytes, data: bytes, message: str) -> None:
    path = write_raw(tmp_path / "model.safetensors", header, data)
    with pytest.raises(CheckpointFormatError) as err:
        open_local(tmp_path, name="drafter")
    assert str(err.value) == f"{path}: {message}"
    assert err.value.path == str(path)
    assert err.value.source == "drafter"


def test_file_shorter_than_the_length_prefix(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointFormatError) as err:
        open_local(path)
    assert str(err.value) == (
        f"{path}: 2 bytes is too short for a safetensors file (it starts with an 8-byte header "
        "length); the file is truncated or not safetensors"
    )


def test_header_length_larger_than_file(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "model.safetensors", {"w": W}, bytes(8), length=1000)
    with pytest.raises(CheckpointFormatError) as err:
        open_local(path)
    size = path.stat().st_size
    assert str(err.value) == (
        f"{path}: header length 1000 is larger than the file ({size} bytes); the file is "
        "truncated or not safetensors (re-download or re-save it)"
    )


def test_header_length_over_the_bound(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "model.safetensors", b"{}", length=100_000_001)
    with pytest.raises(CheckpointFormatError) as err:
        open_local(path)
    assert str(err.value) == (
        f"{path}: header length 100000001 exceeds the 100000000-byte limit of safetensors; "
        "the file is corrupt or not safetensors"
    )


def test_gaps_and_null_metadata_are_accepted(tmp_path: Path) -> None:
    # The safetensors crate wants the data covered exactly; ckptxform only refuses overlaps.
    header = {"__metadata__": None, "b": {**W, "data_offsets": [12, 20]}, "a": W}
    data = bytes(range(8)) + b"gap!" + bytes(range(10, 18))
    path = write_raw(tmp_path / "model.safetensors", header, data)
    with open_local(path) as ckpt:
        assert list(ckpt.tensors) == ["a", "b"]
        assert ckpt.read(ckpt.tensors["b"]) == bytes(range(10, 18))
        assert ckpt.metadata == {"model.safetensors": {}}


# ---------------------------------------------------------------- hostile shard indexes


def sharded(tmp_path: Path, weight_map: dict[str, str] | None = None) -> Path:
    return write_sharded(tmp_path, SHARDS, weight_map)


def full_map() -> dict[str, str]:
    return {**dict.fromkeys(SHARD_1, SHARD_NAMES[0]), **dict.fromkeys(SHARD_2, SHARD_NAMES[1])}


@pytest.mark.parametrize(
    "shard", ["sub/model.safetensors", "..\\model.safetensors", "..", "/etc/model.safetensors", ""]
)
def test_index_shard_must_be_a_plain_file_name(tmp_path: Path, shard: str) -> None:
    index = sharded(tmp_path, {**full_map(), "fc.weight": shard}) / "model.safetensors.index.json"
    with pytest.raises(CheckpointFormatError) as err:
        open_local(tmp_path)
    assert str(err.value) == (
        f"{index}: weight_map maps 'fc.weight' to {shard!r}, which is not a plain file name; "
        "shards must sit next to the index (no '/', '\\', '..' or absolute paths)"
    )
    assert err.value.key == "fc.weight"


def test_index_weight_map_must_be_an_object(tmp_path: Path) -> None:
    save_file(SHARD_1, str(tmp_path / SHARD_NAMES[0]))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": [SHARD_NAMES[0]]}))
    with pytest.raises(CheckpointFormatError) as err:
        open_local(tmp_path)
    assert str(err.value) == (
        f"{index}: has no 'weight_map' object (got [\"model-00001-of-00002.safetensors\"]); a "
        "shard index maps each tensor name to its shard file (re-download the index)"
    )


def test_index_that_is_not_json(tmp_path: Path) -> None:
    index = sharded(tmp_path) / "model.safetensors.index.json"
    index.write_text('{"weight_map": {')
    with pytest.raises(CheckpointFormatError) as err:
        open_local(tmp_path)
    assert str(err.value) == (
        f"{index}: index is not valid JSON (Expecting property name enclosed in double quotes "
        "at line 1 column 17); the index is corrupt (re-download it)"
    )


def test_index_values_must_be_strings(tmp_path: Path) -> None:
    index = sharded(tmp_path, {**full_map(), "d2t": 2}) / "model.safetensors.index.json"
    with pytest.raises(CheckpointFormatError) as err:
        open_local(tmp_path)
    assert (
        str(err.value)
        == f"{index}: weight_map maps 'd2t' to 2; each tensor must map to a shard file name"
    )


def test_index_with_duplicate_key(tmp_path: Path) -> None:
    sharded(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(index.read_text().replace('"d2t": ', '"d2t": "x", "d2t": '))
    with pytest.raises(CheckpointFormatError) as err:
        open_local(tmp_path)
    assert str(err.value) == (
        f"{index}: index has key 'd2t' twice in one JSON object; each name must appear once "
        "(the file is corrupt or crafted)"
    )


def test_safetensors_index_naming_a_bin_shard(tmp_path: Path) -> None:
    index = (
        sharded(tmp_path, {**full_map(), "d2t": "pytorch_model.bin"})
        / "model.safetensors.index.json"
    )
    with pytest.raises(CheckpointFormatError) as err:
        open_local(tmp_path)
    assert str(err.value) == (
        f"{index}: weight_map maps 'd2t' to 'pytorch_model.bin', but this index must name "
        ".safetensors shards"
    )


def test_index_maps_key_to_missing_shard(tmp_path: Path) -> None:
    missing = "model-00003-of-00003.safetensors"
    index = (
        sharded(tmp_path, {**full_map(), "d2t": missing, "t2d": missing})
        / "model.safetensors.index.json"
    )
    with pytest.raises(SourceNotFoundError) as err:
        open_local(tmp_path)
    assert str(err.value) == (
        f"{index}: maps 'd2t', 't2d' to shard '{missing}', which does not exist in {tmp_path}; "
        "download the missing shard or fix the index"
    )
    assert err.value.key == "d2t"


def test_index_maps_key_to_a_shard_without_it(tmp_path: Path) -> None:
    index = (
        sharded(tmp_path, {**full_map(), "d2t": SHARD_NAMES[0]}) / "model.safetensors.index.json"
    )
    # A shard's header is read when one of its tensors is first needed, and checked then
    # against the whole index: whichever of the two shards is read first says it.
    with pytest.raises(CheckpointFormatError) as err, open_local(tmp_path) as ckpt:
        ckpt.tensors_of_file(SHARD_NAMES[0])
    assert str(err.value) == (
        f"{index}: maps 'd2t' to shard '{SHARD_NAMES[0]}', which does not hold it; the index and the "
        "shards disagree (re-download both)"
    )
    with pytest.raises(CheckpointFormatError) as err, open_local(tmp_path) as ckpt:
        ckpt.tensors["t2d"]  # in the other shard, with d2t
    assert str(err.value) == (
        f"{index}: shard '{SHARD_NAMES[1]}' holds 'd2t', which the index maps to '{SHARD_NAMES[0]}'; a tensor "
        "must live in the one shard the index names (re-download both, or re-save the checkpoint)"
    )


def test_shard_holds_keys_the_index_does_not_list(tmp_path: Path) -> None:
    weight_map = {k: v for k, v in full_map().items() if k not in ("t2d", "empty")}
    index = sharded(tmp_path, weight_map) / "model.safetensors.index.json"
    with pytest.raises(CheckpointFormatError) as err, open_local(tmp_path) as ckpt:
        list(ckpt.tensors)
    assert str(err.value) == (
        f"{index}: shard '{SHARD_NAMES[1]}' holds 'empty', 't2d', which the index does not "
        "list, so loaders would silently drop them; add them to weight_map or re-save the "
        "checkpoint"
    )


def test_same_key_in_two_shards(tmp_path: Path) -> None:
    shards = {
        SHARD_NAMES[0]: SHARD_1,
        SHARD_NAMES[1]: {**SHARD_2, "fc.weight": TENSORS["fc.weight"]},
    }
    index = write_sharded(tmp_path, shards, full_map()) / "model.safetensors.index.json"
    with pytest.raises(CheckpointFormatError) as err, open_local(tmp_path) as ckpt:
        list(ckpt.tensors)
    assert str(err.value) == (
        f"{index}: shard '{SHARD_NAMES[1]}' holds 'fc.weight', which the index maps to '{SHARD_NAMES[0]}'; a "
        "tensor must live in the one shard the index names (re-download both, or re-save the checkpoint)"
    )


def test_symlinked_shard_escaping_the_directory(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    save_file(SHARD_2, str(outside / "secret.safetensors"))
    ckpt_dir = tmp_path / "ckpt"
    ckpt_dir.mkdir()
    save_file(SHARD_1, str(ckpt_dir / SHARD_NAMES[0]))
    (ckpt_dir / SHARD_NAMES[1]).symlink_to(outside / "secret.safetensors")
    write_index(ckpt_dir, full_map())
    with pytest.raises(CheckpointFormatError) as err:
        open_local(ckpt_dir)
    assert str(err.value) == (
        f"{ckpt_dir / SHARD_NAMES[1]}: links to {(outside / 'secret.safetensors').resolve()}, "
        f"outside the checkpoint directory {ckpt_dir.resolve()}; replace the link with the "
        "file itself"
    )


def test_symlinked_model_safetensors_escaping_the_directory(tmp_path: Path) -> None:
    save_file(SHARD_2, str(tmp_path / "secret.safetensors"))
    ckpt_dir = tmp_path / "ckpt"
    ckpt_dir.mkdir()
    (ckpt_dir / "model.safetensors").symlink_to(tmp_path / "secret.safetensors")
    with pytest.raises(CheckpointFormatError, match="outside the checkpoint directory"):
        open_local(ckpt_dir)


# ---------------------------------------------------------------- pytorch_model.bin


def test_pytorch_model_bin_directory(tmp_path: Path) -> None:
    torch.save(TENSORS, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    with open_local(tmp_path) as ckpt:
        assert_matches(ckpt, TENSORS)
        assert ckpt.files == ("pytorch_model.bin",)
        assert {t.file for t in ckpt.tensors.values()} == {"pytorch_model.bin"}
        # torch's zip stores each storage raw: the tensors are byte ranges of the file
        blob = (tmp_path / "pytorch_model.bin").read_bytes()
        for key, info in ckpt.tensors.items():
            assert blob[info.offset:info.offset + info.nbytes] == tensor_bytes(TENSORS[key]), key
        assert list(ckpt.tensors) == list(TENSORS)  # the state dict's order
        assert ckpt.local_path("pytorch_model.bin") == (tmp_path / "pytorch_model.bin").resolve()
        assert ckpt.config() == CONFIG
        info = ckpt.tensors["lm_head.weight"]
        assert ckpt.read(info, 10, 6) == tensor_bytes(TENSORS["lm_head.weight"])[10:16]
        rows = ckpt.read_rows(info, [7, 2, 3])
        assert rows == {r: tensor_bytes(TENSORS["lm_head.weight"][r]) for r in (2, 3, 7)}


def test_a_legacy_pickle_is_read_from_the_loaded_tensors(tmp_path: Path) -> None:
    """torch's pre-1.6 format (no zip) says no byte range: its tensors are read from the load."""
    torch.save(TENSORS, tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    with open_local(tmp_path) as ckpt:
        assert_matches(ckpt, TENSORS)
        assert {t.offset for t in ckpt.tensors.values()} == {-1}
        assert ckpt.local_path("pytorch_model.bin") is None


def test_bin_tensors_that_are_views_read_their_own_bytes(tmp_path: Path) -> None:
    base = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    state = {"t": base.t(), "row": base[1], "base": base}  # share one storage
    path = tmp_path / "drafter.pt"
    torch.save(state, path)
    with open_local(path) as ckpt:
        for key, tensor in state.items():
            assert ckpt.read(ckpt.tensors[key]) == tensor_bytes(tensor)


def test_sharded_bin_with_index(tmp_path: Path) -> None:
    names = ("pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin")
    torch.save(SHARD_1, tmp_path / names[0])
    torch.save(SHARD_2, tmp_path / names[1])
    write_index(
        tmp_path,
        {**dict.fromkeys(SHARD_1, names[0]), **dict.fromkeys(SHARD_2, names[1])},
        "pytorch_model.bin.index.json",
    )
    with open_local(tmp_path) as ckpt:
        assert_matches(ckpt, TENSORS)
        assert ckpt.files == names
        assert ckpt.tensors["t2d"].file == names[1]


def test_sharded_bin_index_is_checked_against_shards(tmp_path: Path) -> None:
    names = ("pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin")
    torch.save(SHARD_1, tmp_path / names[0])
    torch.save(SHARD_2, tmp_path / names[1])
    index = write_index(
        tmp_path,
        dict.fromkeys(SHARD_1, names[0]) | {"d2t": names[1]},
        "pytorch_model.bin.index.json",
    )
    with pytest.raises(CheckpointFormatError) as err:
        open_local(tmp_path)
    assert str(err.value) == (
        f"{index}: shard '{names[1]}' holds 'empty', 'scalar', 't2d', which the index does not "
        "list, so loaders would silently drop them; add them to weight_map or re-save the "
        "checkpoint"
    )


def test_legacy_non_zip_bin_loads(tmp_path: Path) -> None:
    torch.save(SHARD_1, tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    with open_local(tmp_path) as ckpt:
        assert_matches(ckpt, SHARD_1)


class WritesMarker:
    """Unpickling this runs ``exec`` and writes a file: what a malicious .bin does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (builtins.exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))


class CustomModule:
    """An arbitrary class: weights_only loading refuses to import it."""


RESAVE = "re-save it as safetensors from a trusted environment (torch.load there, then safetensors.torch.save_file)"


@pytest.mark.parametrize(("zip_format", "refusal"), [
    # torch's zip format: data.pkl read with our allow-list, torch not asked
    (True, "the pickle names '__builtin__.exec', which a torch.save'd state dict never holds; refusing to load "
           "it (a pickle's globals can run code): "),
    # the legacy format: torch.load(weights_only=True) refuses it
    (False, "contains pickled code that weights_only loading refuses (it references 'exec'); "),
])
def test_malicious_bin_is_refused_without_running_its_code(tmp_path: Path, zip_format: bool, refusal: str) -> None:
    marker = tmp_path / "marker"
    path = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.zeros(2), "payload": WritesMarker(marker)}, path, _use_new_zipfile_serialization=zip_format)
    with pytest.raises(CheckpointFormatError) as err:
        open_local(tmp_path)
    assert str(err.value) == f"{path}: {refusal}{RESAVE}"
    assert not marker.exists()


def test_the_malicious_fixture_really_runs_code_when_loaded_unsafely(tmp_path: Path) -> None:
    # Guards the test above: its file would have written the marker had we loaded it.
    marker = tmp_path / "marker"
    path = tmp_path / "evil.bin"
    torch.save({"payload": WritesMarker(marker)}, path)
    torch.load(path, weights_only=False)
    assert marker.read_text() == "pwned"


def test_bin_with_custom_class_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    torch.save({"w": torch.zeros(2), "module": CustomModule()}, path)
    with pytest.raises(CheckpointFormatError) as err:
        open_local(path)
    assert str(err.value) == (
        f"{path}: the pickle names '{__name__}.CustomModule', which a torch.save'd state dict never holds; refusing "
        f"to load it (a pickle's globals can run code): {RESAVE}"
    )


def test_bin_that_is_not_a_dict(tmp_path: Path) -> None:
    path = tmp_path / "pytorch_model.bin"
    torch.save([torch.zeros(2)], path)
    with pytest.raises(CheckpointFormatError) as err:
        open_local(path)
    assert str(err.value) == (
        f"{path}: holds a list, not a state dict (tensor name -> tensor); save model.state_dict()"
    )


def test_bin_with_nested_state_dict(tmp_path: Path) -> None:
    path = tmp_path / "pytorch_model.bin"
    torch.save({"state_dict": SHARD_2, "epoch": 3}, path)
    with pytest.raises(CheckpointFormatError) as err:
        open_local(path)
    assert str(err.value) == (
        f"{path}: entry 'state_dict' is a dict, not a tensor; a state dict maps tensor names to "
        "tensors (the weights may be nested: save state['state_dict'] instead)"
    )


def test_bin_with_unsupported_dtype(tmp_path: Path) -> None:
    path = tmp_path / "pytorch_model.bin"
    torch.save({"c": torch.zeros(2, dtype=torch.complex64)}, path)
    with pytest.raises(CheckpointFormatError) as err:
        open_local(path)
    assert (
        str(err.value)
        == f"{path}: tensor 'c' has dtype torch.complex64, which safetensors cannot hold"
    )


def test_bin_that_is_not_a_torch_file(tmp_path: Path) -> None:
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(b"hello, this is not a pickle")
    with pytest.raises(CheckpointFormatError) as err:
        open_local(path)
    assert str(err.value).startswith(f"{path}: not a readable PyTorch checkpoint (")
    assert str(err.value).endswith("); re-download it, or re-save it as safetensors")
