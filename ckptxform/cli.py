"""The ``ckptxform`` command: parse arguments, call the library, map errors to exit codes.

Exit status: 0 done; 2 invalid rule file or usage; 1 anything else that failed. One line
per problem on stderr, no traceback unless ``CKPTXFORM_DEBUG=1``.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from .errors import CkptxformError, UsageError

F = TypeVar("F", bound=Callable[..., Any])


def _configure_logging(quiet: bool, verbose: bool) -> None:
    from loguru import logger

    logger.remove()
    level = "WARNING" if quiet else ("DEBUG" if verbose else "INFO")
    logger.add(sys.stderr, level=level, format="<level>{level: <7}</level> {message}", colorize=None)


def _reports_errors(func: F) -> F:
    """Turn ckptxform errors into one line per problem and the contract's exit codes."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except CkptxformError as err:
            if os.environ.get("CKPTXFORM_DEBUG") == "1":
                raise
            click.echo(f"error: {err}" if "\n" not in str(err) else str(err), err=True)
            sys.exit(err.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except Exception as err:  # noqa: BLE001 - last resort: one line, never a traceback
            if os.environ.get("CKPTXFORM_DEBUG") == "1":
                raise
            click.echo(f"internal error: {type(err).__name__}: {err} "
                       "(rerun with CKPTXFORM_DEBUG=1 and report the traceback)", err=True)
            sys.exit(1)

    return wrapper  # type: ignore[return-value]


def _parse_overrides(values: tuple[str, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in values:
        name, sep, location = item.partition("=")
        if not sep or not name or not location:
            raise UsageError(f"--source {item!r}: expected NAME=LOCATION, e.g. --source drafter=./my-drafter")
        out[name] = location
    return out


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ckptxform")
@click.option("-q", "--quiet", is_flag=True, help="Only warnings and errors.")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def main(quiet: bool, verbose: bool) -> None:
    """Declarative checkpoint conversion: rename, permute by vocabulary map, fill, assert, audit."""
    _configure_logging(quiet, verbose)


@main.command()
@click.argument("rules", nargs=-1, required=True)
@_reports_errors
def validate(rules: tuple[str, ...]) -> None:
    """Check rule files against the rule language; exit 2 with FILE:LINE:COL messages if invalid."""
    from .errors import RuleError
    from .rules.loader import load_rules

    problems: list[str] = []
    for path in rules:
        try:
            load_rules(path)
        except RuleError as err:
            problems.extend(err.problems)
        else:
            click.echo(f"{path}: ok")
    if problems:
        raise RuleError(problems)


def _emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False))
