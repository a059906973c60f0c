"""Every error ckptxform raises, in one place.

Each error is a ``CkptxformError`` and also the builtin a caller would expect
(``FileNotFoundError``, ``ValueError``, ...), carries the fields a script can act on
(``path``, ``line``, ``source``, ``key``), and has a message that quotes the bad value
and ends with the fix. The CLI maps them to exit codes through ``exit_code``.

Every message passes ``redact`` when the error is made (and the CLI's printer, the log and
the audit pass it too): a token echoed by a server never reaches a terminal or a file.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterable
from pathlib import Path

#: what is left of a secret in a message
REDACTED = "***"
_SECRET_PATTERNS = (
    # an Authorization header as text: "Authorization: Bearer X", "'authorization': 'X'"
    re.compile(r"(?i)(\b(?:proxy-)?authorization[\"']?\s*[:=]\s*[\"']?(?:(?:bearer|basic|token)\s+)?)[^\s\"',;}]+"),
    re.compile(r"(?i)(\bbearer\s+)[^\s\"',;}]+"),
    re.compile(r"(\bhf_)[A-Za-z0-9]{8,}"),  # Hugging Face user and org tokens
    # signed URLs (CDN) and token query parameters
    re.compile(r"(?i)([?&](?:x-amz-)?(?:signature|credential|security-token|token|sig)=)[^&\s\"']+"),
)
#: what every match of ``_SECRET_PATTERNS`` contains: a text without it skips the four
#: substitutions (an audit writes one line a tensor, almost never with a secret)
_MAY_HOLD_SECRET = re.compile(r"(?i)authoriz|bearer|hf_|[?&]")
_TOKEN_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


def _may_hold_secret(text: str) -> bool:
    """``_MAY_HOLD_SECRET.search(text)``, answered by substring tests where ``text`` is
    ASCII (the case-insensitive alternation cost 18 us an audit line; this, 1 us)."""
    if not text.isascii():
        return _MAY_HOLD_SECRET.search(text) is not None
    low = text.lower()
    return "authoriz" in low or "bearer" in low or "hf_" in low or "?" in text or "&" in text
_registered: set[str] = set()


def register_secret(value: str | None) -> None:
    """Have ``redact`` remove ``value`` wherever it appears (a token read from a file)."""
    if value and len(value) >= 8:
        _registered.add(value)


def redact(text: str) -> str:
    """``text`` without tokens: Authorization values, bearer tokens, ``hf_...`` tokens,
    signatures of signed URLs, and the values of HF_TOKEN and registered secrets.

    >>> redact("401: bad header Authorization: Bearer hf_abcdefghijkl")
    '401: bad header Authorization: Bearer ***'
    """
    secrets = _registered | {v for v in (os.environ.get(n) for n in _TOKEN_VARIABLES) if v and len(v) >= 8}
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    if not _may_hold_secret(text):
        return text
    for pattern in _SECRET_PATTERNS:
        text = pattern.sub(lambda m: m.group(1) + REDACTED, text)
    return text


class CkptxformError(Exception):
    """Base of all ckptxform errors. ``str(err)`` is the one-line message for users."""

    exit_code = 1

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        line: int | None = None,
        col: int | None = None,
        source: str | None = None,
        key: str | None = None,
    ) -> None:
        message = redact(message)
        super().__init__(message)
        self.message = message
        self.path = path
        self.line = line
        self.col = col
        self.source = source
        self.key = key

    def __str__(self) -> str:
        return self.message


class UsageError(CkptxformError, ValueError):
    """The command line or an API call is malformed."""

    exit_code = 2


class RuleError(CkptxformError, ValueError):
    """A rule file is invalid. ``problems`` holds every ``FILE:LINE:COL: ...`` message;
    ``path``, ``line`` and ``col`` say where the first one is, when known."""

    exit_code = 2

    def __init__(self, problems: Iterable[str], *, path: str | None = None, line: int | None = None,
                 col: int | None = None) -> None:
        self.problems = [redact(p) for p in problems]
        super().__init__("\n".join(self.problems), path=path, line=line, col=col)


class CheckpointFormatError(CkptxformError, ValueError):
    """A checkpoint file is malformed or hostile (bad header, offsets, pickled code...)."""


class SourceNotFoundError(CkptxformError, FileNotFoundError):
    """A source location, file or tensor does not exist."""


class SourceChangedError(CkptxformError, RuntimeError):
    """A source file changed between the plan and the end of the run (rewritten in place,
    replaced, deleted)."""


class VocabMapError(CkptxformError, ValueError):
    """A vocabulary map (d2t/t2d) is inconsistent or declared with the wrong encoding."""


class PlanError(CkptxformError, ValueError):
    """The rules cannot be applied to these sources (unmatched tensor, shape mismatch...)."""


class UnmatchedRuleError(PlanError):
    """The rule file does not fit the checkpoint: a tensor rule matches no tensor of it, or
    a tensor of it matches no rule. ``location``: the checkpoint; ``summary``: the problem
    in a few words (``ckptxform rules --for`` lists it as the reason)."""

    location: str | None = None
    summary: str | None = None


class QuantizationConfigError(PlanError):
    """A source's ``quantization_config`` is missing, unsupported or does not describe its tensors."""


