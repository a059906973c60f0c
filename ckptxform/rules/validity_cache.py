"""Rule documents already found valid by the schema, so later runs skip jsonschema.

Importing jsonschema (with referencing, attrs and its metaschemas) costs about 0.15 s, as
much as copying 200 MB; most runs load a rule file that was valid the last time too.
Validity depends only on the document and the schema, so a document that passed is
recorded as an empty file ``valid-rules/SHA256`` (of ckptxform's version, the schema and
the document) under the cache directory:

- ``CKPTXFORM_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/ckptxform``, else ``~/.cache/ckptxform``;
- ``CKPTXFORM_NO_CACHE=1`` turns it off.

Only passes are recorded (a failing document is always checked and explained again), the
semantic checks always run, and a cache that cannot be read or written is ignored.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from .. import __version__

_JSON_SCALARS = (str, int, float, bool, type(None))


def cache_dir() -> Path | None:
    """Where ckptxform keeps its cache, or None when turned off."""
    if os.environ.get("CKPTXFORM_NO_CACHE", "") not in ("", "0"):
        return None
    explicit = os.environ.get("CKPTXFORM_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "ckptxform" if xdg else Path.home() / ".cache" / "ckptxform"


def document_key(schema_text: str, data: Any) -> str | None:
    """The cache key of ``data`` validated against ``schema_text``; None when ``data`` holds
    something JSON would blur (a non-string key, a date), which is then always validated."""
    if not _plain_json(data):
        return None
    digest = hashlib.sha256()
    for part in (__version__, schema_text, json.dumps(data, ensure_ascii=False, separators=(",", ":"))):
        digest.update(part.encode("utf-8", "surrogatepass") + b"\0")
    return digest.hexdigest()


def known_valid(key: str) -> bool:
    directory = cache_dir()
    try:
        return directory is not None and (directory / "valid-rules" / key).is_file()
    except OSError:
        return False


def remember_valid(key: str) -> None:
    directory = cache_dir()
    if directory is None:
        return
    entries = directory / "valid-rules"
    try:
        entries.mkdir(parents=True, exist_ok=True)
        (entries / key).touch()
    except OSError:
        pass  # a read-only home or a full disk: the next run validates again, nothing is lost


def _plain_json(value: Any) -> bool:
    """Whether ``json.dumps`` writes ``value`` back exactly (types included)."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain_json(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_plain_json(v) for v in value)
    return type(value) in _JSON_SCALARS
