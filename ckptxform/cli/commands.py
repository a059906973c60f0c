"""The ``ckptxform`` command: its subcommands and options; each parses its arguments,
calls the library (imported when the command runs: each command pays only for what it
uses) and prints the result.

How a command fails (one line per problem, the exit codes, the ``--json`` failure object)
is ``cli_errors``.
"""

from __future__ import annotations

import json
import sys
from itertools import islice
from collections.abc import Callable
from typing import Any

import click

from .failures import reports_errors, usage_failure
from ..engine.run.executors import EXECUTORS
from ..engine.run.options import RunOptions
from ..errors import RuleError, UsageError, terminal_line
from ..log import configure_stderr
from ..tensor_digest import DEFAULT_DIGEST, DIGEST_CHOICES

_LEVEL_KEY = "ckptxform.log_level"


def _set_level(level: str) -> Callable[[click.Context, click.Parameter, bool], None]:
    def callback(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
        if value:
            ctx.find_root().meta[_LEVEL_KEY] = level
            configure_stderr(level)
    return callback


def _verbosity_options() -> list[click.Option]:
    """-q/-v, taken by the group and by every subcommand (``apply R --out X -q``)."""
    return [click.Option(["-q", "--quiet"], is_flag=True, expose_value=False, callback=_set_level("WARNING"),
                         help="Only warnings and errors; no progress bar."),
            click.Option(["-v", "--verbose"], is_flag=True, expose_value=False, callback=_set_level("DEBUG"),
                         help="Debug logging.")]


def _quiet() -> bool:
    return click.get_current_context().find_root().meta.get(_LEVEL_KEY) == "WARNING"


def _verbose() -> bool:
    """``-v`` (before or after the subcommand): complete lists (every skipped or unused
    tensor) instead of the first few."""
    return click.get_current_context().find_root().meta.get(_LEVEL_KEY) == "DEBUG"


_JSON_KEY = "ckptxform.json"


def _json_before_subcommand() -> bool:
    """The default of every command's ``--json``: given before the subcommand (``ckptxform
    --json apply ...``), it holds for the subcommand too."""
    return bool(click.get_current_context().find_root().meta.get(_JSON_KEY))


def _remember_json(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        ctx.find_root().meta[_JSON_KEY] = True


class _Command(click.Command):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.params.extend(_verbosity_options())
        for param in self.params:
            if param.name == "as_json":
                param.default = _json_before_subcommand

    def invoke(self, ctx: click.Context) -> Any:
        if ctx.find_root().meta.get(_JSON_KEY) and not any(p.name == "as_json" for p in self.params):
            raise click.UsageError(f"--json: the {ctx.info_name} command has no JSON output; drop --json", ctx)
        return super().invoke(ctx)


def _echo_report(text: str) -> None:
    """A command's report of what it did (apply, finalize, verify): not under -q,
    where only warnings and errors are shown (the exit status says it worked)."""
    if not _quiet():
        click.echo(text)


def _print_result(result: Any, as_json: bool) -> None:
    """What ``apply`` or ``finalize`` did: its JSON object, or its report unless -q. OUT is
    committed, so a stdout that cannot take it is said on stderr and the command still
    exits 0 (README, "Exit status and --json")."""
    from . import report
    from ..log import logger
    from .terminal import echo_done

    if not as_json and _quiet():
        return
    lost = echo_done(json.dumps(report.apply_json(result), indent=2) if as_json
                     else report.apply_text(result, verbose=_verbose()))
    if lost is not None:
        logger.warning("{} is written; its report was not printed: {}", result.out, lost)


class _Group(click.Group):
    """The ``ckptxform`` group: usage errors (click's own) also print the JSON failure
    object on stdout when ``--json`` was given, like every other failure."""

    command_class = _Command

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        argv = sys.argv[1:] if args is None else list(args)
        if not standalone_mode:  # the caller handles click's exceptions itself
            return super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as err:
            usage_failure(err, argv)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


def _parse_overrides(values: tuple[str, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in values:
        name, sep, location = item.partition("=")
        if not sep or not name or not location:
            raise UsageError(f"--source {item!r}: expected NAME=LOCATION, e.g. --source drafter=./my-drafter")
        out[name] = location
    return out


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ckptxform")
@click.pass_context
def main(ctx: click.Context) -> None:
    """Declarative checkpoint conversion: rename, permute by vocabulary map, fill, assert, audit.

    RULES is a rule file, or a shipped rule's file stem or name (`ckptxform rules`).
    """
    # The CLI logs to stderr (the library alone stays silent); -q/-v given after the
    # subcommand are parsed after this and change the level again.
    if _LEVEL_KEY not in ctx.meta:
        configure_stderr("INFO")


main.params.extend(_verbosity_options())
main.params.append(click.Option(["--json"], is_flag=True, expose_value=False, callback=_remember_json,
                                help="JSON output for the subcommand (as its own --json)."))


@main.command()
@click.argument("rules", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@reports_errors
def validate(rules: tuple[str, ...], as_json: bool) -> None:
    """Check rule files against the rule language; exit 2 with FILE:LINE:COL messages if invalid."""
    from ..rules.loader import load_rules

    problems: list[str] = []
    first: RuleError | None = None
    valid = []
    for path in rules:
        try:
            ruleset = load_rules(path)
        except RuleError as err:
            problems.extend(err.problems)
            first = first or err
        else:
            valid.append({"rules": path, "file": ruleset.path, "name": ruleset.name})
            if not as_json:
                click.echo(terminal_line(f"{path}: ok"))
    if first is not None:  # every file's problems; the failure object says where the first is
        raise RuleError(problems, path=first.path, line=first.line, col=first.col)
    if as_json:
        click.echo(json.dumps({"status": "ok", "valid": valid}, indent=2))


class _RulesGroup(click.Group):
    """``rules`` lists the library; ``rules show NAME`` shows one rule."""

    command_class = _Command


@main.group(name="rules", cls=_RulesGroup, invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, default=_json_before_subcommand, help="Print as JSON.")
@click.option("--for", "for_source", default=None, metavar="SOURCE",
              help="Plan every shipped rule against this checkpoint (local or ORG/NAME[@REV]; headers only) "
                   "and list those that plan first, then the others with the reason.")
@click.pass_context
@reports_errors
def list_rules(ctx: click.Context, as_json: bool, for_source: str | None) -> None:
    """List the shipped rule library: each rule's name, description and default sources;
    `rules show NAME` prints one rule's file, sources and what it was checked against;
    `rules --for SOURCE` which rules fit a checkpoint."""
    from . import report
    from ..rules.catalogue import shipped_rules

    if ctx.invoked_subcommand is not None:
        return
    if for_source is not None:
        from ..engine.plan.fit import fitting_rules

        fits = fitting_rules(for_source)
        if as_json:
            click.echo(json.dumps([f.to_dict() for f in fits], indent=2))
        else:
            click.echo(report.fits_text(for_source, fits))
        return
    shipped = shipped_rules()
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in shipped], indent=2))
        return
    click.echo(report.rules_text(shipped))


list_rules.params.extend(_verbosity_options())


@list_rules.command(name="show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON (with the file's text).")
@reports_errors
def show_rule(name: str, as_json: bool) -> None:
    """Print a shipped rule: its file, its sources, what it was checked against, its stand-ins."""
    from . import report
    from .catalogue import rule_card

    card = rule_card(name)
    text = card.rule.path.read_text(encoding="utf-8")
    click.echo(json.dumps({**card.to_dict(), "text": text}, indent=2) if as_json else report.rule_card_text(card, text))


_source_option = click.option(
    "--source", "sources", multiple=True, metavar="NAME=LOC",
    help="Replace the location of source NAME (a local path or ORG/NAME[@REV]).")
_require_pinned_option = click.option(
    "--require-pinned", is_flag=True,
    help="Fail (exit 2) when a Hub source's revision is a branch or tag instead of a commit.")


@main.command()
@click.argument("rules")
@_source_option
@_require_pinned_option
@click.option("--json", "as_json", is_flag=True, help="Print the plan's records as JSON.")
@reports_errors
def plan(rules: str, sources: tuple[str, ...], require_pinned: bool, as_json: bool) -> None:
    """Show what apply would do, from headers only: every tensor, the vocab statistics."""
    from .. import api
    from . import report

    with _naming_fitting_rules(lambda: api.plan(rules, sources=_parse_overrides(sources),
                                                require_pinned=require_pinned)) as the_plan:
        if as_json:
            click.echo(json.dumps(report.plan_json(the_plan), indent=2))
        else:  # a few thousand lines at a time: the whole text was ~200 bytes a tensor
            lines = report.plan_lines(the_plan, verbose=_verbose())
            while piece := list(islice(lines, 4096)):
                click.echo("\n".join(piece))


@main.command()
@click.argument("rules")
@_source_option
@_require_pinned_option
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output directory.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--no-fsync", is_flag=True,
              help="Do not flush OUT to disk before renaming it into place (faster; a power loss may lose it).")
@click.option("--digest", type=click.Choice(DIGEST_CHOICES), default=DEFAULT_DIGEST, show_default=True,
              help="Hash the audit log records for every written tensor; 'none' hashes nothing (no byte is "
                   "read back: a clone on XFS/btrfs moves no data) and verify then checks only structure "
                   "and sizes.")
@click.option("--hash-inputs", is_flag=True,
              help="Also hash every input file over 64 MiB whole (one more read of each), so that a rerun "
                   "after a touch or a copy without -p of such a file still finds OUT up to date.")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None,
              help="Output shards written at once, each in a worker process (default: the cores, bounded "
                   "by memory and by the shards).")
