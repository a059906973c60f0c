"""The rule language as typed, frozen Python objects. Every node knows where it was written."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from .file_rules import FileRule
from .key_pattern import KeyPattern
from .templates import Template, expand_from
from .yaml_source import Where

if TYPE_CHECKING:
    from ..ops.base import Step

Encoding = Literal["offset", "absolute"]


@dataclass(frozen=True)
class SourceSpec:
    """A named checkpoint: a Hub repo (``repo``, ``revision``) or a local ``path``."""

    name: str
    where: Where
    repo: str | None = None
    revision: str | None = None
    path: str | None = None
    fetch: Literal["auto", "ranges", "download"] = "auto"
    #: the source's config file (Meta/Mistral consolidated checkpoints: params.json)
    config_file: str = "config.json"
    #: a location given with ``--source NAME=LOC`` (relative to the working directory)
    override: str | None = None
    #: no default location (an inverse's source): what a run without ``--source`` asks for
    example: str | None = None
    #: ``when_given``: read only when ``--source`` names it (a verifier the output only names)
    open: Literal["when_needed", "when_given"] = "when_needed"

    @property
    def unread(self) -> bool:
        """Not opened by this run: read only when given, and not given."""
        return self.open == "when_given" and self.override is None

    @property
    def location(self) -> str:
        if self.override is not None:
            return self.override
        if self.repo is not None:
            return f"hf://{self.repo}" + (f"@{self.revision}" if self.revision else "")
        if self.path is None:
            from ..errors import UsageError

            raise UsageError(f"source {self.name!r} ({self.where.short}) has no default location: pass "
                             f"--source {self.name}=LOCATION, e.g. {self.example}", source=self.name)
        return self.path


@dataclass(frozen=True)
class VocabSpec:
    """A named vocabulary map: from a source's d2t/t2d, a file, or the rows of a full-vocab tensor."""

    name: str
    where: Where
    source: str | None = None
    d2t: str = "d2t"
    t2d: str | None = "t2d"
    file: str | None = None
    encoding: Encoding | None = None
    #: an integer, or ``${config.PATH}`` of the source's config.json
    vocab_size: int | str | None = None
    identity_rows_of: str | None = None
    #: the source may lack ``t2d`` (vLLM and SGLang never read it): then it is derived from d2t
    t2d_optional: bool = False


@dataclass(frozen=True)
class TensorRule:
    """One entry of ``tensors``: a key pattern, the outputs it names and the op chain that
    makes them. Two spellings, one node: a ``key`` template has ``template`` set (its
    ``pattern`` is the template's regex) and ``to`` names the outputs of its groups; a
    ``match`` regex names one output per tensor, ``rename`` (or the key as it is), and its
    ``permute_rows``/``missing_rows`` are the first step of ``ops``."""

    index: int
    where: Where
    match: str
    pattern: KeyPattern
    rename: str | None = None
    skip: str | None = None
    cast: str | None = None
    optional: bool = False
    template: Template | None = None
    to: tuple[Template, ...] = ()
    ops: tuple[Step, ...] = ()
    tie: str | None = None
    #: the source whose tensors it matches (None: the ``convert`` source)
    source: str | None = None
    #: not written: an op of another rule reads it (``consumed``), which the plan checks
    consumed: str | None = None

    @property
    def label(self) -> str:
        """How messages name this rule: ``tensors[2] (rules.yaml:14)``."""
        return f"tensors[{self.index}] ({self.where.short})"

    def binding(self, key: str) -> dict[str, str] | None:
        """The template variables a matching source ``key`` binds (a regex rule binds the
        whole key as ``0``, no template variable's name); None when it does not match."""
        if self.template is not None:
            return self.template.match(key)
        return {WHOLE_KEY: key} if self.pattern.fullmatch(key) else None

    def targets(self, binding: dict[str, str]) -> list[str]:
        """The output keys of a group with ``binding`` (one per ``to``)."""
        if self.template is not None:
            return [expand_from(target, self.template, binding) for target in self.to]
        key = binding[WHOLE_KEY]
        m = self.pattern.fullmatch(key)
        assert m is not None
        return [m.expand(self.rename) if self.rename is not None else key]

    def output_key(self, key: str) -> str | None:
        """The output key for a matching source ``key`` (None when skipped, tied, not matched,
        or a template rule with ops or several outputs)."""
        binding = self.binding(key)
        if binding is None or self.skip is not None or self.tie is not None or self.consumed is not None:
            return None
        if self.template is not None:
            return self.to[0].expand(binding) if not self.ops and len(self.to) == 1 else None
        return self.targets(binding)[0]

    def sources(self) -> tuple[str, ...]:
        """The sources its ops read besides the converted one (a ``missing_rows`` rows_of)."""
        return tuple(name for step in self.ops for name in step.op.sources(step.args))


#: how a regex rule's binding names the whole matched key
WHOLE_KEY = "0"


