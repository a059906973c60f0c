"""The shipped rule library as a catalogue: every rule loaded and validated, with what
``ckptxform rules`` prints of it (above both the library's lookup and the loader)."""

from __future__ import annotations

from .library import ShippedRule, _library_files
from .loader import load_rules
from .model import SourceSpec
from .yaml_source import read_yaml


def shipped_rules() -> tuple[ShippedRule, ...]:
    """Every rule of the library, validated, in file-name order."""
    out = []
    for path in _library_files():
        rules = load_rules(path)
        data = read_yaml(path, str(path)).data
        extends = data.get("extends") if isinstance(data, dict) else None
        out.append(ShippedRule(stem=path.stem, name=rules.name, description=rules.description, path=path,
                               sources={n: _default(s) for n, s in rules.sources.items()},
                               extends=extends if isinstance(extends, str) else None))
    return tuple(out)


def _default(spec: SourceSpec) -> str:
    """A source's default location; one with none (a trainer's checkpoint) shows its example."""
    if spec.repo is None and spec.path is None:
        return f"(give one, e.g. {spec.example})"
    return spec.location.removeprefix("hf://")
