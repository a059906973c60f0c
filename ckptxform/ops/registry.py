"""Every verb of ``ops:`` behind one lookup: the built-in ops, and the ops that installed
packages add through the entry-point group ``ckptxform.ops``.

A plug-in is an ``OpDef`` subclass exactly as a built-in op is (schema fragment, kind,
shape rule, inverse, audit wording, program), registered in its package's metadata::

    [project.entry-points."ckptxform.ops"]
    scale_rows = "my_package.ops:ScaleRows"     # the entry point's name is the verb

Plug-ins are looked up only when a rule names a verb no built-in op has: scanning the
installed packages' metadata costs 0.1 s or more where many are installed, and a
conversion of built-in ops pays nothing for it. A plug-in that cannot be loaded, or that
is not a well-formed op, is one error naming the package and the entry point.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from ..entry_points import loaded_entry_points
from ..errors import PluginError
from .base import OpDef

ENTRY_POINT_GROUP = "ckptxform.ops"
_VERB = re.compile(r"^[a-z][a-z0-9_]*$")
_KINDS = ("map", "reduce", "split")


class OpRegistry(Mapping[str, OpDef]):
    """Built-in ops by verb; a verb they lack is looked up among the plug-ins (once)."""

    def __init__(self, builtins: Mapping[str, OpDef]) -> None:
        self._builtins = dict(builtins)
        self._plugins: dict[str, OpDef] | None = None

    def __getitem__(self, verb: str) -> OpDef:
        if verb in self._builtins:
            return self._builtins[verb]
        return self.plugins()[verb]

    def __contains__(self, verb: object) -> bool:
        return verb in self._builtins or (isinstance(verb, str) and verb in self.plugins())

    def __iter__(self) -> Iterator[str]:
        """The built-in verbs (the schema file lists these; plug-ins add theirs at run time)."""
        return iter(self._builtins)

    def __len__(self) -> int:
        return len(self._builtins)

    @property
    def builtins(self) -> Mapping[str, OpDef]:
        return self._builtins

    def plugins(self) -> dict[str, OpDef]:
        """The plug-in ops by verb, loaded and checked on first use."""
        if self._plugins is None:
            self._plugins = _load_plugins(self._builtins)
        return self._plugins


def _load_plugins(builtins: Mapping[str, OpDef]) -> dict[str, OpDef]:
    found: dict[str, OpDef] = {}
    for name, where, loaded in loaded_entry_points(ENTRY_POINT_GROUP, "op"):
        op = _checked_op(loaded, name, where, builtins)
        if name in found:
            raise PluginError(f"{where}: two installed packages define verb {name!r}; uninstall one")
        found[name] = op
    return found


def _checked_op(loaded: Any, name: str, where: str, builtins: Mapping[str, OpDef]) -> OpDef:
    """``loaded`` (an ``OpDef`` subclass or instance) as an op, checked as a built-in op is."""
    op = loaded() if isinstance(loaded, type) and issubclass(loaded, OpDef) else loaded
    if not isinstance(op, OpDef):
        raise PluginError(f"{where}: is {type(loaded).__name__}, not a ckptxform.ops.OpDef subclass")
    verb = getattr(op, "verb", None)
    if verb != name:
        raise PluginError(f"{where}: the entry point's name must be the op's verb, and the op says {verb!r}")
    if not _VERB.match(name):
        raise PluginError(f"{where}: verb {name!r} is not a lower-case identifier")
    if name in builtins:
        raise PluginError(f"{where}: {name!r} is a built-in op's verb; give the plug-in's op another name")
    if op.kind not in _KINDS:
        raise PluginError(f"{where}: kind {op.kind!r} is none of {', '.join(_KINDS)}")
    schema, description = getattr(op, "schema", None), getattr(op, "description", None)
    if not isinstance(schema, dict) or not isinstance(description, str) or not description:
        raise PluginError(f"{where}: an op needs a JSON Schema fragment `schema` (a dict) and a `description`")
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as err:
        raise PluginError(f"{where}: its schema is not a valid JSON Schema: {err.message}") from None
    return op