@click.option("--no-resume", is_flag=True,
              help="Discard the shards an interrupted run of the same plan finished, and start over.")
@click.option("--executor", type=click.Choice(list(EXECUTORS)), default="local", show_default=True,
              help="Where shard tasks run: worker processes here, or a Ray cluster (the 'ray' extra).")
@click.option("--ray-address", default=None, metavar="ADDRESS",
              help="The Ray cluster for --executor ray (default: RAY_ADDRESS, else a local Ray instance).")
@click.option("--shard-of", default=None, metavar="RANK/WORLD",
              help="Write only the shards of this rank (index modulo WORLD) for any launcher; then "
                   "'ckptxform finalize'.")
@click.option("--strict", is_flag=True, help="Fail (exit 1) on a warning of the plan.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@reports_errors
def apply(rules: str, sources: tuple[str, ...], require_pinned: bool, out: str, force: bool, no_fsync: bool,
          digest: str, hash_inputs: bool, jobs: int | None, no_resume: bool, executor: str,
          ray_address: str | None, shard_of: str | None, strict: bool, as_json: bool) -> None:
    """Convert: write OUT (safetensors, config.json) and OUT/ckptxform_audit.jsonl."""
    from .. import api

    options = RunOptions(force=force, fsync=not no_fsync, require_pinned=require_pinned,
                         progress=False if _quiet() else None, digest=digest, jobs=jobs, resume=not no_resume,
                         executor=executor, ray_address=ray_address, shard_of=_parse_shard_of(shard_of),
                         strict=strict, hash_inputs=hash_inputs)
    result = _naming_fitting_rules(lambda: api.apply(rules, out=out, sources=_parse_overrides(sources),
                                                     options=options))
    _print_result(result, as_json)


def _naming_fitting_rules(call: Callable[[], Any]) -> Any:
    """``call()``; when the rule does not fit the checkpoint, its error also names the shipped
    rules that plan on it (what ``ckptxform rules --for`` lists)."""
    from ..errors import UnmatchedRuleError

    try:
        return call()
    except UnmatchedRuleError as err:
        if err.location is not None:
            from ..engine.plan.fit import fitting_rules

            fits = [f.name for f in fitting_rules(err.location) if f.plans]
            err.message += (f"; shipped rules that plan on it: {', '.join(fits)}" if fits
                            else "; no shipped rule plans on it") + f" (ckptxform rules --for {err.location})"
        raise


def _parse_shard_of(value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    from ..rules.templates import is_index

    rank, sep, world = value.partition("/")
    if not (sep and is_index(rank) and is_index(world) and int(rank) < int(world)):
        raise UsageError(f"--shard-of {value!r}: expected RANK/WORLD with 0 <= RANK < WORLD, e.g. --shard-of 0/4")
    return int(rank), int(world)


@main.command()
@click.argument("rules")
@_source_option
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output directory.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--no-fsync", is_flag=True, help="Do not flush OUT to disk before renaming it into place.")
@click.option("--digest", type=click.Choice(DIGEST_CHOICES), default=DEFAULT_DIGEST, show_default=True,
              help="The digest the ranks used.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@reports_errors
def finalize(rules: str, sources: tuple[str, ...], out: str, force: bool, no_fsync: bool, digest: str,
             as_json: bool) -> None:
    """Commit OUT from the shards every 'apply --shard-of RANK/WORLD' wrote (same arguments)."""
    from .. import api

    result = api.finalize(rules, out=out, sources=_parse_overrides(sources), force=force, fsync=not no_fsync,
                          digest=digest)
    _print_result(result, as_json)


@main.command()
@click.argument("location")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@reports_errors
def inspect(location: str, as_json: bool) -> None:
    """Say which kind of checkpoint LOCATION is (safetensors, .bin/.pth, DCP, Megatron torch_dist,
    Meta consolidated.NN.pth) and list its tensors, shapes, dtypes, files and total bytes
    (headers and metadata only)."""
    from . import report
    from ..sources.resolve import inspect_location

    listing, kind = inspect_location(location)
    with listing:
        click.echo(json.dumps(report.inspect_json(listing, kind), indent=2) if as_json
                   else report.inspect_text(listing, kind))


@main.command(name="vocab-diff")
@click.argument("location_a")
@click.argument("location_b")
@click.option("--encoding", type=click.Choice(["offset", "absolute"]), default="offset", show_default=True,
              help="How both d2t tensors are encoded.")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@reports_errors
def vocab_diff(location_a: str, location_b: str, encoding: str, as_json: bool) -> None:
    """Compare two drafters' draft vocabularies (d2t/t2d, or vocab-map files)."""
    from ..vocab.diff import vocab_diff as compare

    result = compare(location_a, location_b, encoding=encoding)  # type: ignore[arg-type]
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else result.text())


@main.command()
@click.argument("location")
@click.option("--verifier", "verifier", default=None, metavar="SOURCE",
              help="The verifier the drafter is for (local or Hub): its config and headers only.")
@click.option("--for", "consumers", default=None, metavar="CONSUMERS",
              help="Comma-separated: speculators,vllm,sglang,llama.cpp,transformers (default: those that load "
                   "the drafter's layout).")
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON (a list per consumer).")
@reports_errors
def preflight(location: str, verifier: str | None, consumers: str | None, as_json: bool) -> None:
    """Say, for each consumer, what it would load silently wrong from the drafter at LOCATION
    (vocabulary maps, widths, verifier layer ids, flags whose defaults differ); exit 1 when a
    consumer is at risk. Reads headers, configs and the small d2t/t2d tensors only."""
    from ..errors import SourceNotFoundError
    from ..vocab.preflight import preflight as check

    try:
        report = check(location, verifier=verifier, consumers=consumers)
    except SourceNotFoundError as err:  # exit 1 means "a consumer is at risk": a wrong path is usage
        raise UsageError(str(err), path=err.path, source=err.source) from err
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else report.text())
    if report.exit_code:
        sys.exit(report.exit_code)


@main.command()
@click.argument("location_a")
@click.argument("location_b")
@click.option("--structure-only", is_flag=True,
              help="Compare headers only (keys, shapes, dtypes); read no tensor bytes (a Hub checkpoint's "
                   "weights are then not fetched).")
@click.option("--rehash", is_flag=True,
              help="Hash every tensor compared, even where a checkpoint's audit log records its digest.")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None,
              help="Tensors hashed at once (default: the cores, at most 8).")
