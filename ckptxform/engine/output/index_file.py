"""The shard index (``model.safetensors.index.json``), written a key at a time.

The text is ``json.dumps(index, indent=2)`` of ``{"metadata": {"total_size": N},
"weight_map": {key: file, ...}}`` with the keys given in order, byte for byte, but never
held: the run's commit hands each key over as it merges the shards' records (a dict of
every key was ~50 bytes a tensor, the sorted keys of every shard 8).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO


class IndexFile:
    """``add`` each ``(key, file)`` in key order, then ``close``."""

    def __init__(self, path: Path, total_size: int) -> None:
        self.path = path
        #: its name in OUT, for messages
        self.name = path.name
        self._file: IO[str] = path.open("w", encoding="utf-8")
        self._separator = "\n    "
        #: ``json.dumps`` of each file name, made once a file
        self._quoted: dict[str, str] = {}
        self._file.write(f'{{\n  "metadata": {{\n    "total_size": {total_size}\n  }},\n  "weight_map": {{')

    def add(self, key: str, file: str) -> None:
        quoted = self._quoted.get(file)
        if quoted is None:
            quoted = self._quoted[file] = json.dumps(file)
        self._file.write(f"{self._separator}{json.dumps(key)}: {quoted}")
        self._separator = ",\n    "

    def close(self) -> None:
        """Write the end of the text and close the file."""
        if not self._file.closed:
            self._file.write("}\n}\n" if self._separator == "\n    " else "\n  }\n}\n")
            self._file.close()

    def discard(self) -> None:
        """Close the file as it is (after a failure: the output it is in is not committed)."""
        self._file.close()
