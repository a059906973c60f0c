"""Human-readable and JSON renderings of plans, results and checkpoints (for the CLI)."""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..engine.run.execute import ApplyResult
from ..engine.plan.planner import Plan
from ..errors import printable, quote_keys, terminal_line
from ..sources.base import Checkpoint
from ..tensor_digest import NO_DIGEST

if TYPE_CHECKING:
    from .catalogue import RuleCard
    from .demo import DemoResult, RuleDemo
    from ..rules.library import ShippedRule
    from ..sources.dcp import DcpListing
    from ..sources.kind import CheckpointKind

#: what a source tensor did when it was carried into the output; every other record is
#: named on screen with its reason (the founding story's "skipped 2" said not which)
_CARRIED = {"loaded", "renamed", "permuted", "cast", "copied", "transformed"}
#: names shown per group unless verbose
_SHOWN = 8


def _screen(lines: list[str]) -> str:
    """The lines for the terminal: names are quoted where they are embedded (``printable``);
    any control character left (a rule's own text) is escaped, never sent raw."""
    return "\n".join(map(terminal_line, lines))


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:,.0f} {unit}" if unit == "B" else f"{size:,.1f} {unit}"
        size /= 1024
    return f"{n} B"


def not_carried_text(plan: Plan, *, verbose: bool = False) -> list[str]:
    """Every source tensor that was not carried into the output (skipped, unused, read only
    as a vocabulary map or for fill rows), grouped by source, action and reason, with its
    names: the first few per group, all of them when ``verbose``."""
    # (source, action, reason) -> [count, the first's rule, the least keys (all when verbose)]:
    # the records themselves are not held (a plan's are read one at a time); a group's keys
    # are distinct (one record a source tensor)
    groups: dict[tuple[str, str, str], list[Any]] = {}
    for record in plan.records.stored():  # a tensor copied whole by a rule is carried: not read
        if record.action not in _CARRIED:
            group = groups.get((record.source, record.action, record.reason))
            if group is None:
                group = groups[(record.source, record.action, record.reason)] = [0, record.rule, []]
            group[0] += 1
            keys = group[2]
            keys.append(record.key)
            if not verbose and len(keys) >= 4 * _SHOWN:
                keys.sort()
                del keys[_SHOWN:]
    if not groups:
        return []
    total = sum(g[0] for g in groups.values())
    lines = [f"not written out as tensors: {total} source tensor{'s' if total != 1 else ''} (each with its reason)"]
    for (source, action, reason), (count, rule, keys) in sorted(groups.items()):
        lines.append(f"  {action} ({count}) from {printable(source)}: {printable(reason)}"
                     + (f" [{rule}]" if rule else ""))
        shown = quote_keys(keys, limit=count if verbose else _SHOWN)
        if len(keys) < count and count > _SHOWN:  # quote_keys counted the keys kept, not all
            shown = quote_keys(sorted(keys)[:_SHOWN], limit=_SHOWN) + f" and {count - _SHOWN} more"
        lines.append("    " + shown)
    return lines


def plan_text(plan: Plan, *, verbose: bool = False) -> str:
    return "\n".join(plan_lines(plan, verbose=verbose))


