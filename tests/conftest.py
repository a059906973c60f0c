"""Shared fixtures of the engine tests: real stand-in checkpoints, the headline rule, the CLI.

Everything here writes real safetensors files (``ckptxform.standins``) and runs the real
command in a subprocess, so exit codes, stderr and imports are what a user gets.
Session-scoped checkpoints are shared by many tests: tests must never modify them.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from blake3 import blake3
from safetensors import safe_open
from safetensors.torch import load_file

from ckptxform.standins import KIMI_K2, KIMI_K2_TINY, HeadlineStandins, build_headline_standins

REPO = Path(__file__).resolve().parents[1]

#: dimensions small enough for many examples per test, still with distinct shapes per tensor
SMALL_DIMS = KIMI_K2.scaled(hidden=16, head_dim=8, vocab=512, draft_vocab=64, verifier_layers=4)

#: a seed the stand-ins of ckptxform's own demo do not use (0), so tests see other maps
HEADLINE_SEED = 11


_CACHE_PREFIX = "ckptxform-test-cache-"


def _private_cache() -> tuple[Path, bool]:
    """The tests' cache directory, and whether this process made it (and removes it).

    A process started by a test run (it inherits CKPTXFORM_CACHE_DIR) that imports this
    file uses the run's directory instead of making one it would never remove. The
    directory is named after the process that made it, so that one left by a killed run
    (SIGKILL or SIGTERM skip every exit handler) is removed by the next run."""
    inherited = Path(os.environ.get("CKPTXFORM_CACHE_DIR", ""))
    if inherited.name.startswith(_CACHE_PREFIX) and inherited.is_dir():
        return inherited, False
    for stale in Path(tempfile.gettempdir()).glob(f"{_CACHE_PREFIX}*-*"):
        pid = stale.name[len(_CACHE_PREFIX):].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)) and _owned(stale):
            shutil.rmtree(stale, ignore_errors=True)
    made = Path(tempfile.mkdtemp(prefix=f"{_CACHE_PREFIX}{os.getpid()}-"))
    atexit.register(shutil.rmtree, made, ignore_errors=True)  # a process that never ends a session
    return made, True


def _owned(path: Path) -> bool:
    try:
        return path.lstat().st_uid == os.getuid()
    except OSError:  # removed meanwhile by another run
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


#: The tests' cache (rule files found valid), never the user's ~/.cache/ckptxform. Set when
#: this file is imported, before any test module is collected (some load rules at import),
#: and in os.environ so that every CLI subprocess uses it too.
PRIVATE_CACHE, _OWN_CACHE = _private_cache()
os.environ["CKPTXFORM_CACHE_DIR"] = str(PRIVATE_CACHE)
os.environ.pop("CKPTXFORM_NO_CACHE", None)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _OWN_CACHE:
        shutil.rmtree(PRIVATE_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def headline_rule() -> Path:
    """The shipped headline rule file, untouched."""
    return REPO / "rules" / "aqmedai_k2_to_k25.yaml"


@pytest.fixture(scope="session")
def headline(tmp_path_factory: pytest.TempPathFactory) -> HeadlineStandins:
    """K2 drafter, K2.5 drafter and a 4-shard verifier at KIMI_K2_TINY size (read-only)."""
    return build_headline_standins(tmp_path_factory.mktemp("headline"), dims=KIMI_K2_TINY,
                                   seed=HEADLINE_SEED)


@pytest.fixture(scope="session")
def headline_out(tmp_path_factory: pytest.TempPathFactory, headline: HeadlineStandins,
                 headline_rule: Path) -> Path:
    """The headline rule applied once through the Python API (read-only)."""
    from ckptxform import api

    out = tmp_path_factory.mktemp("headline-out") / "k25-drafter"
    api.apply(headline_rule, out=out, sources=headline.sources, progress=False)
    return out


def source_args(sources: dict[str, str]) -> list[str]:
    """``--source NAME=LOC`` arguments for ``sources``."""
    return [arg for name, loc in sources.items() for arg in ("--source", f"{name}={loc}")]


@pytest.fixture(scope="session")
def run_cli() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run ``python -m ckptxform ARGS...`` in a fresh interpreter; never raises on failure."""

    def run(*args: str | os.PathLike[str], cwd: Path | None = None,
            timeout: float = 180) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "CKPTXFORM_DEBUG"}
        env["NO_COLOR"] = "1"
        return subprocess.run([sys.executable, "-m", "ckptxform", *map(str, args)],
                              capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)

    return run


def error_lines(stderr: str) -> list[str]:
    """The error lines of a failed command (log lines at INFO/WARNING are not errors)."""
    return [line for line in stderr.splitlines() if line.startswith(("error:", "internal error"))]


