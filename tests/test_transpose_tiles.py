"""transpose's block program at sizes where a tile has many bands shared among threads
(ops/transpose.py), against torch's transpose: every element of every dtype size lands
where torch puts it, for the last band short and for dims in the middle."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_structural_engine import assert_same, rand, rule_file, run, write_model

import ckptxform.ops.transpose as transpose_op


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16, torch.float32, torch.float64])
def test_a_tile_of_many_bands_on_many_threads_is_torchs_transpose(
        dtype: torch.dtype, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transpose_op, "_BAND", 16)  # 1,037 rows: 65 bands, the last one short
    wide = rand(1037, 45, seed=3, dtype=torch.float32).mul(50).to(dtype)
    deep = rand(3, 301, 5, 7, seed=4, dtype=torch.float32).mul(50).to(dtype)
    write_model(tmp_path / "src", {"wide": wide, "deep": deep})
    got = run(tmp_path, rule_file(tmp_path, """\
        tensors:
          - key: wide
            ops: [{transpose: [0, 1]}]
          - key: deep
            ops: [{transpose: [1, 3]}]
        """))
    assert_same(got, {"wide": wide.t(), "deep": deep.transpose(1, 3)})