class RequirementError(PlanError):
    """A ``require`` assertion of the rule file does not hold."""


class PluginError(CkptxformError, ImportError):
    """An installed plug-in (an op or a source format of another package) cannot be loaded
    or is not well formed; the message names the package and its entry point."""


class OutputError(CkptxformError, OSError):
    """The output cannot be written (exists, locked, disk full...)."""


class TempSpaceError(CkptxformError, OSError):
    """The temporary directory (``TMPDIR``) cannot hold a plan's working data: it is full
    or failed; ``path`` names it."""


class VerifyError(CkptxformError, ValueError):
    """A written output does not match its audit log."""


class HubError(CkptxformError, ConnectionError):
    """A Hub source failed; subclasses say how."""


class RepoNotFoundError(HubError):
    """The repository does not exist or is private without a token."""


class GatedRepoError(HubError):
    """The repository is gated and the token has no access."""


class RevisionNotFoundError(HubError):
    """The branch, tag or commit does not exist in the repository."""


class EntryNotFoundError(HubError, FileNotFoundError):
    """A file does not exist at the resolved revision."""


class OfflineCacheMissError(HubError, FileNotFoundError):
    """``HF_HUB_OFFLINE=1`` and a needed file is not in the cache."""


class NotAFileError(CkptxformError, OSError):
    """A path that must be a regular file is a FIFO, a device, a socket or a directory
    (reading one could wait forever, or never end); ``kind`` says which."""

    def __init__(self, message: str, *, path: str, kind: str) -> None:
        super().__init__(message, path=path)
        self.kind = kind


class FileTooLargeError(CkptxformError, ValueError):
    """A small file (a config, an index, a rule file) is larger than its bound, ``limit``."""

    def __init__(self, message: str, *, path: str, limit: int) -> None:
        super().__init__(message, path=path)
        self.limit = limit


class PathEncodingError(CkptxformError, ValueError):
    """A path is not valid UTF-8 (the audit log, JSON and messages need text)."""


class OutputStreamError(CkptxformError, OSError):
    """Standard output was closed or is full (``| head -c1``, ``> /dev/full``)."""


def quote(text: object) -> str:
    """Text from an input (a tensor name, a path, a value) as messages embed it: quoted,
    repr-style, every control or unprintable character an escape, so a name holding an
    ANSI escape, a NUL or a newline stays visible, harmless and on one line (a name
    ``evil<ESC>[31m<LF>x`` is shown as ``'evil\\x1b[31m\\nx'``)."""
    return repr(text if isinstance(text, str) else str(text))


def printable(text: str) -> str:
    """``text`` as it is when every character is printable (names in tables stay bare),
    else ``quote(text)``."""
    return text if text.isprintable() else quote(text)


def terminal_line(line: str) -> str:
    """One message line made safe for a terminal: any control character that reached it
    unquoted becomes its escape (the last guard; messages quote inputs with ``quote``)."""
    return line if line.isprintable() else "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in line)


def quote_keys(keys: Iterable[str], limit: int = 8) -> str:
    """Sorted, quoted, and cut with a count: ``'a', 'b' and 3 more``."""
    ordered = sorted(set(keys))
    shown = ", ".join(quote(k) for k in ordered[:limit])
    if len(ordered) > limit:
        shown += f" and {len(ordered) - limit} more"
    return shown or "(none)"


def io_error(action: str, path: Path | str, err: OSError) -> OutputError:
    """The one-line message for a failed write, with the fix that fits the errno."""
    fixes = {
        errno.ENOSPC: "free space or choose another --out",
        errno.EDQUOT: "free space within your quota or choose another --out",
        errno.EFBIG: "raise the file size limit (ulimit -f) or set a smaller output.max_shard_size",
        errno.EACCES: "check the permissions of the output directory or choose another --out",
        errno.EROFS: "choose an --out on a writable filesystem",
    }
    reason = err.strerror or str(err)
    fix = fixes.get(err.errno or 0, "check the output directory or choose another --out")
    return OutputError(f"{action} {str(path)!r} failed: {reason}; {fix}", path=str(path))
