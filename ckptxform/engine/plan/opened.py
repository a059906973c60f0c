"""The open checkpoints a plan reads from: a handle apart from the plan (a value), which
whoever opened it closes (``with``, or ``close()``). Recipes read their bytes through it
(it is their ``Sources``); a worker opens its own from the pins its task carries."""

from __future__ import annotations

from dataclasses import dataclass

from ...sources.base import Checkpoint
from ...sources.pins import FilePin
from ...vocab.maps import VocabMap


@dataclass
class OpenSources:
    checkpoints: dict[str, Checkpoint]
    vocab_maps: dict[str, VocabMap]

    def pins(self) -> tuple[FilePin, ...]:
        """Every local file read so far through these checkpoints, as it stood when read."""
        return tuple(pin for ckpt in self.checkpoints.values() for pin in ckpt.pins())

    def close(self) -> None:
        for ckpt in self.checkpoints.values():
            ckpt.close()

    def __enter__(self) -> OpenSources:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
