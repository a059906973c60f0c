"""A PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors`` or
``adapter_model.bin``, as ``save_pretrained`` writes it) as a source.

Its keys are the base model's: ``base_model.model.`` is taken off, and the adapter name
peft inserts in some saves (``lora_A.default.weight``) too, so
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` is
``model.layers.0.self_attn.q_proj.lora_A.weight``; a ``modules_to_save`` module's
tensors are under the module's own key (``lm_head.weight``), as peft saves them.

Its config (``${source.NAME.config.PATH}``) is ``adapter_config.json`` as written, plus
``lora_scaling``: for each adapted module, the scale peft gives it, by the module's dotted
name (``${source.adapter.config.lora_scaling.{X}}`` in a rule whose ``{X*}`` binds it):
``alpha / r``, or ``alpha / sqrt(r)`` with ``use_rslora``, where ``r`` and ``alpha`` are
``rank_pattern``'s and ``alpha_pattern``'s entry for the module when one matches (peft's
rule: the pattern is a regex matching the end of the module's name at a dot), else ``r``
and ``lora_alpha``. Computed in Python floats, as peft computes ``self.scaling``.

What this reading does not cover is refused when the source is opened, naming the field:
another ``peft_type`` (LoHa, IA3, ...), DoRA (``use_dora``), LoRA biases (``lora_bias``),
``layer_replication``, ``target_parameters``, ``trainable_token_indices``, QALoRA, aLoRA,
LoRA on embeddings (``lora_embedding_A``), and a rank the tensors contradict.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import CheckpointFormatError, CkptxformError, SourceNotFoundError
from ..fileio import read_small_file
from .base import Checkpoint, TensorInfo
from .pins import FilePin

ADAPTER_CONFIG = "adapter_config.json"
_PREFIX = "base_model.model."
#: fields whose value (when set) asks for a merge this reading does not do
_REFUSED = {"use_dora": "DoRA (use_dora) rescales each merged weight by its magnitude vector",
            "lora_bias": "lora_bias adds a bias to lora_B",
            "layer_replication": "layer_replication duplicates layers",
            "target_parameters": "target_parameters adapts nn.Parameters (fused experts), not modules",
            "trainable_token_indices": "trainable_token_indices replaces rows of the embedding",
            "use_qalora": "QALoRA pools the input",
            "alora_invocation_tokens": "aLoRA activates only after its invocation tokens and cannot be merged"}
_ADAPTER_NAME = re.compile(r"\.(lora_A|lora_B)\.[^.]+\.weight$")


def is_adapter_folder(path: Path) -> bool:
    return path.is_dir() and (path / ADAPTER_CONFIG).is_file()


def open_peft_adapter(path: str | Path, *, name: str | None = None) -> PeftAdapter:
    """A local adapter folder."""
    from .local import open_local

    root = Path(path)
    label = str(root / ADAPTER_CONFIG)
    raw = read_small_file(root / ADAPTER_CONFIG, 1 << 20, what="a PEFT adapter_config.json")
    try:
        config = json.loads(raw)
    except ValueError as err:
        raise _refused(label, f"is not JSON: {err}", name) from None
    files = [n for n in ("adapter_model.safetensors", "adapter_model.bin") if (root / n).is_file()]
    if not files:
        raise SourceNotFoundError(f"{root}: a PEFT adapter folder ({ADAPTER_CONFIG}) without adapter_model.safetensors "
                                  "or adapter_model.bin; give the folder save_pretrained wrote", path=str(root),
                                  source=name)
    inner = open_local(root / files[0], name=name)
    try:
        return PeftAdapter(str(path), name, inner, config, label, root)
    except CkptxformError:
        inner.close()
        raise


def hub_adapter(inner: Checkpoint, name: str | None) -> PeftAdapter:
    """A Hub repo holding an adapter (``adapter_model.safetensors``, opened as ``inner``)."""
    config = inner.config(ADAPTER_CONFIG)
    label = f"{inner.location}: {ADAPTER_CONFIG}"
    if config is None:
        raise SourceNotFoundError(f"{inner.location}: holds adapter_model.safetensors but no {ADAPTER_CONFIG}; "
                                  "a PEFT adapter needs both", source=name)
    return PeftAdapter(inner.location, name, inner, config, label, None)


def _check_config(label: str, config: Any, name: str | None) -> None:
    if not isinstance(config, dict):
        raise _refused(label, "is not a JSON object", name)
    kind = config.get("peft_type")
    if kind != "LORA":
        raise _refused(label, f"peft_type is {kind!r}; ckptxform reads LoRA adapters only (peft_type: LORA)", name)
    for field, why in _REFUSED.items():
        if config.get(field) not in (None, False, [], {}):
            raise _refused(label, f"{field} is {config[field]!r}: {why}, which ckptxform does not merge", name)
    for field in ("r", "lora_alpha"):
        value = config.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise _refused(label, f"{field} is {value!r}, not a positive number", name)
    for field in ("rank_pattern", "alpha_pattern"):
        value = config.get(field) or {}
        if not isinstance(value, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                                                  for v in value.values()):
            raise _refused(label, f"{field} is {value!r}, not a mapping of module patterns to positive numbers", name)


def _refused(label: str, message: str, name: str | None) -> CheckpointFormatError:
    return CheckpointFormatError(f"{label}: {message}", path=label, source=name)


def base_key(key: str) -> str:
    """The base model's key of an adapter tensor's saved key."""
    key = key.removeprefix(_PREFIX)
    return _ADAPTER_NAME.sub(lambda m: f".{m.group(1)}.weight", key)


def pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """peft's reading of ``rank_pattern``/``alpha_pattern``: the first pattern matching the
    end of ``module``'s name (at a dot), else ``default``."""
    for pattern in patterns:
        if re.match(rf"(.*\.)?({pattern})$", module):
            return patterns[pattern]
    return default


