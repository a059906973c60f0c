"""The command line: commands, errors -> exit codes, terminal output, reports, demo and the
rule catalogue. It only parses arguments, calls the library and maps errors to exit codes."""

from .commands import main

__all__ = ["main"]
