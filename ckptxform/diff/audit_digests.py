"""Tensor digests ``diff`` may take from a checkpoint's audit log instead of hashing its bytes.

An output of ``ckptxform apply`` records every tensor's digest in ``ckptxform_audit.jsonl``.
``diff`` uses them only when the audit describes the checkpoint as it is now:

- the log reads (``verify``'s reader) and ends with the ok summary of a completed run;
- the summary's weight files are exactly the checkpoint's, all safetensors files;
- the ``written`` records name exactly the checkpoint's tensors, each in the file, with
  the shape and dtype its header gives, all by one digest algorithm;
- no weight file was modified after the audit was written (its mtime is not later than the
  audit's: apply writes the audit last, and a copy that keeps mtimes keeps this true).

Anything else (a shard edited or re-copied since, an audit from another run) and the
bytes are hashed; ``diff --rehash`` never reads audits. What ``verify`` checks in full
(every byte against the audit) is not re-done here: this is a shortcut, not a proof.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.output.verify import read_audit
from ..errors import VerifyError, quote
from ..filenames import AUDIT_FILE
from ..sources.base import Checkpoint
from ..sources.local import LocalCheckpoint
from ..tensor_digest import recorded_digest


@dataclass(frozen=True)
class AuditDigests:
    """A checkpoint's audit, when it can stand in for hashing: its algorithm and a digest
    per tensor key; or, when it cannot, ``why_not`` (None: the checkpoint has no audit)."""

    algorithm: str | None = None
    digests: dict[str, str] | None = None
    why_not: str | None = None


def audit_digests(checkpoint: Checkpoint) -> AuditDigests:
    """The digests ``checkpoint``'s audit records, if they can be trusted (module doc)."""
    if not isinstance(checkpoint, LocalCheckpoint):
        return AuditDigests()
    path = checkpoint.root / AUDIT_FILE
    if not path.is_file():
        return AuditDigests()
    try:
        events = read_audit(checkpoint.root)
    except VerifyError as err:
        return AuditDigests(why_not=f"its audit cannot be read ({str(err).splitlines()[0]})")
    try:
        why_not = _why_untrusted(checkpoint, events, path.stat().st_mtime_ns)
    except OSError as err:  # a file gone since the checkpoint was opened: its bytes will say
        return AuditDigests(why_not=f"its files cannot be checked against it ({err.strerror or err})")
    if why_not is not None:
        return AuditDigests(why_not=why_not)
    recorded = {e["key"]: recorded_digest(e) for e in events if e.get("event") == "written"}
    if any(r is None for r in recorded.values()):
        return AuditDigests(why_not="its audit records no digest for some tensors (apply --digest none)")
    algorithms = {r[0] for r in recorded.values() if r is not None}
    if len(algorithms) > 1:
        return AuditDigests(why_not="its audit mixes digest algorithms")
    if not algorithms:  # a checkpoint without tensors: nothing to take
        return AuditDigests()
    return AuditDigests(algorithms.pop(), {k: r[1] for k, r in recorded.items() if r is not None})


def _why_untrusted(checkpoint: LocalCheckpoint, events: list[dict[str, object]], audit_mtime: int) -> str | None:
    summary = events[-1] if events else {}
    if summary.get("event") != "summary" or summary.get("status") != "ok":
        return "its audit has no successful summary"
    files = summary.get("files")
    if not isinstance(files, list) or sorted(map(str, files)) != sorted(checkpoint.files):
        return "its audit lists other weight files than the checkpoint has"
    if not all(f.endswith(".safetensors") for f in checkpoint.files):
        return "its audit covers files that are not safetensors"
    written = {e["key"]: e for e in events if e.get("event") == "written"}
    if set(written) != set(checkpoint.tensors):
        return "its audit lists other tensors than the checkpoint has"
    for key, info in checkpoint.tensors.items():
        entry = written[key]
        if (entry["file"], entry["shape"], entry["dtype"]) != (info.file, list(info.shape), info.dtype):
            return f"its audit describes tensor {quote(key)} otherwise than its header"
    for file in checkpoint.files:
        if (checkpoint.root / file).stat().st_mtime_ns > audit_mtime:
            return f"{quote(file)} was modified after its audit was written"
    return None
