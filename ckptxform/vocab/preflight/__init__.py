"""``ckptxform preflight DIR``: what each consumer (speculators, vLLM, SGLang, llama.cpp,
transformers) would load silently wrong from a drafter a user already has.

Reads headers, configs and the small vocabulary tensors only (``drafter``); each module
checks one thing for one family (``vocab_checks``, ``eagle3``, ``dflash``, ``layers``,
``common``); ``consumers`` holds the table of who reads what how. Findings are data
(``findings``): exit 0 when no consumer is at risk, 1 when one is.
"""

from __future__ import annotations

from collections.abc import Iterable

from .consumers import CONSUMERS, DEFAULT_CONSUMERS, parse_consumers
from .context import Context
from .dflash import dflash_findings, dflash_notes
from .drafter import family_and_layout, open_checkpoint, open_verifier
from .eagle3 import eagle3_findings, eagle3_notes
from .findings import Finding, PreflightReport
from .layers import width_findings
from .vocab_checks import special_notes, vocab_findings
from .common import common_findings

__all__ = ["CONSUMERS", "Finding", "PreflightReport", "preflight"]

_DRAFTER_FAMILIES = ("eagle3", "dflash", "dspark", "mtp")


def preflight(location: str, *, verifier: str | None = None,
              consumers: str | Iterable[str] | None = None) -> PreflightReport:
    """Check the checkpoint at ``location`` for each of ``consumers`` (default: those that
    load its layout), against ``verifier`` when given."""
    asked = parse_consumers(consumers)
    drafter = open_checkpoint(location, name="drafter")
    family, layout = family_and_layout(drafter)
    chosen = asked or DEFAULT_CONSUMERS.get((family, layout), ("transformers",))
    opened = None if verifier is None else open_verifier(verifier)
    ctx = Context(drafter, opened, family, layout, chosen)
    findings: list[Finding] = []
    if family in _DRAFTER_FAMILIES:
        findings += vocab_findings(ctx) + width_findings(ctx)
    if family == "eagle3":
        findings += eagle3_findings(ctx)
    elif family in ("dflash", "dspark"):
        findings += dflash_findings(ctx)
    findings += common_findings(ctx)
    unchecked = [] if opened is not None else [
        "verifier layer ids against the verifier's layer count, widths and vocabulary against the verifier's "
        "(give --verifier)"]
    order = {c: i for i, c in enumerate(CONSUMERS)}
    findings.sort(key=lambda f: order[f.consumer])
    notes = (special_notes(ctx) + eagle3_notes(ctx) + dflash_notes(ctx)) if family in _DRAFTER_FAMILIES else []
    return PreflightReport(location, family, layout, chosen, tuple(findings), tuple(unchecked),
                           None if opened is None else opened.location, tuple(notes))
