"""The Typer app, its two consoles and the printing helpers every command module uses (set up for where
they write: a terminal, a pipe, NO_COLOR)."""

from __future__ import annotations

import os
from importlib import metadata
from typing import Annotated, Sequence

import typer
import typer.core
import typer.rich_utils
from rich.console import Console
from rich.markup import escape
from rich.table import Table

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
    (`from .app import console`), and a test runner swaps sys.stdout between invocations."""
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
        from autoresearch import __version__
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