@dataclass(frozen=True)
class AddEntry:
    """An output tensor no tensor of the converted source maps to."""

    key: str
    where: Where
    vocab: str | None = None
    field: Literal["d2t", "t2d"] | None = None
    encoding: Encoding = "offset"
    source: str | None = None
    tensor: str | None = None
    cast: str | None = None
    #: a constant (rules/constants.py): every element ``fill`` (a number or ``${...}``), of
    #: ``shape`` (integers or ``${...}``) and ``dtype`` (a dtype name or ``${...}``; None:
    #: the dtype of the output ``for_each`` matched)
    fill: int | float | str | None = None
    shape: tuple[int | str, ...] = ()
    dtype: str | None = None
    #: ``key`` as a template, written once per output key of the tensor rules that
    #: ``for_each`` matches, with its bindings (None: ``key`` is one literal key)
    template: Template | None = None
    for_each: Template | None = None

    @property
    def is_constant(self) -> bool:
        return self.fill is not None


@dataclass(frozen=True)
class LoadedPattern:
    pattern: KeyPattern
    where: Where


@dataclass(frozen=True)
class MinRows:
    key: str
    fraction: float
    where: Where


@dataclass(frozen=True)
class ConfigAssertion:
    """One entry of ``require.config``: what a field of the written config (or, with
    ``of``, of a source's config) must be. Bounds and ``equals`` may be ``${...}``; a
    field that is absent or null fails unless ``optional``."""

    path: str
    where: Where
    of: str | None = None
    optional: bool = False
    #: (check, value) pairs in the order written: equals, one_of, min, max, below, above, length
    checks: tuple[tuple[str, Any], ...] = ()
    #: the same checks, for every element of a list
    each: tuple[tuple[str, Any], ...] = ()
    reason: str | None = None


@dataclass(frozen=True)
class Require:
    loaded: tuple[LoadedPattern, ...] = ()
    min_rows_from_source: tuple[MinRows, ...] = ()
    strict: bool = True
    config: tuple[ConfigAssertion, ...] = ()


@dataclass(frozen=True)
class ConfigSpec:
    """How the output ``config.json`` is built."""

    where: Where
    from_source: str | None = None
    #: start from this dotted path of the ``from`` source's config (a VLM's ``text_config``)
    root: str | None = None
    root_where: Where | None = None
    keep: tuple[str, ...] | None = None
    rename: tuple[tuple[str, str], ...] = ()
    delete: tuple[str, ...] = ()
    set: tuple[tuple[str, Any, Where], ...] = ()


@dataclass(frozen=True)
class GgufSpec:
    """``output.gguf``: whose metadata a GGUF output carries (engine/output/gguf)."""

    architecture: str
    file_type: str
    name: str | None = None


@dataclass(frozen=True)
class OutputSpec:
    max_shard_size: int | None = None
    dtype: str | None = None
    file_name: str = "model.safetensors"
    config_file: str = "config.json"  # Meta/Mistral layouts read params.json
    #: ``shards: {like: SOURCE}``: the output's files are that source's (names, which tensor
    #: goes in which, their order), not packed afresh by max_shard_size
    shards_like: str | None = None
    #: none of max_shard_size, file_name, shards given: the output's files are made one from
    #: each of the converted source's (engine/plan/layout_follow.py); a file_name alone names
    #: the one file, as before
    follows_source: bool = True
    #: ``safetensors`` or ``gguf`` (one llama.cpp file, metadata as ``gguf`` says)
    format: str = "safetensors"
    gguf: GgufSpec | None = None
    #: ``loader_files``: the source whose loader files (file_rules.LOADER_FILES) the output
    #: carries; None: none (``loader_files: none``, a gguf output, no converted source)
    loader_files: str | None = None


@dataclass(frozen=True)
class RuleSet:
    """A validated rule file (with everything it ``extends`` folded in)."""

    path: str
    name: str
    description: str
    sources: dict[str, SourceSpec]
    convert: str | None
    vocab: dict[str, VocabSpec]
    tensors: tuple[TensorRule, ...]
    add: dict[str, AddEntry]
    require: Require
    config: ConfigSpec | None
    output: OutputSpec
    #: ``inverse.config``: what ``invert`` writes as the inverse's ``config`` (it cannot
    #: derive a config that the forward builds rather than passes through)
    inverse_config: ConfigSpec | None = None
    #: the ``files`` section: non-weight files copied into the output (none without it)
    file_rules: tuple[FileRule, ...] = ()
    #: ``output.loader_files``: the loader files carried after ``file_rules``'s entries
    loader_file_rules: tuple[FileRule, ...] = ()
    #: sha256 over the bytes of this file and every file it extends, in order
    sha256: str = ""
    files: tuple[str, ...] = field(default=())

    @property
    def all_file_rules(self) -> tuple[FileRule, ...]:
        """What the output's non-weight files are planned from: the ``files`` entries, then
        the carried loader files."""
        return self.file_rules + self.loader_file_rules

    def with_sources(self, overrides: dict[str, str]) -> RuleSet:
        """A copy whose named sources point at other locations (``--source NAME=LOC``)."""
        from dataclasses import replace

        from ..errors import UsageError

        unknown = sorted(set(overrides) - set(self.sources))
        if unknown:
            defined = ", ".join(sorted(self.sources)) or "none"
            raise UsageError(
                f"--source {unknown[0]}=...: the rule file {self.path} has no source {unknown[0]!r} "
                f"(defined: {defined})"
            )
        sources = dict(self.sources)
        for name, location in overrides.items():
            old = sources[name]
            sources[name] = replace(old, override=location)
        return replace(self, sources=sources)
