"""``diff`` compares values: a digest of every tensor it needs (tensor_digest: BLAKE3 unless a
trusted audit recorded sha256), from an audit (``audit_digests``) or by hashing the bytes.

Memory stays bounded: a tensor is read in bands of ``BAND`` bytes, each fed to its hasher
and dropped, so a run holds at most ``jobs`` bands however large the tensors. Tensors are
hashed on ``jobs`` threads at once, A's and B's interleaved so that both sides' files are
read together (reads and both hashes release the GIL).

Digests also pair tensors that changed name: a tensor only in A and one only in B with
the same dtype, shape and digest hold the same bytes (``lm_head.weight`` ->
``head.weight``), a rename ``diff --emit-rules`` writes.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from .audit_digests import AuditDigests, audit_digests
from ..sources.base import Checkpoint, TensorInfo
from ..tensor_digest import DEFAULT_DIGEST, new_hasher

#: bytes of a tensor read at once
BAND = 8 << 20
#: a group of equal tensors larger than this (pairs of names) is paired in name order
_MAX_SCORED = 10_000


@dataclass(frozen=True)
class ValueComparison:
    """What the digests say. ``differ``: (A's key, B's key) pairs, expected to hold the same
    bytes (the same key, or a rename found from names), whose bytes differ; ``renamed``:
    (A's key, B's key), only in A and only in B, holding the same bytes; ``sources``: per
    side, where its digests came from."""

    algorithm: str
    compared: int
    differ: tuple[tuple[str, str], ...]
    renamed: tuple[tuple[str, str], ...]
    sources: tuple[str, str]
    hashed_bytes: int


@dataclass(frozen=True)
class _Side:
    checkpoint: Checkpoint
    audit: AuditDigests


def compare_values(ca: Checkpoint, cb: Checkpoint, pairs: Iterable[tuple[str, str]], candidates_a: Iterable[str],
                   candidates_b: Iterable[str], *, use_audits: bool = True, jobs: int | None = None) -> ValueComparison:
    """Digests of ``pairs`` (A's key, B's key: expected equal) and of the keys only in one
    side (``candidates_*``) that may be renames of each other."""
    pairs = list(pairs)
    sides = [_Side(c, audit_digests(c) if use_audits else AuditDigests()) for c in (ca, cb)]
    algorithm = next((s.audit.algorithm for s in sides if s.audit.algorithm is not None), DEFAULT_DIGEST)
    cand_a, cand_b = _rename_candidates(ca, cb, candidates_a, candidates_b)
    wanted = [sorted({a for a, _ in pairs} | set(cand_a)), sorted({b for _, b in pairs} | set(cand_b))]
    digests, hashed, notes = _digests(sides, wanted, algorithm, jobs)
    da, db = digests
    differ = tuple((a, b) for a, b in pairs if da[a] != db[b])
    renamed = _pair_by_digest({k: (_header(ca, k), da[k]) for k in cand_a},
                              {k: (_header(cb, k), db[k]) for k in cand_b})
    return ValueComparison(algorithm, len(pairs), differ, renamed, (notes[0], notes[1]), hashed)


def _rename_candidates(ca: Checkpoint, cb: Checkpoint, keys_a: Iterable[str],
                       keys_b: Iterable[str]) -> tuple[list[str], list[str]]:
    """The keys of each side whose dtype and shape some key of the other side has."""
    keys_a, keys_b = list(keys_a), list(keys_b)
    in_a, in_b = {_header(ca, k) for k in keys_a}, {_header(cb, k) for k in keys_b}
    return [k for k in keys_a if _header(ca, k) in in_b], [k for k in keys_b if _header(cb, k) in in_a]


def _header(c: Checkpoint, key: str) -> tuple[str, tuple[int, ...]]:
    return c.tensors[key].dtype, tuple(c.tensors[key].shape)


def _digests(sides: list[_Side], wanted: list[list[str]], algorithm: str,
             jobs: int | None) -> tuple[list[dict[str, str]], int, list[str]]:
    """Each side's digest of each wanted key; the bytes hashed; a note per side."""
    out: list[dict[str, str]] = [{}, {}]
    to_hash: list[list[TensorInfo]] = [[], []]
    notes = []
    for i, (side, keys) in enumerate(zip(sides, wanted)):
        audit = side.audit
        if audit.digests is not None and audit.algorithm == algorithm:
            out[i].update((k, audit.digests[k]) for k in keys)
            notes.append(f"read from its audit ({len(keys)} tensors)")
            continue
        to_hash[i] = sorted((side.checkpoint.tensors[k] for k in keys), key=lambda info: (info.file, info.offset))
        reason = (f"; its audit is not used: {audit.why_not}" if audit.why_not else
                  f"; its audit records {audit.algorithm}, the other side's {algorithm}"
                  if audit.digests is not None else "")
        notes.append(f"hashed ({len(keys)} tensors, {sum(info.nbytes for info in to_hash[i]):,} bytes){reason}")
    _hash([s.checkpoint for s in sides], to_hash, algorithm, max(1, jobs or min(8, os.cpu_count() or 1)), out)
    return out, sum(info.nbytes for side in to_hash for info in side), notes


