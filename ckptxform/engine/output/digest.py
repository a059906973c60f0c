"""The digest of everything that shapes an output, so that a rerun knows it has nothing to do.

An output is this run's conversion when the same ckptxform decided the same plan from the
same inputs. The digest covers, each as the audit's run record keeps it:

- ``plan_sha256``: the decided plan (every output's recipe, dtype and shape, the account of
  every source tensor, the output config, the files copied, the shard layout and the rule
  set's name),
  without the positions in the rule file: a comment or a blank line moves every rule's
  line number but decides nothing, while anything a rule asks for changes the plan;
- ``contents``: every local file the plan read (weight files, shard indexes, configs,
  vocab files) by its content key (``ckptxform.sources.file_content``: all its bytes when
  small, its size and header when large); ``files_read`` keeps the pins
  (``ckptxform.sources.pins``), which the digest covers for large files only: a ``touch``
  changes no digest, and a large file's moved pin is settled by its whole digest
  (``file_digests``, recorded by the run that read it);
- the commit of every Hub source (``sources`` in the run record) and ckptxform's version.

``digest`` is one sha256 over all of them; ``changes`` says in words which part moved (and
which file), and
``other_origin`` whether the output came from another rule or other sources altogether.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from ..._version import __version__
from ...errors import quote
from ...sources.file_content import content_key, is_whole, whole_digest
from ...where import Where
from ..plan.plan_store import PlanOutputs
from ..plan.planner import Plan
from ..plan.record_table import Records

#: what the digest hashes item by item (a plan's outputs and records: read an item at a time)
_SEQUENCES = (list, tuple, Records, PlanOutputs)

#: fields that say where in the rule file something was written, not what it asks
_POSITIONS = frozenset({"rule", "where"})


@dataclass(frozen=True)
class RunDigest:
    sha256: str
    plan_sha256: str
    #: resolved path -> pin stamp
    files_read: dict[str, str]
    #: source name -> commit (None for local sources)
    commits: dict[str, str | None]
    version: str
    #: resolved path -> content key (``ckptxform.sources.file_content``)
    contents: dict[str, str] = dataclasses.field(default_factory=dict)

    def record_fields(self) -> dict[str, Any]:
        """What the audit's run record adds for this digest."""
        return {"digest": self.sha256, "plan_sha256": self.plan_sha256, "files_read": self.files_read,
                "contents": self.contents}

    def large_files(self) -> list[str]:
        """The files keyed by size and header only (their pins count too); not a path that
        could not be read as a file (a vocabulary map given as a folder: its pin counts)."""
        return [path for path, key in self.contents.items() if key.startswith("size=")]


def run_digest(plan: Plan) -> RunDigest:
    """The digest of ``plan`` and of everything it read.

    >>> run_digest(plan).sha256          # doctest: +SKIP
    '3f1c...'
    """
    decided = {"name": plan.rules.name, "output": plan.rules.output, "outputs": plan.outputs,
               "records": plan.records, "config": plan.config, "files": plan.files}
    plan_sha256 = _sha256_by_item(decided)
    files_read = {pin.path: pin.stamp for pin in plan.files_read()}
    contents = {path: _content_key(path) for path in files_read}
    commits = {name: record.commit for name, record in sorted(plan.sources.items())}
    return RunDigest(_whole_sha256(plan_sha256, files_read, contents, commits), plan_sha256, files_read,
                     commits, __version__, contents)


def _whole_sha256(plan_sha256: str, files_read: dict[str, str], contents: dict[str, str],
                  commits: dict[str, str | None]) -> str:
    files = {path: key if is_whole(key) else f"{key} {files_read[path]}" for path, key in contents.items()}
    return _sha256({"version": __version__, "plan": plan_sha256, "contents": files, "commits": commits})


def _content_key(path: str) -> str:
    try:
        return content_key(path)
    except OSError as err:  # gone since it was read: the pin check before the commit says so
        return f"unreadable: {err.strerror or err}"


def file_digests(digest: RunDigest) -> dict[str, str]:
    """The whole digest of every large file ``digest`` keys by size and header, for the
    run record: what a rerun compares when such a file's pin moved but its key did not."""
    return {path: whole_digest(path) for path in digest.large_files()}


def changes(now: RunDigest, run: dict[str, Any], rules_path: str) -> list[str]:
    """What differs between ``now`` and the ``run`` record of an earlier output, each part
    worded to follow "was made from"; empty when its digest is ``now``'s."""
    if run.get("digest") == now.sha256:
        return []
    if not isinstance(run.get("digest"), str) or not isinstance(run.get("files_read"), dict):
        return [f"inputs its audit does not pin (written by ckptxform {quote(run.get('version'))}, which "
                "recorded no digest of them)"]
    found = []
    if run.get("version") != now.version:
        found.append(f"ckptxform {quote(run.get('version'))} (this is {now.version})")
    sources = run.get("sources")
    before: dict[str, Any] = sources if isinstance(sources, dict) else {}
    if set(before) != set(now.commits):
        found.append(f"sources {', '.join(map(repr, sorted(before))) or '(none)'}, not "
                     f"{', '.join(map(repr, sorted(now.commits)))}")
    for name, commit in now.commits.items():
        then = before.get(name)
        if isinstance(then, dict) and then.get("commit") != commit:
            found.append(f"source {quote(name)} at commit {quote(then.get('commit'))}, now {commit}")
    then_contents = run.get("contents")
    keyed = isinstance(then_contents, dict) and bool(now.contents)
    # an audit from before content keys has only its pins to compare
    found += _changed_files(then_contents if keyed else run["files_read"], run, now, keyed=keyed)
    if run.get("plan_sha256") != now.plan_sha256:
        found.append(f"a different plan than {quote(rules_path)} now decides")
    if not found and keyed:
        return []  # only pins moved, of files whose bytes are the same: not a change
    return found or [f"inputs of another digest ({quote(run['digest'][:12])}..., now {now.sha256[:12]}...)"]


