"""CLI commands: sweep — a grid of knob values × time budgets, one experiment per point, resumable."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from autoresearch.cli.app import app, console, print_table
from autoresearch.sweep import run as sw
from autoresearch.sweep import file as sf
from autoresearch.config import load_config
from autoresearch.harness.gpus import check_override as check_gpu_table
from autoresearch.session.loop import check_repo
from autoresearch.cli.run import AddressOpt, ExecutorOpt, GpusOpt, LiveView, StaleOpt, scale_out


@app.command()
def sweep(
    file: Annotated[Path, typer.Argument(metavar="CONFIG.yaml", help="The sweep file (configs/sweep-*.yaml).")],
    repo: Annotated[Path, typer.Option(help="The repository with train.py.")] = Path("."),
    config: Annotated[Optional[Path], typer.Option(help="Run config (YAML) for the runner settings.")] = None,
    order: Annotated[Optional[str], typer.Option(help="listed (file order) or cheap-first (by budget).")] = None,
    dry_run: Annotated[bool, typer.Option(help="Print the plan and its total time (the budgets plus the per-run "
                                                     "overhead); run nothing.")] = False,
    early_stop: Annotated[bool, typer.Option(help="Prune points clearly worse at equal progress.")] = False,
    validate_top: Annotated[int, typer.Option(min=0, help="Re-run the best K points with other seeds.")] = 0,
    retry_crashed: Annotated[bool, typer.Option(help="Run crashed points again.")] = False,
    gpus: GpusOpt = None,
    stale_policy: StaleOpt = None,
    executor: ExecutorOpt = None,
    address: AddressOpt = None,
) -> None:
    """Run a sweep file: each point a commit on autoresearch/sweep-<name>; a second call resumes it."""
    cfg = load_config(config, scale_out(gpus, stale_policy, executor, address))
    check_gpu_table()  # a broken override file: exit 2 now, not a crash of the first GPU point
    if not dry_run:
        check_repo(repo)   # another ar holds the repo: say so before the plan
    plan = sf.plan(file, repo, cfg, order=order, retry_crashed=retry_crashed)
    if not dry_run:
        sw.check_tree(plan)   # a dirty tree: refused before the plan, naming `ar sweep`
    print_table(f"plan ({order or plan.sweep.order})", ("#", "state", "budget", "point"), plan.rows())
    console.print(plan.summary(), highlight=False)
    if dry_run:
        return
    view = LiveView()
    with view.live:
        result = sw.run_sweep(plan, cfg, early_stop=early_stop, validate_top=validate_top, on_event=view,
                              command="ar " + " ".join(sys.argv[1:]))
    for line in result.lines():
        console.print(line, highlight=False)
    raise typer.Exit(130 if result.interrupted else 1 if result.failed else 0)