@click.option("--emit-rules", is_flag=True, help="Print a starting rule file converting A into B's layout; "
              "it is applied to A and compared with B, exit 1 naming each tensor it does not reproduce.")
@click.option("--out", "out", type=click.Path(dir_okay=False), default=None,
              help="With --emit-rules: write the rule file here (paths in it made relative to it).")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@reports_errors
def diff(location_a: str, location_b: str, structure_only: bool, rehash: bool, jobs: int | None, emit_rules: bool,
         out: str | None, as_json: bool) -> None:
    """Compare two checkpoints: keys, shapes, dtypes and (by digest) the bytes of every
    tensor; suggest renames and structural ops. Exit 0 when A and B hold the same tensors,
    1 when they differ (with --emit-rules: 0 when the rule file reproduces B, else 1)."""
    from ..diff.checkpoint import checkpoint_diff
    from ..diff.check import NotReproduced, checked_rules

    result = checkpoint_diff(location_a, location_b, values=not structure_only, use_audits=not rehash, jobs=jobs)
    if emit_rules:
        try:  # a rule that does not give B is still the starting point: written, then refused
            text, refused = checked_rules(result, out), None
        except NotReproduced as err:
            text, refused = err.text, err
        if out is not None:
            with open(out, "w", encoding="utf-8") as file:
                file.write(text)
        else:
            click.echo(text, nl=False)
        if refused is not None:
            raise refused
        return
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else result.text())
    if result.differs:
        sys.exit(1)