def _changed_files(then: dict[str, Any], run: dict[str, Any], now: RunDigest, *, keyed: bool) -> list[str]:
    """The files read then or now whose content differs, each named with how; ``then``
    holds content keys (``keyed``) or, from an older audit, pins."""
    found = []
    current = now.contents if keyed else now.files_read
    for path in sorted(set(then) | set(current)):
        if path not in current:
            found.append(f"{quote(path)}, which this run does not read")
        elif path not in then:
            found.append(f"inputs without {quote(path)}, which this run reads")
        elif not keyed:
            if then[path] != current[path]:
                found.append(f"an earlier {quote(path)} (written to or replaced since)")
        elif then[path] != current[path]:
            found.append(f"an earlier {quote(path)} ({_how_changed(then[path], current[path])})")
        elif (doubt := _in_doubt(path, then[path], run, now)) is not None:
            found.append(f"an earlier {quote(path)} ({doubt})")
    return found


def _in_doubt(path: str, key: str, run: dict[str, Any], now: RunDigest) -> str | None:
    """How a large file whose key is unchanged differs (None: it does not): when its pin
    moved, by the whole digest the earlier run recorded."""
    pins = run.get("files_read") if isinstance(run.get("files_read"), dict) else {}
    if is_whole(key) or pins.get(path) == now.files_read.get(path):
        return None
    digests = run.get("file_digests") if isinstance(run.get("file_digests"), dict) else {}
    recorded = digests.get(path)
    if recorded is None:
        return ("written to since; its size and header are the same, and the run that read it recorded no "
                "digest of its bytes to compare (apply --hash-inputs records one)")
    return None if _whole_digest(path) == recorded else "its bytes changed; its size and header are the same"


def _how_changed(then: str, now: str) -> str:
    size_then, size_now = _size(then), _size(now)
    if size_then is not None and size_now is not None and size_then != size_now:
        return f"its size went from {size_then:,} to {size_now:,} bytes"
    if size_then is not None and size_now is not None:
        return "its header changed: a key, dtype, shape or offset"
    return "its bytes changed"


def _size(key: str) -> int | None:
    head = key.split(" ", 1)[0]
    return int(head[5:]) if head.startswith("size=") and head[5:].isdigit() else None


def _whole_digest(path: str) -> str | None:
    try:
        return whole_digest(path)
    except OSError:
        return None


def other_origin(run: dict[str, Any], plan: Plan) -> list[str]:
    """How the run that made an earlier output differs from this one in rule and sources,
    each part worded to follow "was made"; empty when it was this rule on these sources.
    Said before any finer difference: that OUT came from another conversion explains the rest."""
    rules, found = plan.rules, []
    if run.get("name") != rules.name:
        found.append(f"by another rule ({quote(run.get('name'))} from {quote(run.get('rules'))})")
    then = run.get("sources") if isinstance(run.get("sources"), dict) else {}
    moved = [f"{name} {quote(_location(then.get(name)))} then, {quote(src.location)} now"
             for name, src in sorted(plan.sources.items()) if _location(then.get(name)) != src.location]
    if moved:
        found.append("from other sources (" + "; ".join(moved) + ")")
    return found


def _location(record: Any) -> Any:
    return record.get("location") if isinstance(record, dict) else None


def _sha256(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


#: a dataclass -> the names of its fields that are not positions (looked up once a class:
#: ``dataclasses.fields`` per value was most of hashing a 20,000-tensor plan)
_FIELDS: dict[type, tuple[str, ...]] = {}
_PLAIN = frozenset({str, int, float, bool, type(None)})


def _sha256_by_item(obj: dict[str, Any]) -> str:
    """``_sha256(_canonical(obj))``, with its tuples and lists canonicalized and hashed an
    item at a time: a plan's outputs and records are one item a tensor, and the whole
    canonical tree at 20,000 tensors was tens of MB held at once."""
    sha = hashlib.sha256()

    def text(value: Any) -> None:
        sha.update(json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
                   .encode("utf-8", "surrogatepass"))

    sha.update(b"{")
    for i, key in enumerate(sorted(obj)):
        if i:
            sha.update(b",")
        text(key)
        sha.update(b":")
        value = obj[key]
        if isinstance(value, _SEQUENCES):
            sha.update(b"[")
            for j, item in enumerate(value):
                if j:
                    sha.update(b",")
                text(_canonical(item))
            sha.update(b"]")
        else:
            text(_canonical(value))
    sha.update(b"}")
    return sha.hexdigest()


def _canonical(value: Any) -> Any:
    """``value`` as plain JSON data: dataclasses by field (positions left out), tuples as lists."""
    kind = type(value)
    if kind in _PLAIN:  # first: a plan holds row maps of 32,000 ids
        return value
    names = _FIELDS.get(kind)
    if names is None and dataclasses.is_dataclass(value) and not isinstance(value, type):
        # a field held in another form is hashed as the attribute that reads it (a record's reason)
        read_as = getattr(kind, "DIGEST_AS", {})
        names = _FIELDS[kind] = tuple(read_as.get(f.name, f.name) for f in dataclasses.fields(value)
                                      if f.name not in _POSITIONS)
    if names is not None:
        out = {"type": kind.__name__}
        for name in names:
            field = getattr(value, name)
            if not isinstance(field, Where):
                out[name] = field if type(field) in _PLAIN else _canonical(field)
        return out
    if value is None or isinstance(value, (str, int, float)):
        return value
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, _SEQUENCES):
        return [v if type(v) in _PLAIN else _canonical(v) for v in value]
    return value