def plan_lines(plan: Plan, *, verbose: bool = False) -> Iterator[str]:
    """``plan_text``'s lines, each made when asked for and screened for the terminal: the
    whole text, a line an output, was ~200 bytes a tensor held at once."""
    rules = plan.rules
    lines = [f"plan: {printable(rules.path)} ({printable(rules.name)})", "sources:"]
    width = max((len(n) for n in plan.sources), default=0)
    for name, src in plan.sources.items():
        pin = f" @ {src.commit}" if src.commit else ""
        lines.append(f"  {printable(name):<{width}}  {printable(src.location)}{pin}")
    for label, alignment in plan.alignments.items():
        lines.append(f"vocabulary {label}: {alignment.summary()}")
    # one pass over the outputs before their lines: their row accounts and column widths
    key_w, dtype_w = 3, 5  # F8_E4M3 is wider than BF16
    for i, out in enumerate(plan.outputs):
        key_w = len(printable(out.key)) if i == 0 else max(key_w, len(printable(out.key)))
        dtype_w = max(dtype_w, len(out.dtype))
        r = out.recipe.row_account()
        if r is not None:
            fill = "" if r.label is None else f" from {r.label}" if r.init == "rows_of" else f" ({r.label})"
            lines.append(f"  {printable(out.key)}: {r.from_source:,} of {r.total:,} rows from {r.source} "
                         f"({r.from_source / max(1, r.total):.1%}), {r.filled:,} filled{fill}")
    counts = ", ".join(f"{n} {action}" for action, n in sorted(plan.counts().items()))
    lines.append(f"source tensors: {len(plan.records)} accounted for ({counts})")
    lines.extend(_unread_text(plan))
    lines.extend(not_carried_text(plan, verbose=verbose))
    lines.append(f"output: {len(plan.outputs)} tensors, {_human_bytes(plan.total_bytes)}"
                 + (", config.json" if plan.config is not None else ""))
    lines.extend(_output_files_text(plan))
    yield from map(terminal_line, lines)
    for out in plan.outputs:
        cast = f" cast from {out.input_dtype}" if out.dtype != out.input_dtype else ""
        yield terminal_line(f"  {printable(out.key):<{key_w}}  {out.dtype:<{dtype_w}} {str(list(out.shape)):<14} <- "
                            f"{out.recipe.describe()}{cast}")
    yield from map(terminal_line, [*_files_text(plan), *(f"warning: {warning}" for warning in plan.warnings)])


def _output_files_text(plan: Plan) -> list[str]:
    """The weight files apply writes, with their sizes (the first few of many)."""
    files = plan.output_files
    if not files:
        return []
    shown = ", ".join(f"{printable(name)} ({_human_bytes(size)})" for name, size in files[:_SHOWN])
    more = f" and {len(files) - _SHOWN} more" if len(files) > _SHOWN else ""
    index = " + its index" if len(files) > 1 else ""
    return [f"  {len(files)} file{'s' if len(files) != 1 else ''}{index}: {shown}{more}"]


def _unread_text(plan: Plan) -> list[str]:
    """A line per source with shards never opened (every key the index gives them skipped)."""
    unread: dict[str, set[str]] = {}
    for record in plan.records.stored():  # a tensor copied whole was read: not read again
        if record.unread_file is not None:
            unread.setdefault(record.source, set()).add(record.unread_file)
    return [f"  {printable(source)}: {len(files)} shard{'s' if len(files) != 1 else ''} not opened (every key "
            f"its index gives {'them' if len(files) != 1 else 'it'} is skipped): "
            + quote_keys(sorted(files), limit=_SHOWN) for source, files in sorted(unread.items())]


def _files_text(plan: Plan) -> list[str]:
    files = plan.files
    if not plan.rules.file_rules and not files.copies:  # no files section, and no loader file to carry
        return []
    left = sum(n for _, n in files.unmatched)
    lines = [f"files: {len(files.copies)} copied, {len(files.skips)} skipped, {left} other file(s) not copied"]
    width = max((len(printable(c.target)) for c in files.copies), default=0)
    lines += [f"  {printable(c.target):<{width}}  <- {c.source}:{printable(c.path)} ({c.rule})" for c in files.copies]
    lines += [f"  skipped {s.source}:{printable(s.path)} ({s.rule}): {printable(s.reason)}" for s in files.skips]
    return lines


def plan_json(plan: Plan) -> dict[str, Any]:
    return {
        "rules": plan.rules.path,
        "rules_sha256": plan.rules.sha256,
        "name": plan.rules.name,
        "sources": {n: s.to_dict() for n, s in plan.sources.items()},
        "vocab": {label: a.to_dict() for label, a in plan.alignments.items()},
        "tensors": [r.to_event() for r in plan.records],
        "outputs": [{"key": o.key, "shape": list(o.shape), "dtype": o.dtype, "rule": o.rule,
                     "from": o.origin()} for o in plan.outputs],
        "config": plan.config,
        "files": [c.to_event() for c in plan.files.copies] + [s.to_event() for s in plan.files.skips],
        "warnings": list(plan.warnings),
    }


