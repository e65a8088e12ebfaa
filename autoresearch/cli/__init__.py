"""The `ar` command line: thin Typer commands over the library. Only this package prints with Rich.

Every ArError raised below a command becomes one line on stderr (one JSON object on stdout with --json) and
the exit code of the table in the README: 0 ok, 1 failure, 2 usage or bad input, 3 lock held, 130 interrupted.
No traceback. On a terminal the output is coloured and wrapped to its width; into a pipe or a file it is
plain, unwrapped lines; NO_COLOR or --no-color: no escape codes at all.
"""

from __future__ import annotations

import json
import os
import sys
from importlib import metadata
from typing import Annotated, NoReturn, Sequence

import typer
import typer.core
import typer.rich_utils
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..errors import ArError

try:  # typer 0.2x carries its own copy of click, whose errors derive from TyperException
    from typer import TyperException as _UsageErrors
except ImportError:  # older typer: click's own
    from click import ClickException as _UsageErrors

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="ar — autoresearch loop runner: propose, commit, train, measure, keep or revert.")
console = Console()
err_console = Console(stderr=True)

PLAIN_WIDTH = 1_000_000  # into a pipe: never hard-wrap (Rich would wrap at 80 columns)
_RICH_HELP = typer.core.HAS_RICH  # typer's own switch (TYPER_USE_RICH), as it was at start
_plain = {"stdout": False}  # set by configure_output: stdout is not a terminal (tables become tab-separated)


def _settings(stderr: bool, no_color: bool) -> dict:
    terminal = Console(stderr=stderr).is_terminal  # Rich's own test: a TTY, or FORCE_COLOR / TTY_COMPATIBLE
    if terminal and not no_color:
        return {"stderr": stderr}
    # color_system None writes no escape codes at all (Rich's own NO_COLOR handling keeps bold and dim);
    # not a terminal also means no live line, whose redraws are escape codes too
    plain = {"stderr": stderr, "color_system": None, "force_terminal": False, "emoji": False}
    return plain if terminal else {**plain, "soft_wrap": True, "width": PLAIN_WIDTH}


def configure_output(no_color: bool = False) -> None:
    """Set up both consoles for where they write now. They are set up in place: the command modules hold them
    (`from . import console`), and a test runner swaps sys.stdout between invocations."""
    no_color = no_color or os.environ.get("NO_COLOR", "") != ""  # no-color.org: set and not empty
    typer.rich_utils.COLOR_SYSTEM = None if no_color else "auto"  # typer's help and usage messages
    for c, stderr in ((console, False), (err_console, True)):
        Console.__init__(c, **_settings(stderr, no_color))
    _plain["stdout"] = not Console().is_terminal
    # --help into a pipe: click's plain text, never wrapped (typer's Rich panels box it at 80 columns and cut
    # long option names short)
    typer.core.HAS_RICH = _RICH_HELP and not _plain["stdout"]
    if _plain["stdout"]:
        app.info.context_settings["terminal_width"] = PLAIN_WIDTH
    else:
        app.info.context_settings.pop("terminal_width", None)


def _flag_type(display=getattr(typer.core.TyperOption, "display_type_rich", None)):
    """typer's Rich help names a type for flags too (`--unsandboxed <bool>`, `-h <bool>`), as if they took a
    value; a flag shows none."""
    if display is None:   # an older typer: nothing to fix
        return
    typer.core.TyperOption.display_type_rich = lambda self, ctx: (
        None if self.is_flag and self.metavar is None else display(self, ctx))


_flag_type()


def brackets(text: str) -> str:
    """Help text with square brackets shown as they are: Rich's help reads `[x]` as markup, click's does not."""
    return text.replace("[", "\\[") if typer.core.HAS_RICH else text


configure_output()


def version() -> str:
    try:
        return metadata.version("autoresearch-ar")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        from .. import __version__
        return __version__


def _print_version(value: bool) -> None:
    if value:
        console.out(f"ar {version()}", highlight=False)
        raise typer.Exit()


@app.callback()
def _global_options(
    _version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_print_version,
                                           help="Print the version and exit.")] = False,
    _no_color: Annotated[bool, typer.Option("--no-color", is_eager=True, callback=configure_output,
                                            help="No colour or other escape codes (also: NO_COLOR=1).")] = False,
) -> None:
    # Both options act in their callbacks (eager: before --help, which is eager too, when given first).
    pass


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A Rich table on a terminal; into a pipe, the title and one tab-separated line per row, never wrapped."""
    if not _plain["stdout"]:
        table = Table(*columns, title=title, title_justify="left")
        for r in rows:
            table.add_row(*(escape(v) for v in r))
        console.print(table)
        return
    one_line = lambda v: " ".join(str(v).split("\t")).replace("\n", " ")  # noqa: E731
    lines = [title, *("\t".join(one_line(v) for v in r) for r in (columns, *rows)), ""]
    console.file.write("\n".join(lines) + "\n")  # not console.out: Rich would expand the tabs to spaces


# Each module adds its commands to `app` on import.
from . import prepare, run, sweep, report, doctor, journal, serve, tryout  # noqa: E402,F401


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
