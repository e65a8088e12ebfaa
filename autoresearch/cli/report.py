"""CLI commands: report — the best config, the top table or a sweep's points, the per-knob summary, plots, JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from autoresearch.cli.app import app, console, err_console, print_table
from autoresearch.views import plots
from autoresearch.views import report as rep


@app.command()
def report(
    repo: Annotated[Path, typer.Option(help="The repository holding runs/.")] = Path("."),
    tag: Annotated[Optional[str], typer.Option(help="Which runs/<tag>/ (default: the tag of the branch you are on, else "
                                                   "today's, else the newest).")] = None,
    all_tags: Annotated[bool, typer.Option("--all", help="Every tag under runs/, oldest first.")] = False,
    top: Annotated[int, typer.Option(help="Rows in the top table.")] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
    plot: Annotated[Optional[Path], typer.Option(
        help="Write the plot to this PNG: the progress plot, or a sweep's grid plot (default runs/<tag>/grid.png)."
    )] = None,
) -> None:
    """Read the results of a run or a sweep: the best config and how to reproduce it."""
    warn = lambda msg: err_console.print(f"warning: {msg}", highlight=False, soft_wrap=True)  # noqa: E731
    tags, rows, choice = rep.load(repo, tag, all_tags, warn=warn)
    if choice is not None and choice.why != "--tag" and not as_json:   # JSON: its `tag_from`
        err_console.print(choice.line(), highlight=False, soft_wrap=True)   # which tag, and why (tags.py)
    data = rep.build(rows, tags, top, specs=lambda row: rep.run_spec(repo, row),
                     objective=rep.objective_of(repo, tags))
    written = plots.write_plots(data, rows, repo, plot, warn)
    data.update(written, journals=rep.journals(repo, tags), gpu_use=rep.gpu_use_of(repo, tags),
                tag_from=choice.why if choice else "--all")
    if as_json:
        console.out(json.dumps(data), highlight=False)
        return
    for s in rep.sections(data):
        print_table(s.title, s.columns, s.rows)
    for name, path in written.items():
        console.print(f"{name.replace('_', ' ')}: {path}", highlight=False, soft_wrap=True)
    for t, path in data["journals"].items():
        console.print(f"research journal: {path} (`ar journal --tag {t}`)", highlight=False, soft_wrap=True)