def apply_text(result: ApplyResult, *, verbose: bool = False) -> str:
    if result.up_to_date:
        return _screen([f"{result.out} is up to date (same plan from the same inputs, verified); nothing written",
                        f"audit: {result.audit_path}"])
    if result.shard_of is not None:
        rank, world = result.shard_of
        return _screen([f"rank {rank}/{world}: wrote {result.shards_of_rank - result.shards_kept} of its "
                        f"{result.shards_of_rank} shard(s) ({_human_bytes(result.bytes_written)}), kept "
                        f"{result.shards_kept}, in {result.job_path}",
                        "once every rank is done: ckptxform finalize with the same rules, sources and "
                        f"--out {result.out}"])
    totals = _WrittenTotals.of(result)
    lines = [f"vocabulary {label}: {alignment.summary()}" for label, alignment in result.plan.alignments.items()]
    lines.extend(not_carried_text(result.plan, verbose=verbose))
    if result.copied:
        lines.append(f"copied {len(result.copied)} file{'s' if len(result.copied) != 1 else ''} "
                     f"({_human_bytes(sum(c.nbytes for c in result.copied))}): "
                     + ", ".join(printable(c.copy.target) for c in result.copied))
    lines.extend(_summary(result, totals.files))
    lines.extend(_how_moved(totals))
    lines.append(f"audit: {result.audit_path}")
    return _screen(lines)


@dataclass(frozen=True)
class _WrittenTotals:
    """What the report says of the written tensors, counted in one pass over them: after
    a run they are read back from the audit when asked for (~7 us a tensor a pass)."""

    files: int
    cloned: int
    moved: int
    undigested: bool

    @classmethod
    def of(cls, result: ApplyResult) -> _WrittenTotals:
        files: set[str] = set()
        cloned = moved = 0
        undigested = False
        for w in result.written:
            files.add(w.file)
            if w.moved:
                cloned += w.moved["cloned"]
                moved += sum(w.moved.values())
            undigested = undigested or w.algorithm == NO_DIGEST
        return cls(len(files), cloned, moved, undigested)


def _how_moved(totals: _WrittenTotals) -> list[str]:
    """The bytes the filesystem cloned (when any), and a run without digests said plainly."""
    lines = []
    if totals.cloned:
        lines.append(f"cloned {_human_bytes(totals.cloned)} of {_human_bytes(totals.moved)} from the sources "
                     "(shared extents: no data moved, no space used until either side is changed)")
    if totals.undigested:
        lines.append("no digests (--digest none): verify checks structure and sizes, not the bytes")
    return lines


def _summary(result: ApplyResult, files: int) -> list[str]:
    """What this run wrote, and what OUT holds when that is more (after a resume, a finalize)."""
    def holding(nbytes: int) -> str:
        return f"{len(result.written)} tensors, {_human_bytes(nbytes)} in {files} file{'s' if files != 1 else ''}"

    if not result.shards_kept:
        return [f"wrote {result.out}: {holding(result.bytes_written)}"]
    if not result.bytes_written:
        first = (f"committed {result.out} from the {result.shards_kept} shard(s) finished earlier (by --shard-of "
                 "ranks or an interrupted run); this run wrote no tensor data")
    else:
        first = (f"resumed {result.out}: kept {result.shards_kept} of {files} shard(s) finished earlier (by an "
                 f"interrupted run or --shard-of ranks); this run wrote the other {files - result.shards_kept} "
                 f"({_human_bytes(result.bytes_written)})")
    return [first, f"{result.out} holds {holding(result.plan.total_bytes)}"]


def apply_json(result: ApplyResult) -> dict[str, Any]:
    return {"status": "up_to_date" if result.up_to_date else "ok", "out": str(result.out), "audit": str(result.audit_path),
            "bytes_written": result.bytes_written, "shards_kept": result.shards_kept,
            **({"shard_of": list(result.shard_of), "shards_of_rank": result.shards_of_rank, "job": str(result.job_path)}
               if result.shard_of is not None else {}),
            "tensors": result.plan.counts(),
            "written": [w.to_event() for w in result.written], "files": [c.to_event() for c in result.copied]}


