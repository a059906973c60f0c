"""llama.cpp's own ``convert_hf_to_gguf.py``, the reference of the hf_to_gguf rules.

The script is not in the ``gguf`` wheel; llama-cpp-python's sdist on PyPI vendors llama.cpp
at a fixed commit (``vendor/llama.cpp/``: the script, its ``conversion`` package and the
gguf-py it runs with). The sdist is downloaded once with pip's own client (``pip download
--no-deps --no-binary :all:``), checked against its sha256 below, and only those three
paths are extracted into a cache directory outside the repository
(``$CKPTXFORM_REFERENCE_CACHE``, else ``$XDG_CACHE_HOME/ckptxform-reference``). None of
llama.cpp's code is in this repository.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
#: what is taken from the sdist (below llama_cpp_python-VERSION/vendor/llama.cpp/)
MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def cache_dir() -> Path:
    base = os.environ.get("CKPTXFORM_REFERENCE_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ckptxform-reference"
    return Path(base) / f"llama-cpp-python-{VERSION}"


def converter() -> Path:
    """The path of ``convert_hf_to_gguf.py`` (downloaded and extracted on first use)."""
    pytest.importorskip("sentencepiece", reason="llama.cpp's converter reads tokenizer.model with sentencepiece "
                                                "(.ci/reference-nodeps.txt)")
    root = cache_dir()
    script = root / "convert_hf_to_gguf.py"
    if (root / "COMPLETE").is_file():
        return script
    with tempfile.TemporaryDirectory() as tmp:
        run = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                              f"llama-cpp-python=={VERSION}", "-d", tmp], capture_output=True, text=True)
        sdist = Path(tmp) / SDIST
        if run.returncode or not sdist.is_file():
            pytest.fail(f"could not download llama-cpp-python {VERSION}'s sdist from PyPI:\n{run.stderr[-2000:]}")
        digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
        assert digest == SHA256, f"{SDIST}: sha256 {digest}, pinned {SHA256}"
        prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
        staging = root.with_name(root.name + ".part")
        shutil.rmtree(staging, ignore_errors=True)
        with tarfile.open(sdist) as tar:
            members = []
            for member in tar.getmembers():
                rest = member.name.removeprefix(prefix)
                if rest != member.name and (member.isfile() or member.isdir()) and rest.startswith(MEMBERS):
                    member.name = rest
                    members.append(member)
            tar.extractall(staging, members=members, filter="data")
        (staging / "COMPLETE").write_text(SHA256)
        shutil.rmtree(root, ignore_errors=True)
        staging.rename(root)
    return script


def convert(source: Path, outtype: str, outfile: Path) -> Path:
    """Run ``convert_hf_to_gguf.py SOURCE --outtype OUTTYPE --outfile OUTFILE`` (with the
    gguf-py vendored beside it, as llama.cpp runs it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("NO_LOCAL_GGUF", "PYTHONPATH")}
    run = subprocess.run([sys.executable, str(converter()), str(source), "--outtype", outtype,
                          "--outfile", str(outfile)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return outfile
