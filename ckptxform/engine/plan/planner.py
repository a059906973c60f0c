"""build_plan(RuleSet, checkpoints) -> Plan, from headers, the rule file and the vocab maps
only: each source tensor matched to its rule, each rule's outputs planned by one path
(its groups and op chain: a rename, a cast, a row permutation are chains too), ``add`` and
``tie`` entries, every tensor of every file opened recorded.

Every check is decided here or in what this calls (output_checks.py, requirements.py,
vocab_maps.py), so a failing ``apply`` fails before any weight byte is read and before
any output exists. The only tensor bytes read are the small d2t/t2d.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from ...bulk_gc import collector_paused
from ...dtypes import USER_DTYPES
from ...errors import PlanError, SourceNotFoundError, UnmatchedRuleError, quote_keys
from ...rules.model import AddEntry, RuleSet, TensorRule
from ...sources.base import Checkpoint, TensorInfo
from ...sources.pins import FilePin
from ...vocab.maps import Alignment, VocabMap
from .config_builder import build_config
from .cast_checks import check_quantized_casts
from .config_checks import check_config
from .constants import plan_constant
from .quantize_checks import check_quantize
from .config_requirements import check_config_requirements, config_sources
from .files import FilesPlan, plan_files
from .groups import plan_rule
from .output_checks import gguf_output_problem, key_problem, tie_problem, value_problem
from .plan_store import OutputTable, PlanOutputs, PlanStore
from .producers import Producers, RuleRead, rules_by_position
from .recipes import CopyTensor, OutputPlan, SourceRecord, TargetReason, TensorRecord, VocabField
from .references import References
from .requirements import check_requirements
from .record_table import RecordTable, Records, cast_words, copy_wording
from .unread_shards import complete_unread_records, source_tensors, unread_record
from .vocab_maps import read_vocab_map

_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}


@dataclass
class Plan:
    """The whole conversion, decided: one entry per output tensor, one record per source
    tensor of every file opened, the vocab statistics and the output config; with the
    files it read as they stood (``pins``). A value: the checkpoints it was planned from
    are a separate handle (``OpenSources``), closed by whoever opened them.

    Its outputs and records are read from a database on disk (plan_store.py), an item at a
    time: iterate them, do not hold them all. ``close()`` (or a ``with`` block) frees it; a
    plan no longer referenced frees it too. A pickled plan holds them all."""

    rules: RuleSet
    #: in key order, each made when read (plan_store.py); ``output(key)`` finds one
    outputs: PlanOutputs
    #: in the order first made, each made when read (record_table.py)
    records: Records
    alignments: dict[str, Alignment]
    vocab_maps: dict[str, VocabMap]
    config: dict[str, Any] | None
    sources: dict[str, SourceRecord]
    warnings: tuple[str, ...]
    #: the rule's ``files``: what is copied, what is skipped
    files: FilesPlan = field(default_factory=FilesPlan)
    #: each vocabulary file read (vocab name -> the file as it stood when read)
    vocab_files: dict[str, FilePin] = field(default_factory=dict)
    #: (source, key, output key, rule): tensors not written because apply checks they are
    #: byte-identical to an output (``tie``)
    ties: tuple[tuple[str, str, str, str], ...] = ()
    #: source -> the local files planning read from it (headers, indexes, configs), as they stood
    pins: dict[str, tuple[FilePin, ...]] = field(default_factory=dict)
    #: (file, bytes) of every weight file apply writes, in order (``api.plan`` lays them out)
    output_files: tuple[tuple[str, int], ...] = ()

    def files_read(self) -> tuple[FilePin, ...]:
        """Every local file the plan read (weight files, indexes, configs, vocab files)."""
        pins = [pin for source in self.pins.values() for pin in source]
        return tuple(sorted({p.path: p for p in [*pins, *self.vocab_files.values()]}.values(),
                            key=lambda p: p.path))

    @property
    def total_bytes(self) -> int:
        return self.outputs.total_bytes

    def output(self, key: str) -> OutputPlan | None:
        """The output written as ``key``, or None."""
        return self.outputs.output(key)

    def counts(self) -> dict[str, int]:
        """How many source tensors took each action."""
        out: dict[str, int] = {}
        for action in self.records.actions():
            out[action] = out.get(action, 0) + 1
        return out

    def close(self) -> None:
        """Free the store of its outputs and records (reading them after is a ValueError)."""
        for table in (self.outputs, self.records):
            close = getattr(table, "close", None)
            if close is not None:
                close()

    def __enter__(self) -> Plan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: why this process must not plan (a shard worker executes its task's slice of the run's plan)
_NO_PLANNING: str | None = None


def forbid_planning(why: str) -> None:
    """Make every later ``build_plan`` in this process an internal error saying ``why``."""
    global _NO_PLANNING
    _NO_PLANNING = why


def build_plan(rules: RuleSet, checkpoints: Mapping[str, Checkpoint]) -> Plan:
    """Decide the conversion of ``rules`` over opened ``checkpoints`` (name -> Checkpoint),
    which stay open: the caller closes them."""
    if _NO_PLANNING is not None:
        raise PlanError(f"internal error: this process must not plan: {_NO_PLANNING} (report it)")
    with collector_paused():
        return _Planner(rules, dict(checkpoints)).run()


def needed_sources(rules: RuleSet) -> list[str]:
    """The sources the rules read from, in the order they are declared."""
    names = set()
    if rules.convert:
        names.add(rules.convert)
    for spec in rules.vocab.values():
        if spec.source:
            names.add(spec.source)
    for rule in rules.tensors:
        names.update(rule.sources())
        if rule.source:
            names.add(rule.source)
    for entry in rules.add.values():
        if entry.source:
            names.add(entry.source)
    if rules.config and rules.config.from_source:
        names.add(rules.config.from_source)
    names.update(rule.source for rule in rules.all_file_rules)
    if rules.output.shards_like:
        names.add(rules.output.shards_like)
    names.update(config_sources(rules))
    return [name for name, spec in rules.sources.items() if name in names and not spec.unread]


def _unfit(summary: str, location: str, err: UnmatchedRuleError) -> UnmatchedRuleError:
    err.summary, err.location = summary, location
    return err


def _unmatched_rule(rule: TensorRule, keys: list[str]) -> str:
    """A rule that matched nothing: its pattern, and the full-match fix when it matches
    keys only as a prefix (``model.layers.0`` for ``model.layers.0.mlp.weight``)."""
    what = f"{rule.label} match '{rule.match}'"
    prefixed = next((key for key in keys if rule.pattern.prefix_match(key)), None)
    if rule.template is None and prefixed is not None:
        return (f"{what} matches {prefixed!r} only as a prefix, and a match must match the whole key: write "
                f"match: '{rule.match}.*' (and a rename with the group: match: '{rule.match}(.*)', rename: "
                "'NEW\\1')")
    return what


def _matched_sources(rules: RuleSet) -> list[str]:
    """The converted source, then each other source a tensor rule names (``source:``)."""
    assert rules.convert is not None
    return [rules.convert, *dict.fromkeys(r.source for r in rules.tensors if r.source and r.source != rules.convert)]


class _Planner:
    def __init__(self, rules: RuleSet, checkpoints: dict[str, Checkpoint]) -> None:
        self.rules = rules
        self.ckpts = checkpoints
        #: the plan's outputs and records, on disk (plan_store.py)
        self.store = PlanStore()
        self.outputs = OutputTable(self.store, self._written_twice)
        #: the rules an output's position names (those that share none)
        self._rule_at = rules_by_position(rules.tensors)
        #: what writes each output key, for messages (its str(): ``tensors[0] (rules.yaml:6) (from model:x)``)
        self.producer = Producers(self.outputs, self._rule_at)
        self.records = RecordTable(self.store, rules.convert, frozenset(
            where for where, rule in self._rule_at.items() if rule.template is not None))
        self.files_opened: dict[str, set[str]] = {}
        self.warnings: list[str] = []
        self.vocab: dict[str, VocabMap] = {}
        self.alignments: dict[str, Alignment] = {}
        self.vocab_files: dict[str, FilePin] = {}
        self.ties: list[tuple[str, str, str, str]] = []
        #: tensors a rule says an op reads (``consumed``), checked once every rule has run
        self.consumed: list[tuple[str, TensorInfo, TensorRule]] = []
        self._references_of: dict[str, References] = {}

    # -- entry ---------------------------------------------------------------------------
    def run(self) -> Plan:
        try:
            return self._run()
        except BaseException:
            try:
                # a key written twice (found a batch at a time) was the first error: say it
                self.outputs.flush()
            finally:
                self.store.close()
            raise

    def _run(self) -> Plan:
        if self.rules.convert is None:
            raise PlanError(f"{self.rules.path}: no 'convert' source; name the source the rules convert")
        self._load_vocab_maps()
        check_config_requirements(self.rules, None, self.ckpts, self.vocab, of_sources=True)
        for source in _matched_sources(self.rules):
            self._plan_matched_source(source)
        # what a constant's for_each matches: the outputs until now
        rule_outputs = self.outputs.so_far() if self.rules.add else {}
        for entry in self.rules.add.values():
            self._plan_add(entry, rule_outputs)
        self._check_consumed()
        self._check_ties()
        self._read_layout_source()
        check_requirements(self.rules, self.outputs, self.producer, self.ckpts[self.rules.convert].tensor_keys())
        self._record_unused()
        config = build_config(self.rules, self.ckpts, self.vocab) if self.rules.config else None
        check_config(config, self.outputs, self.rules)
        self.warnings += check_quantize(self.rules, config, self.ckpts[self.rules.convert].tensor_keys())
        check_quantized_casts(self.rules, self.ckpts, self.outputs, self.producer)
        check_config_requirements(self.rules, config, self.ckpts, self.vocab)
        self._check_output_format()
        complete_unread_records(self.records, self.ckpts)
        sources = {
            name: SourceRecord(name=name, location=ckpt.location, revision=ckpt.revision, commit=ckpt.commit,
                               fingerprint=ckpt.fingerprint())
            for name, ckpt in self.ckpts.items()
        }
        records = self.records.take()
        outputs = self.outputs.finish()
        return Plan(rules=self.rules, outputs=outputs,
                    records=records, alignments=self.alignments, vocab_maps=self.vocab,
                    config=config, sources=sources, warnings=tuple(self.warnings),
                    files=plan_files(self.rules, self.ckpts), vocab_files=self.vocab_files, ties=tuple(self.ties),
                    pins={name: ckpt.pins() for name, ckpt in self.ckpts.items()})

    def _check_output_format(self) -> None:
        if self.rules.output.format != "gguf":
            return
        files = set(self.ckpts[self.rules.convert].list_files())
        problem = gguf_output_problem(self.outputs.in_made_order(), self.rules.convert, files)
        if problem is not None:
            message, key = problem
            raise PlanError(f"{self.rules.path}: output.gguf: {message}" if key is None else message, key=key)

    # -- helpers -------------------------------------------------------------------------
    def _tensor(self, source: str, key: str, why: str, fix: str | None = None) -> TensorInfo:
        ckpt = self.ckpts[source]
        info = ckpt.tensors.get(key)
        if info is None:
            close = difflib.get_close_matches(key, ckpt.tensor_keys(), n=3, cutoff=0.5)
            hint = f"; closest keys: {quote_keys(close)}" if close else ""
            fix = fix or (f"correct the key in the rule file, or pass --source {source}=LOCATION "
                          "of a checkpoint that has it")
            raise SourceNotFoundError(
                f"{why}: source {source!r} ({ckpt.location}) has no tensor {key!r}{hint}; {fix}",
                source=source, key=key)
        self.files_opened.setdefault(source, set()).add(info.file)
        return info

    def _record(self, source: str, info: TensorInfo, action: str, target: str | tuple[str, ...] | None,
                rule: str | None, reason: str | TargetReason, new: bool = False) -> None:
        """One record per source tensor; a rule's verdict replaces an earlier 'vocab' read.
        ``new``: the caller knows it has none yet (not looked up)."""
        if action == "unused" and self.records.has(source, info.key):
            return  # asked before get(), which makes the record of a tensor held as its output
        earlier = None if new else self.records.get(source, info.key)
        if earlier is not None:
            if isinstance(reason, TargetReason):  # said of this target, which may not be the one kept
                reason = reason.text(target)
            if earlier.action != "vocab" and (earlier.target is not None or target is None):
                # Used twice (e.g. lends missing rows and is also copied whole by `add`):
                # keep the verdict that names an output, and say both.
                action, target, rule = earlier.action, earlier.target, earlier.rule
                reason = f"{earlier.reason}; {reason}"
            else:
                reason = f"{reason}; {earlier.reason}"
        self.records.put(TensorRecord(source, info.key, action, target, info.shape, info.dtype, rule, reason))

    def _add_output(self, out: OutputPlan, producer: str | RuleRead) -> None:
        why = key_problem(out.key)
        if why is not None:
            raise PlanError(f"{producer}: output key {out.key!r} is not a valid tensor name: {why}; change the "
                            "rule's rename (or the add entry's name) so that it writes another key", key=out.key)
        problem = value_problem(out)
        if problem is not None:
            raise PlanError(f"{producer}: {problem}", key=out.key)
        # a key written twice: _written_twice, now or when its batch is written
        self.outputs.add(out, self.producer.add(out, producer))

    def _written_twice(self, out: OutputPlan, held: object | None) -> NoReturn:
        raise PlanError(f"{self.producer.of(out, held)} and {self.producer.earlier(out.key, held)} both write output "
                        f"key {out.key!r}; two tensors cannot be written to one key: rename one of them", key=out.key)

    def _out_dtype(self, input_dtype: str, cast: str | None) -> str:
        if cast:
            return USER_DTYPES[cast]
        if self.rules.output.dtype and input_dtype in _FLOAT_DTYPES:
            return USER_DTYPES[self.rules.output.dtype]
        return input_dtype

    # -- vocabulary maps -----------------------------------------------------------------
    def _load_vocab_maps(self) -> None:
        for name, spec in self.rules.vocab.items():
            read = read_vocab_map(name, spec, self.ckpts, self._tensor, self._references)
            self.vocab[name] = read.vmap
            if read.file is not None:
                self.vocab_files[name] = read.file
            assert spec.source is not None or not read.tensors
            reason = f"read as vocabulary map {name!r} ({spec.encoding})"
            for info in read.tensors:
                self._record(spec.source, info, "vocab", None, spec.where.short, reason)

    def _references(self, source: str) -> References:
        """How ``${...}`` resolves for a rule about ``source``: ``config`` is its config file,
        read once a plan (it was parsed once a tensor: a quarter of a 20,000-tensor plan)."""
        if source not in self._references_of:
            ckpt = self.ckpts[source]
            config_file = self.rules.sources[source].config_file
            self._references_of[source] = References(self.rules, self.ckpts, self.vocab, ckpt.config(config_file),
                                                     f"the {config_file} of source {source!r} ({ckpt.location})")
        return self._references_of[source]

    # -- the converted source (and any other a tensor rule names) --------------------------
    def _plan_matched_source(self, source: str) -> None:
        """Every tensor of ``source`` through the first of its rules that matches it."""
        ckpt = self.ckpts[source]
        rules = [r for r in self.rules.tensors if (r.source or self.rules.convert) == source]
        matched: dict[int, int] = {}
        unmatched: list[str] = []
        grouped: dict[int, list[TensorInfo]] = {}
        for key, info, rule in source_tensors(ckpt, rules, read_all=source == self.rules.output.shards_like):
            if rule is None and self.rules.require.strict:
                unmatched.append(key)
                continue
            if rule is not None:
                matched[rule.index] = matched.get(rule.index, 0) + 1
            if isinstance(info, str):  # a key of a shard not read: skipped by its rule (or, not strict, by none)
                self.records.put(unread_record(source, key, info, rule))
                continue
            self.files_opened.setdefault(source, set()).add(info.file)
            if rule is None:
                self._record(source, info, "skipped", None, None, "no rule matches (require.strict: false)")
                continue
            if rule.skip is not None or rule.tie is not None or rule.consumed is not None:
                self._plan_tie_or_skip(source, info, rule)
            elif rule.template is None:  # binds the whole key: a group of one, complete now
                self._plan_rule(source, rule, [info])
            else:
                grouped.setdefault(rule.index, []).append(info)
        keys = ckpt.tensor_keys()
        # A rule overridden by an earlier one (a child file's, under extends) matches keys
        # but takes none: that is intended. One that matches no key at all says the rule
        # does not fit this checkpoint (or has a typo): refused, unless marked optional.
        unfit = [rule for rule in rules if rule.index not in matched and not rule.optional
                 and not any(map(rule.pattern.fullmatch, keys))]
        if unfit:
            raise _unfit(f"{len(unfit)} tensor rule{'s match' if len(unfit) != 1 else ' matches'} no tensor, e.g. "
                         f"match '{unfit[0].match}'", ckpt.location, UnmatchedRuleError(
                f"{self.rules.path}: {len(unfit)} tensor rule{'s match' if len(unfit) != 1 else ' matches'} no tensor "
                f"of source {source!r} ({ckpt.location}): "
                + "; ".join(_unmatched_rule(rule, keys) for rule in unfit)
                + "; this rule does not fit this checkpoint (or the pattern is wrong); mark a rule "
                "'optional: true' when the tensor may be absent", source=source))
        if unmatched:
            raise _unfit(f"{len(unmatched)} tensor{'s' if len(unmatched) != 1 else ''} match no rule, e.g. "
                         f"{unmatched[0]!r}", ckpt.location, UnmatchedRuleError(
                f"{self.rules.path}: {len(unmatched)} tensor{'s' if len(unmatched) != 1 else ''} of source "
                f"{source!r} match no rule: {quote_keys(unmatched)}; add a rule for each (or a 'skip' "
                "with its reason), or set require.strict: false", source=source))
        for index, members in grouped.items():
            self._plan_rule(source, self.rules.tensors[index], members)
        for entry in ckpt.unread:  # a trainer's optimizer state, pickled objects: listed, never read
            self.records.put(TensorRecord(source, entry.key, "skipped", None, entry.shape, entry.dtype, None,
                                          entry.reason))
    def _plan_tie_or_skip(self, source: str, info: TensorInfo, rule: TensorRule) -> None:
        where = rule.where.short
        if rule.skip is not None:
            self._record(source, info, "skipped", None, where, rule.skip)
            return
        if rule.consumed is not None:  # checked once every rule has run (_check_consumed)
            self.consumed.append((source, info, rule))
            return
        assert rule.tie is not None
        self.ties.append((source, info.key, rule.tie, rule.label))
        self._record(source, info, "tied", None, where,
                     f"not written: the same bytes as output {rule.tie!r} (checked by apply)")

    def _plan_rule(self, source: str, rule: TensorRule, members: list[TensorInfo]) -> None:
        """A rule's groups, op chains and outputs (engine/plan/groups.py), and a record of
        each tensor it matched."""
        targets: dict[str, list[str]] = {}
        #: members an op chain passed through unchanged (a dequant op's unquantized norm):
        #: recorded as loaded or renamed, not as transformed
        unchanged: set[str] = set()
        #: what the ops said of the members they changed (a permutation's rows)
        said: dict[str, str] = {}
        chain = TargetReason("; ".join(step.op.describe(step.args) for step in rule.ops) + " -> ")
        for planned in plan_rule(rule, source, members, self._references(source), self):
            if planned.unchanged:
                unchanged.update(info.key for info in planned.members)
            if planned.reason is not None:
                said.update((info.key, planned.reason) for info in planned.members)
            dtype = self._out_dtype(planned.dtype, rule.cast)
            self._add_output(OutputPlan(planned.key, dtype, planned.shape, planned.recipe, planned.dtype,
                                        rule.where.short,
                                        loaded=source == self.rules.convert and planned.recipe.carries_bytes_of(source)),
                             RuleRead(rule, source, planned.members[0].key) if planned.members else rule.label)
            for info in planned.members:
                targets.setdefault(info.key, []).append(planned.key)
        actions = {step.op.action for step in rule.ops}
        # its tensors copied whole are held as their outputs (record_table.py)
        by_output = not rule.ops and self._rule_at.get(rule.where.short) is rule
        # the members without a record yet (most), a batch of keys looked up at a time, not one a member
        fresh = {info.key for info in self.records.unrecorded(source, members)} if len(members) > 1 else set()
        for info in members:
            outs = targets.get(info.key, [])
            new = info.key in fresh
            if not outs:
                self._record(source, info, "skipped", None, rule.where.short, "no output of the rule reads it", new)
                continue
            if by_output and len(outs) == 1 and self.records.put_copied(source, info, self.outputs[outs[0]], new):
                continue
            dtype = self._out_dtype(info.dtype, rule.cast)
            if rule.ops and info.key not in unchanged:
                action = actions.pop() if len(actions) == 1 else "transformed"
                actions.add(action)
                reason: str | TargetReason = said.get(info.key) or chain
            else:
                action, reason = copy_wording(rule.template is not None, info.key, outs, info.dtype, dtype)
            target = outs[0] if len(outs) == 1 else tuple(outs)
            more = ""
            if rule.ops and info.key in unchanged:  # an op that passed it through may say why (quantize's ignore)
                more += "".join(f"; {why}" for step in rule.ops if (why := step.op.kept_reason(step.args, info.key)))
            more += cast_words(info.dtype, dtype)
            if more:
                reason = (reason.text(target) if isinstance(reason, TargetReason) else reason) + more
            self._record(source, info, action, target, rule.where.short, reason, new)

    # -- what a chain's ops ask (groups.PlannerAccess) -----------------------------------
    def alignment(self, source_vocab: str, target_vocab: str) -> Alignment:
        name = f"{source_vocab}->{target_vocab}"
        if name not in self.alignments:
            self.alignments[name] = self.vocab[source_vocab].alignment_to(self.vocab[target_vocab])
        return self.alignments[name]

    def tensor(self, source: str, key: str, why: str) -> TensorInfo:
        return self._tensor(source, key, why)

    def lend(self, source: str, info: TensorInfo, where: str, reason: str) -> None:
        self._record(source, info, "rows", None, where, reason)

    def has_tensor(self, source: str, key: str, why: str) -> bool:
        if source not in self.ckpts:
            raise PlanError(f"{why}: no source named {source!r} is open (declared: {', '.join(self.rules.sources)}); "
                            "name a source of the rule file's sources", source=source)
        return key in self.ckpts[source].tensors

    def _check_consumed(self) -> None:
        """Each tensor a rule says is ``consumed`` was read by an op (it lent its bytes)."""
        for source, info, rule in self.consumed:
            earlier = self.records.get(source, info.key)
            if earlier is None or earlier.action != "rows":
                raise PlanError(f"{rule.label}: {source}:{info.key} is consumed ({rule.consumed}), but no op of the "
                                "rules read it: the tensor it belongs with is missing or named otherwise; correct "
                                "the keys, or skip it with its reason if dropping it is intended",
                                source=source, key=info.key)
            self.records.put(TensorRecord(source, info.key, "consumed", None, info.shape, info.dtype,
                                          rule.where.short, f"{rule.consumed}; {earlier.reason}"))

    def _check_ties(self) -> None:
        for source, key, target, label in self.ties:
            problem = tie_problem(source, self.ckpts[source].tensors[key], target, self.outputs.get(target))
            if problem is not None:
                raise PlanError(f"{label}: tie: {problem}", key=key)

    # -- add -----------------------------------------------------------------------------
    def _plan_add(self, entry: AddEntry, rule_outputs: Mapping[str, OutputPlan]) -> None:
        where = entry.where.short
        label = f"add.{entry.key} ({where})"
        if entry.is_constant:  # engine/plan/constants.py; never loaded, like every add
            assert self.rules.convert is not None
            for out in plan_constant(entry, rule_outputs, self._references(self.rules.convert),
                                     lambda dtype: self._out_dtype(dtype, None)):
                self._add_output(out, label)
            return
        if entry.vocab is not None:
            vmap = self.vocab[entry.vocab]
            assert entry.field is not None
            shape, dtype = ((vmap.draft_size,), "I64") if entry.field == "d2t" else ((vmap.vocab_size,), "BOOL")
            recipe = VocabField(entry.vocab, entry.field, entry.encoding)
            self._add_output(OutputPlan(entry.key, dtype, shape, recipe, dtype, where, loaded=False), label)
            return
        assert entry.source is not None and entry.tensor is not None
        info = self._tensor(entry.source, entry.tensor, label)
        dtype = self._out_dtype(info.dtype, entry.cast)
        # never "loaded", even from the converted source: require.loaded asks what the rules
        # carried over, and an add is a declared extra
        self._add_output(OutputPlan(entry.key, dtype, info.shape, CopyTensor(entry.source, info.key),
                                    info.dtype, where, loaded=False), label)
        self._record(entry.source, info, "copied", entry.key, where, f"added as {entry.key!r}")

    def _read_layout_source(self) -> None:
        """The headers of the source the output is laid out like (``output.shards.like``),
        read now: the layout is decided from them, so they are pinned with the plan's reads
        (a changed one makes an output stale) and their tensors are in the audit."""
        like = self.rules.output.shards_like
        if like is None:
            return
        ckpt = self.ckpts[like]
        for file in ckpt.files:
            self._record_unused_of(like, ckpt.tensors_of_file(file),
                                   f"in {file}, read to lay the output out like it (output.shards.like); no rule reads it")

    # -- completeness of the audit ---------------------------------------------------------
    def _record_unused(self) -> None:
        """Every other tensor of every file whose header was read is accounted for too."""
        for source, files in self.files_opened.items():
            ckpt = self.ckpts[source]
            for file in sorted(files):
                self._record_unused_of(source, ckpt.tensors_of_file(file),
                                       f"in {file}, which was opened for other tensors; no rule reads it")

    def _record_unused_of(self, source: str, infos: list[TensorInfo], reason: str) -> None:
        """``_record(source, info, "unused", ...)`` of each of ``infos``: a record of none
        that has one (looked up a batch at a time)."""
        for info in self.records.unrecorded(source, infos):
            self.records.put(TensorRecord(source, info.key, "unused", None, info.shape, info.dtype, None, reason))


