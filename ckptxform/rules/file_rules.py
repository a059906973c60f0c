"""The ``files:`` section: non-weight files copied from a source into the output by glob.

Each entry names a glob over the source's file paths (relative, ``/``-separated), the
source (default: the converted one), and either an output path (``rename``, default the
same path) or a ``skip`` reason. A file takes the first entry whose glob matches it, as a
tensor takes the first tensor rule; a child file's entries (``extends``) are tried first.
Besides the section, a safetensors output carries the source's loader files
(``LOADER_FILES``: tokenizer, chat template, generation and processor configs), tried after
the rule's own entries; ``output.loader_files`` says from which source, or ``none``.

Globs: ``*`` and ``?`` stay within one folder, ``**`` spans folders (``**/`` also matches
no folder at all), ``[abc]`` is a set; the glob matches the whole path from the root.
A rename may hold ``{name}`` (the file's name) and ``{path}`` (its whole path).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from .key_pattern import KeyPattern
from .yaml_source import Where

@dataclass(frozen=True)
class FileRule:
    """One entry of ``files``."""

    index: int
    where: Where
    glob: str
    source: str
    rename: str | None = None
    skip: str | None = None
    optional: bool = False
    #: one of ``LOADER_FILES``, carried by ``output.loader_files`` rather than written in ``files``
    carried: bool = False

    @property
    def label(self) -> str:
        """How messages and the audit name this entry: ``files[1] (rules.yaml:40)``, or
        ``output.loader_files (rules.yaml:12)`` for a carried loader file."""
        return f"{'output.loader_files' if self.carried else f'files[{self.index}]'} ({self.where.short})"

    def matches(self, path: str) -> bool:
        return self._pattern.fullmatch(path) is not None

    @cached_property
    def _pattern(self) -> KeyPattern:
        return glob_pattern(self.glob, label=f"{self.where}: files[{self.index}].glob:")

    def output_path(self, path: str) -> str:
        """Where the source file ``path`` goes in the output."""
        if self.rename is None:
            return path
        return self.rename.replace("{path}", path).replace("{name}", path.rsplit("/", 1)[-1])


def glob_pattern(glob: str, *, label: str = "files.glob:") -> KeyPattern:
    """The pattern of ``glob`` (see the module docstring), matched within a time bound
    like every pattern of a rule file (``*a*a*a*a*b`` backtracks).

    >>> bool(glob_pattern("tokenizer*").fullmatch("tokenizer.json"))
    True
    >>> bool(glob_pattern("**/*.jinja").fullmatch("templates/chat.jinja"))
    True
    """
    out, i = [], 0
    while i < len(glob):
        if glob.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif glob.startswith("**", i):
            out.append(".*")
            i += 2
        elif glob[i] == "*":
            out.append("[^/]*")
            i += 1
        elif glob[i] == "?":
            out.append("[^/]")
            i += 1
        elif glob[i] == "[" and (end := glob.find("]", i + 2)) != -1:
            body = glob[i + 1:end]
            negate = body.startswith("!")
            out.append(f"[{'^' if negate else ''}{re.escape(body[1:] if negate else body)}]")
            i = end + 1
        else:
            out.append(re.escape(glob[i]))
            i += 1
    return KeyPattern.compile("(?s:" + "".join(out) + ")", label=label)


#: The files a Hugging Face loader (transformers' Auto* classes, vLLM, SGLang) reads beside
#: the weights and config.json, none of which a weight conversion changes: the tokenizer in
#: each of its formats (tokenizers' JSON, SentencePiece, tiktoken, Mistral's tekken, BPE vocab and
#: merges, and
#: the tokenization_*.py that tokenizer_config.json's auto_map names), chat templates (a
#: template inside tokenizer_config.json comes with that file), the generation config, and
#: the processor configs of a multimodal model. Modeling code (modeling_*.py) is not one:
#: it is written for the source's weight layout. Each is optional: a source carries those it has.
LOADER_FILES = (
    "tokenizer*", "special_tokens_map.json", "added_tokens.json", "spiece.model", "sentencepiece.bpe.model",
    "*.tiktoken", "tekken.json", "vocab.json", "vocab.txt", "merges.txt", "tokenization_*.py",
    "*.jinja", "chat_template.json", "additional_chat_templates/*.jinja",
    "generation_config.json",
    "preprocessor_config.json", "processor_config.json", "image_processor_config.json",
    "video_preprocessor_config.json", "feature_extractor_config.json",
)


def loader_file_rules(source: str, where: Where, first_index: int) -> tuple[FileRule, ...]:
    """``LOADER_FILES`` of ``source`` as optional entries after the rule's own (numbered from
    ``first_index``), so an entry of ``files`` that names one of them (to skip or rename it)
    comes first."""
    return tuple(FileRule(index=first_index + i, where=where, glob=glob, source=source, optional=True, carried=True)
                 for i, glob in enumerate(LOADER_FILES))


def path_problem(path: str) -> str | None:
    """Why ``path`` cannot name a file inside a directory (absolute, ``..``, empty parts,
    control characters, which a terminal or a log would act on)."""
    if path.startswith("/") or "\\" in path or "\0" in path:
        return "must be a relative path with '/' between folders"
    if any(ord(c) < 0x20 or 0x7f <= ord(c) < 0xa0 for c in path):
        return "must not hold control characters"
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "must not hold empty, '.' or '..' parts"
    return None


def entry_problems(value: Any) -> list[tuple[tuple[str, ...], str]]:
    """Problems of one ``files`` entry the schema cannot see, as ``(sub_path, message)``;
    the loader checks the ``from`` reference with the other source references."""
    out: list[tuple[tuple[str, ...], str]] = []
    if not isinstance(value, dict):
        return out
    glob = value.get("glob")
    if isinstance(glob, str) and (problem := path_problem(glob.replace("*", "x"))):
        out.append((("glob",), f"{glob!r} {problem}"))
    rename = value.get("rename")
    if isinstance(rename, str):
        probe = rename.replace("{path}", "p").replace("{name}", "n")
        if (problem := path_problem(probe)) or "{" in probe or "}" in probe:
            out.append((("rename",), f"{rename!r} {problem or 'may hold only {name} and {path}'}"))
    return out


def build_file_rules(entries: list[tuple[Any, Where]], default_source: str | None) -> tuple[FileRule, ...]:
    out = []
    for index, (value, where) in enumerate(entries):
        source = value.get("from", default_source)
        assert isinstance(source, str)
        out.append(FileRule(index=index, where=where, glob=value["glob"], source=source,
                            rename=value.get("rename"), skip=value.get("skip"),
                            optional=value.get("optional", False)))
    return tuple(out)
