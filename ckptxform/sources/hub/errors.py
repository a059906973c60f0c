"""Hub failures, retried when transient and turned into one ckptxform error line.

huggingface_hub raises its own errors (``GatedRepoError``, ``RevisionNotFoundError``...)
with multi-line messages written for its own API. A provisioning script needs one line
that names the source by its rule name, the repo and the revision, and says what to
do; ``call_hub`` runs a Hub call, retries 5xx, 429, dropped connections and cut
responses with backoff (or after the server's ``Retry-After``, up to
``MAX_RETRY_AFTER``: a longer wait fails at once), and maps everything else through
``translate``. Messages never include request headers, and every ckptxform error
redacts tokens from its text (``errors.redact``), so a server echoing the
``Authorization`` header cannot leak the token either.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ckptxform.errors import (
    CkptxformError,
    EntryNotFoundError,
    GatedRepoError,
    HubError,
    OfflineCacheMissError,
    RepoNotFoundError,
    RevisionNotFoundError,
)
from ckptxform.log import logger
from ckptxform.sources.hub.bounded import (
    MAX_RETRY_AFTER,
    STALL_VARIABLE,
    Stalled,
    WaitTooLong,
)
from ckptxform.sources.hub.http import BadAnswer, CutResponse

_TRANSIENT_STATUS = (408, 429, 500, 502, 503, 504)
_T = TypeVar("_T")


@dataclass(frozen=True)
class Retry:
    """How transient failures (5xx, 429, connection errors, cut responses) are retried:
    ``tries`` attempts in all, waiting ``first_wait`` seconds, doubling up to ``max_wait``."""

    tries: int = 5
    first_wait: float = 1.0
    max_wait: float = 8.0

    def wait(self, attempt: int) -> float:
        return float(min(self.max_wait, self.first_wait * 2 ** (attempt - 1)))


@dataclass(frozen=True)
class HubWhere:
    """What a message names: the source, the repo, the revision asked and its commit."""

    repo_id: str
    revision: str | None
    name: str | None
    commit: str | None

    def who(self) -> str:
        where = f"Hub repo {self.repo_id}@{self.revision}" if self.revision else f"Hub repo {self.repo_id}"
        return f"source {self.name!r} ({where})" if self.name else where

    def rev(self) -> str:
        return f"revision {self.revision!r}" if self.revision else "the default branch"

    def what(self, file: str | None) -> str:
        return f"file {file!r}" if file else f"the commit of {self.rev()}"


def call_hub(fn: Callable[[], _T], *, where: HubWhere, file: str | None, retry: Retry) -> _T:
    """``fn()``, retrying transient failures, with every Hub failure turned into one
    ckptxform error about ``file`` (None: the revision lookup)."""
    for attempt in range(1, retry.tries + 1):
        try:
            return fn()
        except CkptxformError:
            raise
        except Exception as exc:
            bound = _past_a_bound(exc, where, file)
            if bound is not None:
                raise bound from exc
            reason = transient_reason(exc)
            if reason is None:
                translated = translate(exc, where, file)
                if translated is exc:
                    raise
                raise translated from exc
            if attempt == retry.tries:
                raise HubError(
                    f"{where.who()}: could not read {where.what(file)} after {attempt} tries (last: {reason}); "
                    f"check the network and HF_ENDPOINT ({_endpoint()}) and rerun",
                    source=where.name,
                    path=file,
                ) from exc
            wait = retry.wait(attempt)
            asked = _retry_after(exc)
            if asked is not None:
                if asked > MAX_RETRY_AFTER:
                    raise _wait_too_long(asked, reason, where, file) from exc
                wait = max(wait, asked)
            logger.warning(f"{where.who()}: {reason} reading {where.what(file)}; retrying in {wait:g}s")
            time.sleep(wait)
    raise AssertionError("unreachable: Retry.tries must be at least 1")


def _past_a_bound(exc: BaseException, where: HubWhere, file: str | None) -> HubError | None:
    """The error for a request that asked a longer wait than ckptxform's, or was answered
    stopped past the stall bound (``bounded``), wherever huggingface_hub wrapped it; else None."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, WaitTooLong):
            return _wait_too_long(seen.seconds, f"HTTP {seen.status}", where, file)
        if isinstance(seen, Stalled):
            return HubError(f"{where.who()}: {where.what(file)}: the server stopped sending (no byte for "
                            f"{seen.seconds:g} s, after {seen.received} bytes of the answer); check the network, "
                            f"or raise {STALL_VARIABLE} for a server that pauses longer", source=where.name, path=file)
        seen = seen.__cause__ or seen.__context__
    return None


def _wait_too_long(asked: float, reason: str, where: HubWhere, file: str | None) -> HubError:
    return HubError(f"{where.who()}: the server asks to wait {asked:g} s ({reason}) before reading "
                    f"{where.what(file)}, longer than ckptxform waits ({MAX_RETRY_AFTER:g} s); rerun later",
                    source=where.name, path=file)