def inspect_json(ckpt: Checkpoint | DcpListing, kind: CheckpointKind | None = None) -> dict[str, Any]:
    return {
        "location": ckpt.location,
        **({"kind": kind.kind, "kind_label": kind.label, "kind_detail": kind.detail} if kind else {}),
        "revision": ckpt.revision,
        "commit": ckpt.commit,
        "files": list(ckpt.files),
        "total_bytes": sum(t.nbytes for t in ckpt.tensors.values()),
        "tensors": [{"key": t.key, "shape": list(t.shape), "dtype": t.dtype, "file": t.file, "bytes": t.nbytes,
                     **_gguf_tensor(ckpt, t.key)} for t in ckpt.tensors.values()],
        "not_weights": [{"key": u.key, "shape": list(u.shape), "dtype": u.dtype, "reason": u.reason}
                        for u in ckpt.unread],
        **({"gguf_metadata": {k: _short_value(v) for k, v in ckpt.gguf_metadata.items()}}
           if hasattr(ckpt, "gguf_metadata") else {}),
    }


def _gguf_tensor(ckpt: Any, key: str) -> dict[str, Any]:
    """A GGUF tensor's block format and the shape of its values (its stored shape is bytes)."""
    kinds = getattr(ckpt, "ggml_types", None)
    return {} if kinds is None else {"ggml_type": kinds[key], "values_shape": list(ckpt.logical_shapes[key])}


def _short_value(value: Any) -> Any:
    """A GGUF metadata value as inspect lists it: an array of more than 8 items as its size and first items."""
    if isinstance(value, list) and len(value) > 8:
        return {"items": len(value), "first": value[:4]}
    return value


def inspect_text(ckpt: Checkpoint | DcpListing, kind: CheckpointKind | None = None) -> str:
    data = inspect_json(ckpt, kind)
    lines = [printable(data["location"]) + (f" @ {data['commit']}" if data["commit"] else "")
             + (f": {kind.label}" + (f" ({kind.detail})" if kind.detail else "") if kind else "")]
    key_w = max((len(printable(t["key"])) for t in data["tensors"]), default=3)
    dtype_w = max([5, *(len(t["dtype"]) for t in data["tensors"])])
    dtype_w = max([dtype_w, *(len(t.get("ggml_type", "")) for t in data["tensors"])])
    for t in data["tensors"]:  # a GGUF tensor: its block format and the shape of its values
        lines.append(f"  {printable(t['key']):<{key_w}}  {t.get('ggml_type', t['dtype']):<{dtype_w}} "
                     f"{str(t.get('values_shape', t['shape'])):<16} {printable(t['file'])}")
    lines.append(f"{len(data['tensors'])} tensors in {len(data['files'])} file(s), {data['total_bytes']:,} bytes "
                 f"({_human_bytes(data['total_bytes'])})")
    if data["not_weights"]:  # a trainer's optimizer state, scheduler, dataloader...: counted by entry
        heads: dict[str, int] = {}
        for entry in data["not_weights"]:
            extra = entry["key"].rsplit(".", 1)[-1].startswith("_extra_state")
            head = "*._extra_state" if extra else entry["key"].split(".", 1)[0]
            heads[head] = heads.get(head, 0) + 1
        lines.append(f"not weights, never read ({len(data['not_weights'])}): "
                     + ", ".join(f"{printable(h)} ({n})" for h, n in heads.items()))
    if "gguf_metadata" in data:
        lines.append(f"GGUF metadata ({len(data['gguf_metadata'])} keys):")
        lines += [f"  {printable(k)} = {printable(repr(v))[:160]}" for k, v in data["gguf_metadata"].items()]
    return _screen(lines)


