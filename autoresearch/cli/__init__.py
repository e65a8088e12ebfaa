"""The `ar` command line: thin Typer commands over the library. Only this package prints with Rich.

Every ArError raised below a command becomes one line on stderr and a non-zero exit; no traceback.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from ..errors import ArError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="ar — autoresearch loop runner: propose, commit, train, measure, keep or revert.")
console = Console()
err_console = Console(stderr=True)

# Each module adds its commands to `app` on import.
from . import prepare, run, sweep, report, doctor  # noqa: E402,F401


def main() -> None:
    try:
        app()  # standalone mode: usage errors print as click's short usage block and exit 2
    except ArError as e:
        err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except (ValueError, FileNotFoundError) as e:  # harness-level user errors (bad env var, missing file)
        err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(1)
