"""Does the rule ``diff --emit-rules`` wrote reproduce B? It is applied to A (in a
temporary directory, removed after) and its output compared with B tensor by tensor:
keys, dtypes, shapes and bytes. What it does not reproduce is named with the reason, so
that ``diff`` never claims a rule file that converts A into something other than B.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from .checkpoint import CheckpointDiff
from .emit import rules_yaml
from .yaml_text import yaml_comment, yaml_string
from ..errors import CkptxformError, quote_keys
from ..sources.base import Checkpoint, TensorInfo
from ..sources.resolve import open_location

#: bytes compared at once
_CHUNK = 16 << 20


class NotReproduced(CkptxformError):
    """The emitted rule, applied to A, does not give B (exit 1); ``text``: the rule file,
    what it does not reproduce listed at its end."""

    def __init__(self, text: str, message: str) -> None:
        super().__init__(message)
        self.text = text


def checked_rules(diff: CheckpointDiff, saved_as: str | None = None) -> str:
    """``diff``'s rule file (``emit.rules_yaml``), checked: ``NotReproduced``
    (its text, with each tensor not reproduced listed at its end) unless it gives B."""
    text = rules_yaml(diff, saved_as)
    failed, gaps = reproduction_gaps(diff)
    if failed is None and not gaps:
        return text
    lines = ([f"does not apply to A: {yaml_comment(failed)}"] if failed is not None else
             [f"{yaml_string(k)}: {yaml_comment(why)}" for k, why in gaps])
    text += "# NOT REPRODUCED: applied to A, this rule file does not give B:\n"
    text += "".join(f"#   {line}\n" for line in lines)
    keys = [k for k, _ in gaps]
    message = (f"the emitted rule does not apply to A ({failed})" if failed is not None else
               f"the emitted rule does not reproduce B: {len(keys)} tensor(s) differ ({quote_keys(keys, limit=5)})")
    raise NotReproduced(text, message + "; the rule file lists why at its end: edit it, then check it with "
                                        "ckptxform apply")


def reproduction_gaps(diff: CheckpointDiff) -> tuple[str | None, list[tuple[str, str]]]:
    """(why ``diff``'s rule does not apply to A, or None; (key, why) of every tensor of B
    it does not reproduce applied to A, or writes and B has not)."""
    from .. import api

    with tempfile.TemporaryDirectory(prefix="ckptxform-diff-") as tmp:
        rules = Path(tmp) / "emitted.yaml"
        rules.write_text(rules_yaml(diff, str(rules)), "utf-8")
        try:
            api.apply(rules, out=Path(tmp) / "out", progress=False, fsync=False)
        except CkptxformError as err:
            return str(err).splitlines()[0].replace(str(rules), "the rule file"), []
        with open_location(str(Path(tmp) / "out"), name="output") as got, \
                open_location(diff.location_b, name="B") as want:
            return None, _compare(got, want)


def _compare(got: Checkpoint, want: Checkpoint) -> list[tuple[str, str]]:
    gaps = [(key, "not written (B has it; no rule makes it from A's tensors)")
            for key in set(want.tensors) - set(got.tensors)]
    gaps += [(key, "written, but B has no such tensor") for key in set(got.tensors) - set(want.tensors)]
    for key in set(got.tensors) & set(want.tensors):
        a, b = got.tensors[key], want.tensors[key]
        if (a.dtype, tuple(a.shape)) != (b.dtype, tuple(b.shape)):
            gaps.append((key, f"written as {a.dtype} {list(a.shape)}, B has {b.dtype} {list(b.shape)}"))
            continue
        at = _first_difference(got, a, want, b)
        if at is not None:
            gaps.append((key, (f"its bytes differ from B's (from byte {at} of {a.nbytes}): B's values are not A's "
                               "moved (a vocabulary map, a cast or new values); write that part of the rule by hand")))
    return sorted(gaps)


def _first_difference(got: Checkpoint, a: TensorInfo, want: Checkpoint, b: TensorInfo) -> int | None:
    for start in range(0, a.nbytes, _CHUNK):
        length = min(_CHUNK, a.nbytes - start)
        mine, theirs = got.read(a, start, length), want.read(b, start, length)
        if mine != theirs:
            return start + next(i for i, (x, y) in enumerate(zip(mine, theirs)) if x != y)
    return None
