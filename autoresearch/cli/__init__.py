"""The `ar` command line: thin Typer commands over the library. Only this package prints with Rich.

Every ArError raised below a command becomes one line on stderr (one JSON object on stdout with --json) and
the exit code of the table in docs/usage.md: 0 ok, 1 failure, 2 usage or bad input, 3 lock held, 130 interrupted.
No traceback. On a terminal the output is coloured and wrapped to its width; into a pipe or a file it is
plain, unwrapped lines (`ar doctor`'s checklist wraps at 80 columns); NO_COLOR or --no-color: no escape codes at all.
"""

from __future__ import annotations

import json
import sys
from typing import NoReturn

import typer
from rich.markup import escape

from autoresearch.errors import ArError
from autoresearch.cli.app import app, brackets, configure_output, console, err_console, print_table, version  # noqa: F401

try:  # typer 0.2x carries its own copy of click, whose errors derive from TyperException
    from typer import TyperException as _UsageErrors
except ImportError:  # older typer: click's own
    from click import ClickException as _UsageErrors

# Each module adds its commands to `app` on import.
from autoresearch.cli import prepare, run, sweep, report, doctor, journal, serve, tryout  # noqa: E402,F401


def fail(message: str, code: int, as_json: bool) -> NoReturn:
    """One line on stderr, or with --json one JSON object on stdout (stdout stays valid JSON), then exit."""
    if as_json:
        console.out(json.dumps({"error": message, "exit_code": code}), highlight=False)
    else:
        err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    sys.exit(code)


def main() -> None:
    """The entry point of both console scripts, `ar` and `autoresearch` (binutils has an `ar` too)."""
    as_json = "--json" in sys.argv[1:]
    try:
        # Not standalone: click's usage errors come here too, to be one line (or JSON) like ArError.
        code = app(standalone_mode=False)  # Ctrl-C: typer returns 130
    except _UsageErrors as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # plain `ar`: the usage, as `ar --help` prints it
            text = e.format_message()              # on a terminal Rich printed it already (and left this empty)
            if text.strip():
                console.out(text, highlight=False)
            sys.exit(2)
        ctx = getattr(e, "ctx", None)
        hint = f" (see `{ctx.command_path} -h`)" if ctx is not None and e.exit_code == 2 else ""
        fail(e.format_message() + hint, e.exit_code, as_json)
    except typer.Abort as e:  # older typer: Ctrl-C; else end of input at a prompt
        if isinstance(e.__cause__, KeyboardInterrupt):
            sys.exit(130)
        fail("aborted", 1, as_json)
    except ArError as e:
        fail(str(e), e.exit_code, as_json)
    except (ValueError, FileNotFoundError) as e:  # harness-level bad input (a bad env var, a missing file)
        fail(str(e), 2, as_json)
    sys.exit(code if isinstance(code, int) else 0)
