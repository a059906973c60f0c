"""Rule documents already found valid by the schema, so later runs skip jsonschema.

Importing jsonschema (with referencing, attrs and its metaschemas) costs about 0.15 s, as
much as copying 200 MB; most runs load a rule file that was valid the last time too.
Validity depends on the document, the schema and the validator, so a document that passed
is recorded as an empty file ``valid-rules/SHA256`` (of the document, the schema,
ckptxform's and Python's versions, and the installed jsonschema's file stamp) under the
cache directory:

- ``CKPTXFORM_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/ckptxform``, else ``~/.cache/ckptxform``;
- ``CKPTXFORM_NO_CACHE=1`` turns it off.

Only passes are recorded (a failing document is always checked and explained again), the
semantic checks always run, and a cache that cannot be read or written is ignored.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

from .._version import __version__

_JSON_SCALARS = (str, int, float, bool, type(None))


def cache_dir() -> Path | None:
    """Where ckptxform keeps its cache, or None when turned off (or there is no home)."""
    if os.environ.get("CKPTXFORM_NO_CACHE", "") not in ("", "0"):
        return None
    explicit = os.environ.get("CKPTXFORM_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg) / "ckptxform"
    try:
        return Path.home() / ".cache" / "ckptxform"
    except RuntimeError:  # no HOME and no passwd entry (some containers)
        return None


def document_key(schema_text: str, data: Any) -> str | None:
    """The cache key of ``data`` validated against ``schema_text``; None when ``data`` holds
    something JSON would blur (a non-string key, a date), which is then always validated."""
    if not _plain_json(data):
        return None
    try:
        document = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    except ValueError:  # an integer past Python's digit limit for str()
        return None
    digest = hashlib.sha256()
    for part in (__version__, sys.version, _validator_stamp(), schema_text, document):
        digest.update(part.encode("utf-8", "surrogatepass") + b"\0")
    return digest.hexdigest()


@functools.cache
def _validator_stamp() -> str:
    """Which jsonschema is installed, without importing it (an upgrade rewrites its files)."""
    spec = importlib.util.find_spec("jsonschema")
    try:
        stat = os.stat(spec.origin) if spec is not None and spec.origin else None
    except OSError:
        stat = None
    return f"{spec.origin if spec else None}:{stat.st_size if stat else 0}:{stat.st_mtime_ns if stat else 0}"


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
