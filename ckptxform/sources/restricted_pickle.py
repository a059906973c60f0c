"""Pickles read with an allow-list: only the globals a format is known to hold are built.

A DCP ``.metadata`` file and the ``data.pkl`` of a ``torch.save`` record are pickles. A
pickle may name any importable callable and have it called; this unpickler resolves a
global only through the caller's table of ``(module, name) -> stand-in`` (a light class or
function of ours, never the real one), so nothing is imported and no code of the file runs.
Any other global is one error that names it.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Mapping
from typing import IO, Any

from ckptxform.errors import CheckpointFormatError, quote


class _Unpickler(pickle.Unpickler):
    def __init__(self, blob: bytes | IO[bytes], allowed: Mapping[tuple[str, str], Any],
                 persistent: Callable[[Any], Any] | None, refuse: Callable[[str], CheckpointFormatError]) -> None:
        super().__init__(io.BytesIO(blob) if isinstance(blob, bytes) else blob)
        self._allowed, self._persistent, self._refuse = allowed, persistent, refuse

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get((module, name))
        if found is None:
            raise self._refuse(f"{module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise self._refuse(f"a persistent id {pid!r}")
        return self._persistent(pid)


def load_restricted(blob: bytes | IO[bytes], allowed: Mapping[tuple[str, str], Any], *, label: str, what: str,
                    persistent: Callable[[Any], Any] | None = None,
                    fix: str = "re-save the checkpoint with the library that writes this format") -> Any:
    """The object pickled in ``blob`` (bytes, or a file read as far as the pickle goes: a
    damaged one is refused at its first bad opcode, not after the file is read whole),
    built from ``allowed``'s stand-ins only. ``label`` (a path) and ``what`` (e.g. "a DCP
    .metadata file") word the errors; ``fix`` ends the refusal of a global."""

    def refuse(name: str) -> CheckpointFormatError:
        return CheckpointFormatError(
            f"{label}: the pickle names {quote(name)}, which {what} never holds; refusing to "
            f"load it (a pickle's globals can run code): {fix}", path=label)

    try:
        return _Unpickler(blob, allowed, persistent, refuse).load()
    except CheckpointFormatError:
        raise
    except Exception as exc:  # truncated or malformed: pickle raises anything from EOFError up
        raise CheckpointFormatError(
            f"{label}: is not a readable pickle ({type(exc).__name__}: {str(exc)[:160]}); "
            f"{what} was truncated or damaged: copy it again from where it was saved", path=label) from None


class Record:
    """A stand-in for a dataclass a format pickles: ``NEWOBJ`` makes it empty and ``BUILD``
    fills its ``__dict__`` from the pickled state (a dict, or a ``(dict, slots)`` pair)."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}
        if not isinstance(state, dict):
            raise TypeError(f"{type(self).__name__}: unexpected pickled state {type(state).__name__}")
        self.__dict__.update(state)

    def get(self, name: str, default: Any = None) -> Any:
        return self.__dict__.get(name, default)


class Named:
    """A pickled global that stands for a value by its name (``torch.bfloat16``)."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"