def _hash(checkpoints: list[Checkpoint], to_hash: list[list[TensorInfo]], algorithm: str, workers: int,
          out: list[dict[str, str]]) -> None:
    """Fill ``out[side][key]`` with the digest of each tensor of ``to_hash[side]``, on
    ``workers`` threads, A's and B's tensors interleaved (both sides' files read together)."""
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptxform-diff") as pool:
        futures: list[tuple[int, str, Future[str]]] = []
        try:
            for n in range(max(map(len, to_hash))):
                for side, infos in enumerate(to_hash):
                    if n < len(infos):
                        futures.append((side, infos[n].key,
                                        pool.submit(tensor_digest, checkpoints[side], infos[n], algorithm)))
            for side, key, future in futures:
                out[side][key] = future.result()
        except BaseException:  # an error or ^C: the tensors not started are not read
            for _, _, future in futures:
                future.cancel()
            raise


def tensor_digest(checkpoint: Checkpoint, info: TensorInfo, algorithm: str) -> str:
    """The ``algorithm`` digest (hex) of tensor ``info``'s bytes, read ``BAND`` at a time."""
    hasher = new_hasher(algorithm, info.nbytes)
    for start in range(0, info.nbytes, BAND):
        hasher.update(checkpoint.read(info, start, min(BAND, info.nbytes - start)))
    return hasher.hexdigest()


_Identity = tuple[tuple[str, tuple[int, ...]], str]  # (dtype, shape), digest


def _pair_by_digest(a: dict[str, _Identity], b: dict[str, _Identity]) -> tuple[tuple[str, str], ...]:
    """(A's key, B's key) with the same dtype, shape and bytes; within a group of equal
    tensors (tied weights, zero biases), the closest names first."""
    groups: dict[_Identity, tuple[list[str], list[str]]] = {}
    for side, identities in enumerate((a, b)):
        for key, identity in sorted(identities.items()):
            groups.setdefault(identity, ([], []))[side].append(key)
    pairs = []
    for keys_a, keys_b in groups.values():
        if len(keys_a) * len(keys_b) > _MAX_SCORED:  # any pairing moves the same bytes: in name order
            pairs += zip(keys_a, keys_b)
            continue
        scored = sorted(((-difflib.SequenceMatcher(None, ka, kb).ratio(), ka, kb)
                         for ka in keys_a for kb in keys_b))
        used_a: set[str] = set()
        used_b: set[str] = set()
        for _, ka, kb in scored:
            if ka not in used_a and kb not in used_b:
                pairs.append((ka, kb))
                used_a.add(ka)
                used_b.add(kb)
    return tuple(sorted(pairs))
