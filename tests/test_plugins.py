"""Plug-ins (issue 34 item 5): a package installed with pip adds an op and a source format
through entry points, and a rule file uses them as it uses built-in ones: schema-checked
arguments, plan-time checks, the audit's wording, the same byte-exact output.

tests/fixtures/plugin_example is that package (the README's example); each test run installs
it with pip into a folder of its own and runs the CLI with that folder on the path, so the
plug-in is found through its installed metadata, as a user's would be.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import REPO, assert_clean_failure
from safetensors.numpy import load_file

PLUGIN = REPO / "tests" / "fixtures" / "plugin_example"
RULE = """\
version: 1
name: reverse-with-a-plugin
sources:
  model: {path: model}
convert: model
tensors:
  - key: 'w.{N}'
    ops:
      - reverse_rows:
  - match: 'b|s'
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example plug-in installed by pip into a folder of its own."""
    root = tmp_path_factory.mktemp("plugin")
    shutil.copytree(PLUGIN, root / "src")  # pip builds in place: never in the checkout
    target = root / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--no-index", "--disable-pip-version-check", "--target", str(target), str(root / "src")],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode and "No module named 'setuptools'" in proc.stderr + proc.stdout:
        pytest.skip("this venv has no setuptools to build the example plug-in")
    assert proc.returncode == 0, proc.stderr
    assert list(target.glob("ckptxform_plugin_example-*.dist-info/entry_points.txt"))
    return target


def run_with(site: Path, *args: Any, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CKPTXFORM_DEBUG"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    env["NO_COLOR"] = "1"
    return subprocess.run([sys.executable, "-m", "ckptxform", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=180)


def raw_dir(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    """A checkpoint in the plug-in's ``rawdir`` format."""
    path.mkdir(parents=True)
    header, offset = {}, 0
    with open(path / "tensors.bin", "wb") as f:
        for key, value in tensors.items():
            header[key] = {"dtype": {"float32": "F32", "int64": "I64"}[value.dtype.name],
                           "shape": list(value.shape), "offset": offset}
            f.write(value.tobytes())
            offset += value.nbytes
    (path / "tensors.json").write_text(json.dumps(header))
    (path / "config.json").write_text(json.dumps({"model_type": "example"}))
    return path


@pytest.fixture()
def model(tmp_path: Path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    tensors = {"w.0": rng.standard_normal((5, 3)).astype(np.float32),
               "w.1": rng.standard_normal((7, 2, 2)).astype(np.float32),
               "b": np.arange(4, dtype=np.int64), "s": np.array(7, dtype=np.int64)}
    raw_dir(tmp_path / "model", tensors)
    (tmp_path / "rule.yaml").write_text(RULE)
    return tensors


def test_a_plugin_op_reads_a_plugin_source_and_writes_the_same_bytes(site: Path, tmp_path: Path,
                                                                      model: dict[str, np.ndarray]) -> None:
    proc = run_with(site, "apply", "rule.yaml", "--out", "out", "-q", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert np.array_equal(out["w.0"], model["w.0"][::-1]) and np.array_equal(out["w.1"], model["w.1"][::-1])
    assert np.array_equal(out["b"], model["b"])
    audit = [json.loads(line) for line in (tmp_path / "out" / "ckptxform_audit.jsonl").read_text().splitlines()]
    actions = {r["key"]: r["action"] for r in audit if r["event"] == "tensor"}
    assert actions == {"w.0": "reversed", "w.1": "reversed", "b": "loaded", "s": "loaded"}
    written = {r["key"]: r for r in audit if r["event"] == "written"}
    assert "reverse_rows" in json.dumps(written["w.0"]["from"])
    inspected = run_with(site, "inspect", "model", cwd=tmp_path)
    assert inspected.returncode == 0 and "w.1" in inspected.stdout


def test_a_plugin_op_is_checked_at_validate_and_plan_time_as_a_builtin(site: Path, tmp_path: Path,
                                                                        model: dict[str, np.ndarray]) -> None:
    (tmp_path / "bad-args.yaml").write_text(RULE.replace("      - reverse_rows:\n", "      - reverse_rows: 3\n"))
    bad = run_with(site, "validate", "bad-args.yaml", cwd=tmp_path)
    assert bad.returncode == 2 and "bad-args.yaml:9:23: tensors[0].ops[0].reverse_rows:" in bad.stdout + bad.stderr
    (tmp_path / "scalar.yaml").write_text(RULE.replace("match: 'b|s'", "match: 'b'\n  - key: 's'\n    ops:\n"
                                                                       "      - reverse_rows:"))
    err = assert_clean_failure(run_with(site, "plan", "scalar.yaml", cwd=tmp_path))
    assert "reverse_rows" in err and "takes tensors of rank at least 1, and this one has shape []" in err
    assert run_with(site, "validate", "rule.yaml", cwd=tmp_path).returncode == 0


def test_without_the_plugin_its_verb_is_unknown(tmp_path: Path, model: dict[str, np.ndarray], run_cli: Any) -> None:
    proc = run_cli("validate", tmp_path / "rule.yaml")
    assert proc.returncode == 2 and "reverse_rows" in proc.stdout + proc.stderr