def assert_clean_failure(proc: subprocess.CompletedProcess[str], code: int = 1) -> str:
    """Exit ``code``, no traceback, at least one error line; returns the error text."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stdout, proc.stdout
    return proc.stderr


def read_output(out: Path) -> dict[str, Any]:
    """Every tensor of an output directory (single file or shards), read with safetensors."""
    index = out / "model.safetensors.index.json"
    singles = sorted(p.name for p in out.glob("*.safetensors"))  # output.file_name may rename it
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
             if index.exists() else ["model.safetensors"] if len(singles) != 1 else singles)
    tensors: dict[str, Any] = {}
    for name in files:
        part = load_file(str(out / name))
        assert not set(part) & set(tensors), f"{name} repeats keys"
        tensors.update(part)
    return tensors


def file_keys(path: Path) -> dict[str, tuple[list[int], str]]:
    """key -> (shape, safetensors dtype) of one safetensors file, from its header."""
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return {k: (v["shape"], v["dtype"]) for k, v in header.items() if k != "__metadata__"}


def read_audit(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "ckptxform_audit.jsonl").read_text().splitlines()]


def reference_digest(algorithm: str, data: bytes) -> str:
    """``data``'s digest by the reference implementations (hashlib, the blake3 package), in one call."""
    return (blake3(data) if algorithm == "blake3" else hashlib.new(algorithm, data)).hexdigest()


def recorded(event: dict[str, Any]) -> str:
    """The digest a ``written`` audit record holds, under the algorithm it names."""
    return str(event[event["digest"]])


def tensor_bytes(tensor: Any) -> bytes:
    """The raw little-endian bytes of a CPU tensor, as safetensors stores them."""
    flat = torch.empty(tensor.numel(), dtype=tensor.dtype)  # stride 1 (a size-1 dim may keep any stride)
    flat.copy_(tensor.reshape(-1))
    return flat.view(torch.uint8).numpy().tobytes()


def same_bits(a: Any, b: Any) -> bool:
    """Same dtype, same shape, same bytes (NaN-safe, unlike ``torch.equal``)."""
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and tensor_bytes(a) == tensor_bytes(b)


def assert_same_checkpoint(ours: Path, theirs: Path) -> dict[str, Any]:
    """Two output folders with the same tensors bit for bit and the same config.json (its
    quantization_config compared first, for a readable failure); returns our config."""
    got, want = read_output(ours), read_output(theirs)
    assert sorted(got) == sorted(want)
    bad = sorted(k for k in want if not same_bits(got[k], want[k]))
    assert not bad, f"{len(bad)} tensors differ, first {bad[:3]}"
    mine, ref = (json.loads((d / "config.json").read_text()) for d in (ours, theirs))
    assert mine.get("quantization_config") == ref.get("quantization_config")
    assert mine == ref
    return mine


LM_HEAD = "language_model.lm_head.weight"


def verifier_tensor(verifier_dir: Path, key: str) -> torch.Tensor:
    """One tensor of a sharded verifier, found through its index (as a user would)."""
    index = json.loads((verifier_dir / "model.safetensors.index.json").read_text())
    with safe_open(str(verifier_dir / index["weight_map"][key]), framework="pt") as f:
        return f.get_tensor(key)


def target_ids(d2t: torch.Tensor) -> list[int]:
    """d2t is an offset: draft index i scores target token i + d2t[i]."""
    return [i + int(v) for i, v in enumerate(d2t.tolist())]


def expected_conversion(drafter_dir: Path, target_dir: Path, verifier_dir: Path) -> dict[str, Any]:
    """What the headline rule must write, computed from the source files with torch alone
    (eagle3-formats.md), not from anything the engine computes: ``midlayer.`` becomes
    ``layers.0.``; K2.5 draft index ``j`` scores target token ``t = j + d2t_k25[j]``, whose
    row is the K2 lm_head row ``i`` with ``i + d2t_k2[i] == t`` when K2 has the token, else
    the verifier's ``language_model.lm_head.weight[t]``; d2t/t2d are the K2.5 drafter's."""
    k2 = load_file(str(drafter_dir / "model.safetensors"))
    k25 = load_file(str(target_dir / "model.safetensors"))
    verifier_lm = verifier_tensor(verifier_dir, LM_HEAD)
    out: dict[str, Any] = {}
    for key, value in k2.items():
        if key.startswith("midlayer."):
            out["layers.0." + key.removeprefix("midlayer.")] = value
        elif key in ("fc.weight", "norm.weight"):
            out[key] = value
    k2_index = {t: i for i, t in enumerate(target_ids(k2["d2t"]))}
    rows = [k2["lm_head.weight"][k2_index[t]] if t in k2_index else verifier_lm[t]
            for t in target_ids(k25["d2t"])]
    out["lm_head.weight"] = torch.stack(rows)
    out["d2t"] = k25["d2t"]
    out["t2d"] = k25["t2d"]
    return out


@pytest.fixture
def rule_variant(tmp_path: Path, headline_rule: Path) -> Callable[..., Path]:
    """Write a copy of the headline rule to tmp_path with textual replacements.

    Each replacement must apply exactly once, so that a change of the shipped rule file
    breaks the test loudly instead of silently testing the unchanged rule."""

    def make(replacements: dict[str, str], name: str = "variant.yaml") -> Path:
        text = headline_rule.read_text()
        for old, new in replacements.items():
            assert text.count(old) == 1, f"{old!r} occurs {text.count(old)} times in the headline rule"
            text = text.replace(old, new)
        path = tmp_path / name
        path.write_text(text)
        return path

    return make
