"""``RunOptions``: every setting of a run, one object from the CLI through the API to the job."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import UsageError
from ...tensor_digest import DEFAULT_DIGEST, check_digest


@dataclass(frozen=True)
class RunOptions:
    """How ``apply`` writes OUT (see ``ckptxform.apply`` for each setting).

    ``executor`` is a name of engine/run/executors.py's registry; ``shard_of=(RANK, WORLD)``
    writes only that rank's shards; ``finalize`` writes none and commits OUT."""

    force: bool = False
    #: a progress bar on stderr (None: when stderr is a terminal)
    progress: bool | None = False
    fsync: bool = True
    require_pinned: bool = False
    digest: str = DEFAULT_DIGEST
    jobs: int | None = None
    resume: bool = True
    executor: str = "local"
    ray_address: str | None = None
    shard_of: tuple[int, int] | None = None
    finalize: bool = False
    #: the plan's first warning is an error (``--strict``)
    strict: bool = False
    #: hash every large input whole at the end (one more read of each): what lets a later
    #: rerun tell a touched large file from one with new values in the same layout
    hash_inputs: bool = False

    def __post_init__(self) -> None:
        check_digest(self.digest)
        if self.jobs is not None and self.jobs < 1:
            raise UsageError(f"--jobs must be at least 1, got {self.jobs}")
        if self.shard_of is not None and not 0 <= self.shard_of[0] < self.shard_of[1]:
            rank, world = self.shard_of
            raise UsageError(f"--shard-of {rank}/{world}: RANK must be at least 0 and below WORLD, e.g. 0/4")
