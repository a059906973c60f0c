"""The hostile-input suite, round 5: what a seeded sweep of damaged inputs found (byte and
JSON mutations of vocabulary maps and of the files a rule reads, run through every
subcommand).

Each CLI case runs the real command in a subprocess through ``Case``
(tests/test_hostile_inputs.py): the one error line and the exit code asserted, no output,
no temporary sibling, sources unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_hostile_inputs import Case, make_source, write_rule


@pytest.fixture
def case(tmp_path: Path, run_cli: Any) -> Case:
    return Case(tmp_path, run_cli)


# ---------------------------------------------------------------- vocabulary maps

#: decoded as offsets, d2t [0, 0, 3] maps draft tokens to target ids 0, 1 and 5; the t2d of
#: 4 target ids marks only 0: id 1 is unmarked, and then 5 is past t2d's end
_D2T, _T2D = [0, 0, 3], [1, 0, 0, 0]


def _other_drafter(case: Case) -> Path:
    return make_source(case.root / "b", {"d2t": torch.zeros(3, dtype=torch.int64),
                                         "t2d": torch.tensor([1, 1, 1, 0], dtype=torch.bool)}, config=None)


def test_a_target_past_the_end_of_t2d_after_an_unmarked_one_is_named(case: Case) -> None:
    make_source(case.root / "a", {"d2t": torch.tensor(_D2T), "t2d": torch.tensor(_T2D, dtype=torch.bool)},
                config=None)
    case.fails("vocab-diff", case.root / "a", _other_drafter(case), code=1, line=(
        "error: vocab map 'A' (a tensor 'd2t'): draft index 2 maps to target id 5 (d2t[2] = 3, encoding "
        "'offset'), outside [0, 4); fix: set vocab_size to the verifier's vocabulary size or correct the "
        "encoding ('offset': target = index + d2t[index]; 'absolute': target = d2t[index])"))


def test_a_repeated_target_after_an_unmarked_one_is_named(case: Case) -> None:
    # targets 0, 1, 1: id 1 is unmarked first, then repeated
    (case.root / "v.json").write_text('{"d2t": [0, 0, -1], "t2d": [1, 0, 0, 0]}')
    case.fails("vocab-diff", case.root / "v.json", _other_drafter(case), code=1, line=(
        "error: vocab map 'A' (file 'v.json'): draft indices 1 and 2 both map to target id 1 (d2t[1] = 0, "
        "d2t[2] = -1, encoding 'offset'); fix: a draft vocabulary lists each target token once: rebuild "
        "d2t or correct the encoding"))


def _vocab_file_rule(case: Case, file: str) -> Path:
    make_source(case.root / "m", {"w": torch.ones(2)})
    return write_rule(case.root / "r.yaml", f"sources:\n  m: {{path: m}}\nvocab:\n  a: {{file: '{file}', "
                                            "encoding: offset}\ntensors:\n  - match: 'w'\n")


def _npy(shape: str, data: bytes = bytes(32)) -> bytes:
    header = ("{'descr': '<i8', 'fortran_order': False, 'shape': " + shape).encode()
    header += b" " * (117 - len(header)) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + data


_NPY_FIX = "fix: save d2t with numpy.save('d2t.npy', d2t.numpy())"


def test_an_npy_vocab_file_whose_header_does_not_parse_is_named(case: Case) -> None:
    (case.root / "d2t.npy").write_bytes(_npy("(4,), "))  # the closing brace is gone
    case.fails("plan", _vocab_file_rule(case, "d2t.npy"), code=1, line=(
        f"error: vocab file 'd2t.npy' is not a plain numpy array (its header does not parse); {_NPY_FIX}"))


def test_an_npy_vocab_file_declaring_a_terabyte_is_refused_not_allocated(case: Case) -> None:
    (case.root / "d2t.npy").write_bytes(_npy(f"({2**40},), }}"))
    case.fails("plan", _vocab_file_rule(case, "d2t.npy"), code=1, line=(
        "error: vocab file 'd2t.npy' is not a plain numpy array (its header declares more data than the "
        f"file holds); {_NPY_FIX}"))


def test_an_npz_archive_named_d2t_npy_is_named(case: Case) -> None:
    import numpy

    numpy.savez(case.root / "d2t.npz", d2t=numpy.arange(3))
    (case.root / "d2t.npz").rename(case.root / "d2t.npy")
    case.fails("plan", _vocab_file_rule(case, "d2t.npy"), code=1, line=(
        f"error: vocab file 'd2t.npy' is an .npz archive, not a plain numpy array; {_NPY_FIX}"))


_PT_FIX = "fix: save the map as plain tensors (torch.save({'d2t': d2t, 't2d': t2d}, ...))"


@pytest.mark.parametrize(("pickle", "reason"), [
    (b"\x80\x02h\x05.", "KeyError: 5"),  # a memo entry never stored
    (b"\x80\x02.", "IndexError: pop from empty list"),  # STOP with nothing built
    # protocol 10, which torch warns of before it fails: the warning is not printed
    (b"\x80\x0ah\x05.", "KeyError: 5"),
])
def test_a_damaged_pt_vocab_file_is_one_named_error(case: Case, pickle: bytes, reason: str) -> None:
    (case.root / "vocab.pt").write_bytes(pickle)
    case.fails("vocab-diff", case.root / "vocab.pt", _other_drafter(case), code=1, line=(
        f"error: vocab file 'vocab.pt' cannot be loaded with weights_only=True ({reason}); {_PT_FIX}"))


@pytest.mark.parametrize("t2d", [[True, True, True, False], (1, 1, 1, 0)])
def test_a_pt_vocab_file_whose_t2d_is_not_a_tensor_is_named_not_ignored(case: Case, t2d: Any) -> None:
    torch.save({"d2t": torch.zeros(3, dtype=torch.int64), "t2d": t2d}, case.root / "vocab.pt")
    case.fails("vocab-diff", case.root / "vocab.pt", _other_drafter(case), code=1, line=(
        f"error: vocab file 'vocab.pt': t2d is a {type(t2d).__name__}, not a tensor; fix: t2d must be a boolean "
        "tensor, one flag per target id (or leave it out)"))
