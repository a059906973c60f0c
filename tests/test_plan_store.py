"""A plan's outputs and records live in a database on disk (engine/plan/plan_store.py):
read like the tuples they were (in order, by index and slice, equal to a tuple of the same
items, pickled whole), one output found by key, released by ``close()``; a key written
twice is refused naming both producers, wherever the two writes fall among the batches."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from ckptxform import api
from ckptxform.engine.plan.plan_store import BATCH
from ckptxform.errors import PlanError


def _source(root: Path, keys: list[str]) -> None:
    """One safetensors file of [2, 4] BF16 zero tensors."""
    root.mkdir(parents=True)
    header = {key: {"dtype": "BF16", "shape": [2, 4], "data_offsets": [16 * i, 16 * i + 16]}
              for i, key in enumerate(keys)}
    blob = json.dumps(header).encode()
    (root / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(16 * len(keys)))


def _rules(root: Path, tensors: str) -> Path:
    (root / "rules.yaml").write_text(
        f"version: 1\nname: store\nsources:\n  model: {{path: ./src}}\nconvert: model\ntensors:\n{tensors}")
    return root / "rules.yaml"


def test_a_plans_outputs_read_as_a_sequence_in_key_order(tmp_path: Path) -> None:
    count = BATCH + 100  # more than one batch written
    _source(tmp_path / "src", [f"w.{i}" for i in range(count)] + ["unused.x"])
    rules = _rules(tmp_path, "  - match: 'w\\.(\\d+)'\n    rename: 'out.\\1'\n  - match: 'unused\\..*'\n"
                             "    skip: not needed\n")
    with api.plan(rules) as plan:
        keys = sorted(f"out.{i}" for i in range(count))
        assert len(plan.outputs) == count and [o.key for o in plan.outputs] == keys
        assert plan.outputs[0].key == keys[0] and plan.outputs[-1].key == keys[-1]
        assert [o.key for o in plan.outputs[10:20]] == keys[10:20]
        assert [o.key for o in plan.outputs[-5::2]] == keys[-5::2]
        with pytest.raises(IndexError):
            plan.outputs[count]
        found = plan.output("out.17")
        assert found is not None and found.key == "out.17" and found.recipe.key == "w.17"
        assert plan.output("out.x") is None and found in plan.outputs
        assert plan.outputs == tuple(plan.outputs) and plan.total_bytes == 16 * count
        assert len(plan.records) == count + 1 and plan.counts() == {"renamed": count, "skipped": 1}
        assert plan.records[-1].key == "unused.x" and plan.records[-1].reason == "not needed"
        again = pickle.loads(pickle.dumps(plan))  # a value held whole
        assert again.outputs == plan.outputs and again.records == plan.records
        assert again.output("out.17") == found and again.output("out.x") is None
    with pytest.raises(ValueError, match="closed"):
        list(plan.outputs)
    assert again.outputs[3:5] == tuple(again.outputs)[3:5]  # the pickled copy reads on


@pytest.mark.parametrize("apart", [1, BATCH + 10])
def test_a_key_written_twice_names_both_producers_in_any_batch(tmp_path: Path, apart: int) -> None:
    # 'a.0' and 'b.0' both write 'x.0'; ``apart`` outputs written between them
    _source(tmp_path / "src", ["a.0", *(f"m.{i}" for i in range(apart)), "b.0"])
    rules = _rules(tmp_path, "  - match: 'a\\.(\\d+)'\n    rename: 'x.\\1'\n  - match: 'm\\.(\\d+)'\n"
                             "    rename: 'm.\\1'\n  - match: 'b\\.(\\d+)'\n    rename: 'x.\\1'\n")
    with pytest.raises(PlanError) as err:
        api.plan(rules)
    at = f"{tmp_path / 'rules.yaml'}:"
    assert str(err.value).startswith(f"tensors[2] ({at}11) (from model:b.0) and tensors[0] ({at}7) (from model:a.0) "
                                     "both write output key 'x.0'")


def test_a_plans_store_leaves_no_file_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)
    _source(tmp_path / "src", ["w.0", "w.1"])
    plan = api.plan(_rules(tmp_path, "  - match: 'w\\.(\\d+)'\n    rename: 'out.\\1'\n"))
    assert os.listdir(tmp_path / "tmp") == [] and len(plan.outputs) == 2  # unlinked once open


def test_a_full_temp_directory_is_one_clean_error_naming_it(tmp_path: Path) -> None:
    """TMPDIR on a 256 KiB tmpfs (a private mount namespace): the plan's database of
    20,000 tensors outgrows it. Before, sqlite's own "file is not a database" came out as
    an internal error that named neither the directory nor the fix."""
    if not shutil.which("unshare"):
        pytest.skip("needs unshare to mount a small tmpfs")
    count = 20_000  # ~630 bytes a tensor: past sqlite's 8 MB page cache and the 256 KiB
    _source(tmp_path / "src", [f"w.{i}" for i in range(count)])
    rules = _rules(tmp_path, "  - match: 'w\\.(\\d+)'\n    rename: 'out.\\1'\n")
    small = tmp_path / "small"
    small.mkdir()
    shell = 'mount -t tmpfs -o size=256k tmpfs "$0" || exit 99; "$@"'
    env = {k: v for k, v in os.environ.items() if k != "CKPTXFORM_DEBUG"}
    env["TMPDIR"] = str(small)
    # sqlite's own words vary with where it fails ("database or disk is full", "file is not a database")
    expected = re.compile(re.escape(f"error: the temp directory '{small}' is full (sqlite: ") + r"[^)]+" + re.escape(
        "); a plan keeps ~630 bytes a tensor there: free space in it, or set TMPDIR to a directory with room"))
    for command in (["plan", str(rules)], ["apply", str(rules), "--out", str(tmp_path / "out"), "--no-fsync"]):
        proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", shell, str(small),
                               sys.executable, "-m", "ckptxform", *command],
                              capture_output=True, text=True, timeout=300, env=env, check=False)
        if proc.returncode == 99 or "unshare:" in proc.stderr:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        [line] = [line for line in proc.stderr.splitlines() if line.strip()]
        assert expected.fullmatch(line), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rules.yaml", "small", "src"]  # no OUT, nothing left
    with api.plan(rules) as plan:  # the same plan, with room: the store is not the problem
        assert len(plan.outputs) == count


def test_a_temp_directory_that_cannot_hold_the_database_is_one_clean_error(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The two other ways the store's temp file fails: it cannot be made (here: the directory
    is gone), and sqlite fails where the directory has room (here: a closed connection)."""
    import sqlite3
    import tempfile

    from ckptxform.engine.plan.plan_store import Database, PlanStore
    from ckptxform.errors import TempSpaceError

    gone = tmp_path / "gone"
    monkeypatch.setattr(tempfile, "tempdir", str(gone))
    with pytest.raises(TempSpaceError) as err:
        PlanStore()
    assert str(err.value) == (f"cannot create the plan's working database in the temp directory '{gone}': No such "
                              "file or directory; set TMPDIR to a writable directory with room")
    assert err.value.path == str(gone)
    connection = sqlite3.connect(":memory:")
    connection.close()
    with pytest.raises(TempSpaceError) as err:
        Database(connection, str(tmp_path)).execute("SELECT 1")
    assert str(err.value) == (f"the plan's working database in the temp directory '{tmp_path}' failed (sqlite: "
                              "Cannot operate on a closed database.); a plan keeps ~630 bytes a tensor there: free "
                              "space in it, or set TMPDIR to a directory with room")