class PeftAdapter(Checkpoint):
    """The adapter's tensors under the base model's keys; bytes read from its file."""

    def __init__(self, location: str, name: str | None, inner: Checkpoint, config: Any, label: str,
                 root: Path | None) -> None:
        """``label`` names adapter_config.json in messages; ``root`` is the local folder."""
        _check_config(label, config, name)
        self.location, self.name, self._inner, self._label, self._root = location, name, inner, label, root
        self.files = inner.files
        self.revision, self.commit = inner.revision, inner.commit
        #: a Hub adapter's repo and fetch policy (a worker reopens it at the commit)
        self.repo_id: str | None = getattr(inner, "repo_id", None)
        self.policy: str | None = getattr(inner, "policy", None)
        self._saved: dict[str, TensorInfo] = {}
        tensors: dict[str, TensorInfo] = {}
        for key, info in inner.tensors.items():
            if ".lora_embedding_" in key or ".lora_magnitude_vector" in key:
                raise _refused(label, f"the adapter holds {key!r}: LoRA on an embedding layer (or DoRA) is not "
                               "merged by ckptxform", name)
            mapped = base_key(key)
            if mapped in tensors:
                raise _refused(label, f"{key!r} and another tensor both map to {mapped!r}", name)
            tensors[mapped] = replace(info, key=mapped)
            self._saved[mapped] = info
        self.tensors = tensors
        self._config = {**config, "lora_scaling": self._scaling(config)}

    def _scaling(self, config: dict[str, Any]) -> dict[str, Any]:
        """The nested mapping module path -> peft's scale (``lora_scaling.model.layers.0...``)."""
        tree: dict[str, Any] = {}
        for key, info in self.tensors.items():
            if not key.endswith(".lora_A.weight"):
                continue
            module = key.removesuffix(".lora_A.weight")
            r = pattern_value(config.get("rank_pattern") or {}, module, config["r"])
            alpha = pattern_value(config.get("alpha_pattern") or {}, module, config["lora_alpha"])
            if len(info.shape) != 2 or info.shape[0] != r:
                raise _refused(self._label, f"{module!r} has lora_A of shape {list(info.shape)}, but the config gives "
                               f"it rank {r} (r, rank_pattern): the adapter does not match its config", self.name)
            scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
            node = tree
            *parents, leaf = module.split(".")
            for part in parents:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise _refused(self._label, f"module {module!r} is nested inside another adapted module", self.name)
            node[leaf] = scale
        return tree

    def config(self, name: str = "config.json") -> dict[str, Any] | None:
        """``adapter_config.json`` with ``lora_scaling`` (asked for as config.json or by name)."""
        if name in ("config.json", ADAPTER_CONFIG):
            return copy.deepcopy(self._config)
        return self._inner.config(name)

    def read(self, info: TensorInfo, start: int = 0, length: int | None = None) -> bytes:
        return self._inner.read(self._saved[info.key], start, length)

    def read_runs(self, info: TensorInfo, runs: Sequence[tuple[int, int]]) -> list[bytes]:
        return self._inner.read_runs(self._saved[info.key], runs)

    def read_runs_into(self, info: TensorInfo, runs: Sequence[tuple[int, int]], out: memoryview,
                       at: Sequence[int]) -> None:
        self._inner.read_runs_into(self._saved[info.key], runs, out, at)

    def tensors_of_file(self, file: str) -> list[TensorInfo]:
        return [info for info in self.tensors.values() if info.file == file]

    def local_path(self, file: str) -> Path | None:
        return self._inner.local_path(file)

    def local_segments(self, info: TensorInfo, start: int, length: int) -> list[tuple[Path, int, int]] | None:
        return self._inner.local_segments(self._saved[info.key], start, length)

    def list_files(self) -> tuple[str, ...]:
        return self._inner.list_files()

    def file_path(self, name: str) -> Path:
        return self._inner.file_path(name)

    def fingerprint(self) -> str | None:
        return self._inner.fingerprint()

    def pins(self) -> tuple[FilePin, ...]:
        from .pins import pin_path

        local = (pin_path(self._root / ADAPTER_CONFIG),) if self._root is not None else ()
        return (*self._inner.pins(), *local)

    def local_paths(self) -> tuple[Path, ...]:
        return (self._root.resolve(),) if self._root is not None else self._inner.local_paths()

    def prefetch(self, files: Iterable[str], *, tensors: Iterable[str] = (),
                 rows: Mapping[str, Sequence[int]] | None = None) -> None:
        self._inner.prefetch(files, tensors=[self._saved[k].key for k in tensors if k in self._saved],
                             rows={self._saved[k].key: v for k, v in (rows or {}).items() if k in self._saved})

    def fetch_events(self) -> list[dict[str, Any]]:
        return self._inner.fetch_events()

    def first_etags(self) -> dict[str, str]:
        return self._inner.first_etags()

    def expect_etags(self, etags: Mapping[str, str]) -> None:
        self._inner.expect_etags(etags)

    def close(self) -> None:
        self._inner.close()
