"""Stand-ins that only torch can write, shipped prebuilt so that ``demo RULE`` runs on the light install.

A DCP checkpoint (torchtitan), a Megatron-Core ``torch_dist`` save and a pickled
``pytorch_model.bin`` are written by ``torch.save``/``dcp.save``. ckptxform reads them
without torch, so only writing their stand-ins needed it. With torch installed, a rule's
stand-in is written by torch as before; without it, it is copied from
``ckptxform/standins/prebuilt/RULE/`` (package data), which is what torch wrote there.
``tests/test_rule_standins.py`` checks that the shipped files are what torch writes
today (DCP's ``.metadata`` apart from the random id every save draws).

Regenerate after changing one of these stand-ins::

    python -m ckptxform.standins.write_prebuilt
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Callable
from pathlib import Path

__all__ = ["PREBUILT_DIR", "prebuilt_or", "write_prebuilt"]

Builder = Callable[[Path], dict[str, str]]

PREBUILT_DIR = Path(__file__).resolve().parent / "prebuilt"
#: the source name -> folder (relative to the rule's prebuilt folder) of each shipped stand-in
_SOURCES_FILE = "sources.json"


def prebuilt_or(stem: str, build: Builder) -> Builder:
    """``build`` when torch is installed; else a copy of the stand-in torch wrote for ``stem``."""

    def build_or_copy(root: Path) -> dict[str, str]:
        return build(root) if _has_torch() else _copy(stem, Path(root))
    return build_or_copy


def _has_torch() -> bool:
    try:
        return importlib.util.find_spec("torch") is not None
    except ImportError:  # an import hook that refuses torch (the light-install tests)
        return False


def _copy(stem: str, root: Path) -> dict[str, str]:
    shipped = PREBUILT_DIR / stem
    sources = json.loads((shipped / _SOURCES_FILE).read_text())
    root.mkdir(parents=True, exist_ok=True)
    for entry in shipped.iterdir():
        if entry.is_dir():
            shutil.copytree(entry, root / entry.name, dirs_exist_ok=True)
        elif entry.name != _SOURCES_FILE:
            shutil.copy2(entry, root / entry.name)
    return {name: str(root / relative) for name, relative in sources.items()}


def write_prebuilt(build: Builder, into: Path) -> None:
    """Write a stand-in with its torch ``build`` into ``into``, in the shipped layout."""
    into.mkdir(parents=True)
    sources = build(into)
    relative = {name: Path(location).relative_to(into).as_posix() for name, location in sources.items()}
    (into / _SOURCES_FILE).write_text(json.dumps(relative, indent=1, sort_keys=True) + "\n")
