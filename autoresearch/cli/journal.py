"""CLI command: journal — what a tag tried, near misses, dead ends by idea, strategy switches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from autoresearch.cli.app import app, console, err_console
from autoresearch.proposers import memory
from autoresearch.trust.integrity import no_bytecode


@app.command()
def journal(
    repo: Annotated[Path, typer.Option(help="The repository holding runs/.")] = Path("."),
    tag: Annotated[Optional[str], typer.Option(help="Which runs/<tag>/ (default: the tag of the branch you are on, else "
                                                   "today's, else the newest).")] = None,
    results: Annotated[Optional[Path], typer.Option(help="Any results.tsv instead (upstream's five columns "
                                                         "too).")] = None,
    noise: Annotated[Optional[float], typer.Option(help="Near-miss threshold (default: the tag's noise.json, "
                                                       "else the default keep threshold).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the journal as one JSON object.")] = False,
) -> None:
    """What a tag tried: ideas, outcomes, lessons, near misses, dead ends, strategy switches.

    Each experiment's idea, change, outcome and lesson, from the runner's records; also written to
    runs/<tag>/journal.md and journal.json."""
    no_bytecode()   # a running `ar run` fingerprints the package: this process adds no .pyc to it
    j, tag_dir, choice = memory.for_repo(repo, tag, results, noise)
    if choice is not None and choice.why != "--tag" and not as_json:   # JSON: its `tag_from`
        err_console.print(choice.line(), highlight=False, soft_wrap=True)   # which tag, and why (tags.py)
    if tag_dir is not None:
        memory.write(j, tag_dir)
    if as_json:
        console.out(json.dumps({**j.to_dict(), **({"tag_from": choice.why} if choice else {})}), highlight=False)
    else:
        console.out(memory.markdown(j), highlight=False)