def rule_card_text(card: RuleCard, text: str) -> str:
    """``ckptxform rules show NAME``: what the catalogue says of the rule, then its file."""
    rule, standin = card.rule, card.standin
    lines = [f"{rule.stem}  ({rule.name})" + (f"  extends {rule.extends}" if rule.extends else ""),
             f"  file:            {rule.path}",
             f"  converts:        {standin.source_layout} -> {standin.target_layout}",
             f"  real models:     {standin.families}",
             "  sources:         " + ", ".join(f"{n}={loc}" for n, loc in rule.sources.items()),
             f"  checked against: {standin.checked_against}",
             "  inverts:         " + ("yes (ckptxform invert " + rule.stem + ")" if card.no_inverse is None
                                      else f"no: {card.no_inverse}"),
             f"  try it:          ckptxform demo {rule.stem}   (stand-ins of its sources, and the apply command)",
             "", f"--- {rule.path}"]
    return _screen(lines) + "\n" + text.rstrip("\n")


def rule_demo_text(demo: RuleDemo, *, force: bool = False) -> str:
    """``ckptxform demo RULE``: the stand-ins built, and the commands to run on them."""
    width = max((len(n) for n in demo.sources), default=0)
    lines = [f"built stand-ins of the sources of {demo.rule_name} under {demo.root / 'sources'}:"]
    lines += [f"  {name:<{width}}  {loc}" for name, loc in demo.sources.items()]
    verify = f"$ ckptxform verify {shlex.quote(str(demo.converted))}"
    if demo.result is None:
        lines += ["", "nothing was converted (add --run to convert them now); convert them, then check the "
                  "output against its audit log:", f"$ {demo.apply_command(force=force)}", verify]
    else:
        lines += ["", f"$ {demo.apply_command(force=force)}", *apply_text(demo.result).splitlines(),
                  "", "check the output against its audit log:", verify]
    lines.append(f"the stand-ins and the output stay in {demo.root}; remove them with: "
                 f"rm -r {shlex.join(map(str, demo.made))}")
    return _screen(lines)


def rules_text(shipped: tuple[ShippedRule, ...]) -> str:
    """``ckptxform rules``: every shipped rule's stem, name, description and default sources."""
    lines = []
    for rule in shipped:
        lines.append(f"{rule.stem}  ({rule.name})" + (f"  extends {rule.extends}" if rule.extends else ""))
        lines.append(f"    {rule.description}")
        lines.append("    sources: " + ", ".join(f"{n}={loc}" for n, loc in rule.sources.items()))
    lines.append(f"\n{len(shipped)} rules in {shipped[0].path.parent if shipped else '(none)'}; "
                 "give a stem or name where a command takes RULES, e.g. ckptxform plan aqmedai_k2_to_k25; "
                 "ckptxform rules show NAME for one")
    return "\n".join(lines)


def fits_text(location: str, fits: list[Any]) -> str:
    """``ckptxform rules --for SOURCE``: the rules that plan on it, then the others and why."""
    planning = [f for f in fits if f.plans]
    lines = [f"rules that plan on {location}:" if planning else f"no shipped rule plans on {location}"]
    lines += [terminal_line(f"  {f.name}  ({f.reason})") for f in planning]
    lines.append("\nthe others:")
    lines += [terminal_line(f"  {f.name}: {f.reason}") for f in fits if not f.plans]
    return "\n".join(lines)


def demo_text(d: DemoResult) -> str:
    """``ckptxform demo``: the stand-ins, then each command it ran with its output."""
    overrides = " ".join(f"--source {shlex.quote(f'{n}={loc}')}" for n, loc in d.sources.items())
    out = shlex.quote(str(d.result.out))
    lines = [f"built stand-ins of the three sources under {d.root / 'sources'}:"]
    lines += [f"  {name:<12} {loc}" for name, loc in d.sources.items()]
    return "\n".join([*lines, f"\n$ ckptxform plan {d.rule_name} {overrides}", plan_text(d.plan),
                      f"\n$ ckptxform apply {d.rule_name} {overrides} --out {out}", apply_text(d.result),
                      f"\nnext: ckptxform inspect {out}   |   ckptxform verify {out}",
                      f"the stand-ins and the output stay in {d.root}; remove them with: "
                      f"rm -r {shlex.join(map(str, d.made))}"])
