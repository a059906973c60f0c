"""The files of a checkpoint folder or Hub repo, for a rule's ``files`` section.

Weights are indexed from their headers elsewhere; this lists everything else a folder or
repo holds (tokenizer, generation config, chat templates...) as relative ``/`` paths.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import SourceNotFoundError

#: a folder holding more files than this is not a checkpoint (a home directory, /tmp...)
MAX_FILES = 100_000


def local_files(root: Path, *, label: str) -> tuple[str, ...]:
    """Every file under ``root`` (links to files included; hidden folders such as
    ``.git`` and ``.cache`` left out), sorted. A FIFO, socket or device is listed too, so
    that a glob matching it is refused by name rather than said to match nothing."""
    out: list[str] = []
    for folder, dirs, files in os.walk(root, followlinks=False):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        rel = os.path.relpath(folder, root)
        for name in files:
            path = name if rel == "." else f"{rel.replace(os.sep, '/')}/{name}"
            if os.path.exists(os.path.join(folder, name)):  # not a link to nothing
                out.append(path)
        if len(out) > MAX_FILES:
            raise SourceNotFoundError(
                f"{label}: {root} holds more than {MAX_FILES:,} files; a rule's files section reads "
                "the checkpoint's own folder: give the folder that holds the checkpoint", path=str(root))
    return tuple(sorted(out))


def hub_files(repo_id: str, commit: str, call: Callable[[Callable[[], Any]], Any]) -> tuple[str, ...]:
    """Every file of a Hub repo at ``commit``: from the Hub's tree listing, or offline
    (``HF_HUB_OFFLINE=1``) from the files of that commit in the Hugging Face cache."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.file_download import repo_folder_name
    from huggingface_hub.hf_api import RepoFile

    if constants.HF_HUB_OFFLINE:
        snapshot = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model") \
            / "snapshots" / commit
        return local_files(snapshot, label=f"{repo_id}@{commit} (offline)") if snapshot.is_dir() else ()
    entries = call(lambda: list(HfApi().list_repo_tree(repo_id, revision=commit, recursive=True)))
    return tuple(sorted(e.path for e in entries if isinstance(e, RepoFile)))
