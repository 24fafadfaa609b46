"""The one way a command reports what the user must fix: one line on stderr, then exit (2 unless told)."""

from __future__ import annotations

import sys
from typing import NoReturn

import click

from scaletrain.exit_codes import EXIT_BAD_INPUT


def fail(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    """Print `scaletrain: error: MESSAGE` to stderr and exit with `code`."""
    click.echo(f"scaletrain: error: {message}", err=True)
    sys.exit(code)