def _retry_after(exc: BaseException) -> float | None:
    """The seconds a 429 or 503 answer's ``Retry-After`` asks for (a number; a date is
    taken as a long wait), or None."""
    response = getattr(exc, "response", None)
    value = getattr(response, "headers", {}).get("Retry-After") if response is not None else None
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return float("inf")


def transient_reason(exc: BaseException) -> str | None:
    """Why ``exc`` is worth a retry (a 5xx, 429, timeout, dropped or cut connection), or None."""
    from huggingface_hub import constants, errors

    if constants.is_offline_mode():
        return None
    if isinstance(exc, CutResponse):
        return f"incomplete response ({exc})"
    if isinstance(exc, errors.HfHubHTTPError) and exc.response is not None:
        code = exc.response.status_code
        return f"HTTP {code}" if code in _TRANSIENT_STATUS else None
    if isinstance(exc, errors.RevisionResolutionError) and exc.__cause__ is not None:
        return transient_reason(exc.__cause__)
    if _is_transport(exc):
        return f"connection error ({type(exc).__name__})"
    if isinstance(exc, OSError) and str(exc).startswith("Consistency check failed"):
        return "download cut short"
    return None


def translate(exc: Exception, where: HubWhere, file: str | None) -> Exception:
    """The ckptxform error for a huggingface_hub, HTTP or I/O failure; ``exc`` itself
    when it is none of those (a bug should keep its traceback)."""
    from huggingface_hub import constants, errors

    who, what, fields = where.who(), where.what(file), {"source": where.name, "path": file}
    if isinstance(exc, BadAnswer):
        return HubError(f"{who}: {what}: {exc.reason}", **fields)
    if type(exc).__name__ == "TooManyRedirects":
        return HubError(f"{who}: {what}: the server redirected in a loop ({_short(exc)}); check HF_ENDPOINT "
                        "and any proxy", **fields)
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, errors.GatedRepoError):  # before RepositoryNotFoundError, its base
        why = "no token was sent" if status == 401 else "the token has no access to it"
        return GatedRepoError(
            f"{who}: the repo is gated and {why}; accept the conditions on the repo page "
            f"({_endpoint()}/{where.repo_id}) and set HF_TOKEN or run `hf auth login`",
            **fields,
        )
    if isinstance(exc, errors.RepositoryNotFoundError):
        return RepoNotFoundError(
            f"{who}: repo not found on {_endpoint()} (or it is private and the token has no access); "
            "check the name, or set HF_TOKEN or run `hf auth login` for a private repo",
            **fields,
        )
    if isinstance(exc, errors.RevisionNotFoundError):
        return RevisionNotFoundError(
            f"{who}: {where.rev()} does not exist in the repo; give an existing branch, tag or commit "
            f"(see {_endpoint()}/{where.repo_id}/tree/main)",
            **fields,
        )
    if isinstance(exc, errors.RemoteEntryNotFoundError):
        return EntryNotFoundError(f"{who}: {what} does not exist at commit {where.commit}", **fields)
    offline_errors = (errors.OfflineModeIsEnabled, errors.LocalEntryNotFoundError, errors.RevisionResolutionError)
    if constants.is_offline_mode() and isinstance(exc, offline_errors):
        if file is None:
            fix = f"pin the source to a commit, or run once without HF_HUB_OFFLINE=1 to resolve {where.rev()}"
        else:
            fix = (
                "run once without HF_HUB_OFFLINE=1, or fill the cache with "
                f"`hf download {where.repo_id} {file} --revision {where.commit}`"
            )
        return OfflineCacheMissError(
            f"{who}: HF_HUB_OFFLINE=1 and {what} is not in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}); {fix}",
            **fields,
        )
    if isinstance(exc, (errors.LocalEntryNotFoundError, errors.RevisionResolutionError)) or _is_transport(exc):
        # huggingface_hub has already retried these before giving up.
        return HubError(
            f"{who}: could not reach {_endpoint()} for {what} ({_short(exc.__cause__ or exc)}) and it is "
            "not in the Hugging Face cache; check the network and HF_ENDPOINT and rerun",
            **fields,
        )
    if isinstance(exc, errors.HfHubHTTPError):
        server = f": {exc.server_message}" if getattr(exc, "server_message", None) else ""
        return HubError(f"{who}: HTTP {status} reading {what}{server}", **fields)
    if isinstance(exc, OSError):
        return HubError(f"{who}: reading {what} failed: {_short(exc)}", **fields)
    return exc


def _is_transport(exc: BaseException) -> bool:
    try:
        import httpx2 as httpx
    except ImportError:  # huggingface_hub 1.x uses httpx
        import httpx  # type: ignore[no-redef]
    return isinstance(exc, httpx.TransportError)


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    text = text if len(text) <= 160 else text[:157] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _endpoint() -> str:
    from huggingface_hub import constants

    return str(constants.ENDPOINT)
