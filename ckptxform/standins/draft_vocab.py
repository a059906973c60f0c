"""Deterministic draft vocabularies that overlap like the Kimi-K2 and Kimi-K2.5 maps."""

from __future__ import annotations

import random

from ckptxform.errors import UsageError

__all__ = ["make_draft_vocab"]


def make_draft_vocab(vocab: int, draft_vocab: int, *, seed: int,
                     shared_prefix: int | None = None,
                     shared_fraction: float = 0.8) -> tuple[int, ...]:
    """A draft vocabulary: ``draft_vocab`` sorted target ids out of ``vocab``.

    Two calls with different seeds behave like the Kimi-K2 and Kimi-K2.5 maps: the first
    ``shared_prefix`` ids (special and byte tokens) coincide, a fraction of about
    ``shared_fraction`` of the tokens is in both (6,250 of 32,000 K2 tokens are not in the
    K2.5 map: 0.80), and because each map is sorted, few other positions hold the same id
    (a fraction falling like 1/sqrt(draft_vocab): ~8% at 512 tokens, ~1% at 32,000; the
    real pair agrees at 252 of 32,000). Every map is drawn from one pool of "frequent" tokens that depends only on the
    sizes, so any two seeds share ``n*n/pool`` tokens on average.
    Deterministic: the same arguments give the same map on every run.

    >>> k2 = make_draft_vocab(4096, 512, seed=1)
    >>> len(k2), k2 == tuple(sorted(k2))
    (512, True)
    """
    if not 0 < draft_vocab <= vocab:
        raise UsageError(f"make_draft_vocab: draft_vocab={draft_vocab} must be in "
                         f"[1, vocab={vocab}]")
    prefix = max(4, draft_vocab // 128) if shared_prefix is None else shared_prefix
    prefix = min(prefix, draft_vocab)
    if prefix < 0:
        raise UsageError(f"make_draft_vocab: shared_prefix={shared_prefix} is negative")
    if not 0 < shared_fraction <= 1:
        raise UsageError(f"make_draft_vocab: shared_fraction={shared_fraction} must be in "
                         "(0, 1]")
    drawn = draft_vocab - prefix
    pool_size = min(vocab - prefix, round(drawn / shared_fraction))
    # String seeds go through SHA-512 in random.Random, so the draw does not depend on
    # PYTHONHASHSEED; the pool's seed leaves out `seed` so that every map shares it.
    pool = random.Random(f"pool:{vocab}:{draft_vocab}:{prefix}:{pool_size}").sample(
        range(prefix, vocab), pool_size)
    chosen = random.Random(f"map:{seed}").sample(sorted(pool), drawn)
    return tuple(range(prefix)) + tuple(sorted(chosen))
