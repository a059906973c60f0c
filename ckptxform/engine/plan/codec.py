"""Plan values <-> JSON-able data, through a registry of the classes a codec admits.

``Codec(classes).encode(value)`` turns dataclasses of those classes, tuples, lists,
dicts (any hashable keys), bytes, ranges, paths and ops (named by verb) into plain JSON data;
``decode`` rebuilds them and refuses anything else, naming it: a job file someone edited
can hold wrong values (each class's own checks then refuse them, and a worker checks its
sources against the pins), never a class or code to run.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ...errors import OutputError


#: values encoded as themselves, by exact type (a subclass takes the general path)
_PLAIN = frozenset({str, int, bool, float, type(None)})


#: tuples, lists and dicts longer than this are written an item at a time by ``iter_json``
_STREAMED_LENGTH = 64


class Codec:
    def __init__(self, classes: Iterable[type], ops: Mapping[str, Any]) -> None:
        self._classes = {cls.__name__: cls for cls in classes}
        self._ops = ops
        #: an admitted class -> its init fields' names (``dataclasses.fields`` per value
        #: was a sixth of encoding a 20,000-tensor run plan)
        self._fields: dict[type, tuple[str, ...]] = {}

    def encode(self, value: Any) -> Any:
        kind = type(value)
        if kind in _PLAIN:
            return value
        names = self._fields.get(kind)
        if names is not None:  # an admitted dataclass seen before: the same data as below
            encode = self.encode
            return {"type": kind.__name__,
                    "fields": {name: v if type(v) in _PLAIN else encode(v)
                               for name in names for v in [getattr(value, name)]}}
        if kind is tuple:
            return {"tuple": [v if type(v) in _PLAIN else self.encode(v) for v in value]}
        return self._encode(value)

    def iter_json(self, value: Any, stream: tuple[type, ...]) -> Iterator[str]:
        """``json.dumps(self.encode(value))`` in pieces: the dataclasses of ``stream`` and the
        dicts holding them field by field and item by item, tuples, lists and dicts of more
        than a few items item by item, everything else whole. A run plan is so held
        encoded a tensor at a time, not whole (at 20,000 tensors the whole was 35-60 MB,
        the peak of the run)."""
        kind = type(value)
        if kind in stream:
            yield '{"type": ' + json.dumps(kind.__name__) + ', "fields": {'
            for i, field in enumerate(f.name for f in dataclasses.fields(value) if f.init):
                yield (", " if i else "") + json.dumps(field) + ": "
                yield from self.iter_json(getattr(value, field), stream)
            yield "}}"
        elif (kind is tuple or kind is list) and len(value) > _STREAMED_LENGTH:
            yield '{"tuple": [' if kind is tuple else '{"list": ['
            for i, v in enumerate(value):
                yield (", " if i else "") + json.dumps(self.encode(v))
            yield "]}"
        elif kind is dict and (len(value) > _STREAMED_LENGTH or any(type(v) in stream for v in value.values())):
            yield '{"dict": ['
            for i, (k, v) in enumerate(value.items()):
                yield (", [" if i else "[") + json.dumps(self.encode(k)) + ", "
                yield from self.iter_json(v, stream)
                yield "]"
            yield "]}"
        else:
            yield json.dumps(self.encode(value))

    def _encode(self, value: Any) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, tuple):
            return {"tuple": [self.encode(v) for v in value]}
        if isinstance(value, list):
            return {"list": [self.encode(v) for v in value]}
        if isinstance(value, dict):
            return {"dict": [[self.encode(k), self.encode(v)] for k, v in value.items()]}
        if isinstance(value, bytes):
            return {"bytes": base64.b64encode(value).decode("ascii")}
        if isinstance(value, range):  # a shard's tensors: a run of ranks
            return {"range": [value.start, value.stop, value.step]}
        if isinstance(value, Path):
            return {"path": str(value)}
        verb = getattr(type(value), "verb", None)
        if isinstance(verb, str) and self._ops.get(verb) is value:
            return {"op": verb}
        name = type(value).__name__
        if self._classes.get(name) is not type(value):
            raise TypeError(f"the plan codec does not admit {type(value).__qualname__}")
        names = tuple(f.name for f in dataclasses.fields(value) if f.init)
        if not isinstance(verb, str):  # an op's class would be encoded by verb for its registered instance
            self._fields[type(value)] = names
        return {"type": name, "fields": {field: self.encode(getattr(value, field)) for field in names}}

    def decode(self, data: Any, where: str) -> Any:
        if data is None or isinstance(data, (bool, int, float, str)):
            return data
        if not isinstance(data, dict) or len(data) not in (1, 2):
            raise self._refused(data, where)
        if "tuple" in data:
            return tuple(self.decode(v, where) for v in data["tuple"])
        if "list" in data:
            return [self.decode(v, where) for v in data["list"]]
        if "dict" in data:
            return {self.decode(k, where): self.decode(v, where) for k, v in data["dict"]}
        if "bytes" in data:
            return base64.b64decode(data["bytes"], validate=True)
        if "path" in data:
            return Path(data["path"])
        if "range" in data:
            bounds = data["range"]
            if not isinstance(bounds, list) or len(bounds) != 3 or not all(type(b) is int for b in bounds) \
                    or bounds[2] == 0:
                raise self._refused(data, where)
            return range(*bounds)
        if "op" in data:
            if data["op"] not in self._ops:
                raise self._refused(data, where)
            return self._ops[data["op"]]
        cls = self._classes.get(data.get("type"))  # type: ignore[arg-type]
        if cls is None or not isinstance(data.get("fields"), dict):
            raise self._refused(data, where)
        fields = {name: self.decode(v, where) for name, v in data["fields"].items()}
        try:
            return cls(**fields)
        except (TypeError, ValueError) as err:  # fields it lacks or does not have; values it refuses
            raise OutputError(f"{where}: not a {cls.__name__} of a plan: {err}; remove the file and rerun",
                              path=where) from None

    @staticmethod
    def _refused(data: Any, where: str) -> OutputError:
        text = repr(data)
        return OutputError(f"{where}: {text[:80]}{'...' if len(text) > 80 else ''} is not a value a plan holds "
                           "(the file was edited or is not ckptxform's); remove it and rerun", path=where)