@main.command()
@click.argument("rules")
@click.option("--out", "out", type=click.Path(dir_okay=False), default=None,
              help="Write the inverse to this file (default: print it).")
@click.option("--over", "over", type=click.Path(file_okay=False), default=None,
              help="Prove the inverse one-to-one over the keys RULES wrote into this OUT (its audit), "
                   "rather than over every key RULES could write.")
@reports_errors
def invert(rules: str, out: str | None, over: str | None) -> None:
    """Print the rule file that undoes RULES (checked); exit 2 naming each rule with no inverse."""
    from ..rules.invert import proven_inverse_yaml
    from ..rules.loader import load_rules

    text = proven_inverse_yaml(load_rules(rules), out, over)
    if out is None:
        click.echo(text, nl=False)
    else:
        with open(out, "w", encoding="utf-8") as file:
            file.write(text)


@main.command()
@click.argument("rule", required=False)
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Where to build the stand-ins and the output (default: a new temporary directory).")
@click.option("--force", is_flag=True, help="Replace the stand-ins or the output of an earlier demo in --out.")
@click.option("--run", "run_it", is_flag=True,
              help="With RULE: also convert the stand-ins (without it, the command converting them is printed).")
@reports_errors
def demo(rule: str | None, out: str | None, force: bool, run_it: bool) -> None:
    """Offline: run the headline rule on small stand-ins of its three sources; with RULE (any
    shipped rule), build stand-ins of its sources and print the command converting them
    (--run: convert them too)."""
    from . import report

    if rule is None and run_it:
        raise UsageError("--run goes with RULE: `ckptxform demo` alone always converts the headline stand-ins")
    if rule is not None:
        from .demo import build_rule_demo

        built = build_rule_demo(rule, out, force=force, run=run_it)
        click.echo(report.rule_demo_text(built, force=force))  # the commands are the point, even under -q
        return
    from .demo import run_demo

    click.echo(report.demo_text(run_demo(out, force=force)))


@main.command()
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@reports_errors
def verify(out: str, as_json: bool) -> None:
    """Re-read every tensor of OUT and check it against OUT's audit log (digests, shapes, index, config)."""
    from ..engine.output.verify import verify as check

    result = check(out)
    if as_json:
        click.echo(json.dumps({"status": "ok", "out": str(result.out), "tensors": result.tensors,
                               "bytes_checked": result.bytes_checked, "bytes_unchecked": result.bytes_unchecked}))
    else:
        line = f"{result.out}: {result.tensors} tensors verified ({result.bytes_checked:,} bytes)"
        if result.bytes_unchecked:
            line += (f"; {result.bytes_unchecked:,} bytes NOT checked: written with --digest none, their "
                     "structure and sizes were checked, not their contents")
        _echo_report(terminal_line(line))
