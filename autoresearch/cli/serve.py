"""CLI command: serve — a read-only live dashboard of a tag in the browser (SSE push, localhost by default)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from autoresearch.cli.app import app, console, err_console
from autoresearch.views import serve as dashboard
from autoresearch.trust.integrity import no_bytecode


@app.command()
def serve(
    repo: Annotated[Path, typer.Option(help="The repository holding runs/.")] = Path("."),
    tag: Annotated[Optional[str], typer.Option(help="Which runs/<tag>/ (default: the tag of the branch you are on, else "
                                                   "today's, else the newest).")] = None,
    results: Annotated[Optional[Path], typer.Option(help="Any results.tsv instead (upstream's too).")] = None,
    host: Annotated[str, typer.Option(help="Address to listen on. Anything but loopback requires the token.")]
    = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0: any free one).")] = 8765,
    token: Annotated[Optional[str], typer.Option(help="Require this token (default: a random one when --host is "
                                                      "not loopback, none on loopback).")] = None,
    noise: Annotated[Optional[float], typer.Option(help="Near-miss threshold for the journal.")] = None,
) -> None:
    """Watch a run live: the running experiment, the best-so-far curve, results with their diffs, the journal."""
    no_bytecode()   # a running `ar run` fingerprints the package: this process adds no .pyc to it
    src = dashboard.source_for(repo, tag, results, noise)

    def listening(url: str) -> None:
        if src.choice is not None and src.choice.why != "--tag":   # which tag, and why (tags.py)
            err_console.print(src.choice.line(), highlight=False, soft_wrap=True)
        console.print(f"serving {src.name()} at {url}  (read-only; Ctrl-C stops)", highlight=False, soft_wrap=True)
    dashboard.serve(src, host, port, token, listening)
