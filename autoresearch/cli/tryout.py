"""CLI commands: try (train the working tree once, scored like an experiment, nothing committed) and eval (score a
checkpoint), both against the tag's best."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from autoresearch.cli.app import app, console
from autoresearch.session import tryout
from autoresearch.config import load_config
from autoresearch.cli.run import LiveView

RepoOpt = Annotated[Path, typer.Option(help="The git repo holding train.py.")]
TagOpt = Annotated[Optional[str], typer.Option(help="Compare with this tag's best, on its settings (default: the "
                                                   "tag of the branch you are on, else today's, as `ar run` "
                                                   "takes it).")]
ConfigOpt = Annotated[Optional[Path], typer.Option(help="YAML config (see configs/run.yaml).")]


def _show(result: tryout.TryResult) -> None:
    for line in result.lines():
        console.print(line, highlight=False, soft_wrap=True)
    raise typer.Exit(1 if result.status is not None else 0)


@app.command("try")
def try_(repo: RepoOpt = Path("."), tag: TagOpt = None, config: ConfigOpt = None,
         unsandboxed: Annotated[bool, typer.Option("--unsandboxed", help="Run without the Landlock sandbox "
                                                                         "(where the kernel has none).")] = False
         ) -> None:
    """Train the working tree once, as an experiment of the tag would run (sandboxed, ar's clock, the trusted
    evaluator), and show its val_bpb against the tag's best and noise. Nothing is committed."""
    cfg = load_config(config, {"sandbox": False if unsandboxed else None})
    view = LiveView()
    with view.live:
        result = tryout.run(cfg, repo, tag, lambda t: t.try_tree(), on_event=view,
                            command="ar " + " ".join(sys.argv[1:]))
    _show(result)


@app.command("eval")
def eval_(checkpoint: Annotated[Path, typer.Argument(metavar="CHECKPOINT", help="A checkpoint folder (model.json "
                                                                                "+ weights.safetensors; `python "
                                                                                "train.py` writes ./checkpoint).")],
          repo: RepoOpt = Path("."), tag: TagOpt = None, config: ConfigOpt = None) -> None:
    """Score a checkpoint with the trusted evaluator (the working tree's train.py rebuilds the model) and show it
    beside the tag's best."""
    cfg = load_config(config, {})
    folder = tryout.check_checkpoint(checkpoint.resolve())   # refused before anything opens or is numbered
    result = tryout.run(cfg, repo, tag, lambda t: t.eval_checkpoint(folder),
                        on_event=LiveView(), command="ar " + " ".join(sys.argv[1:]))
    _show(result)


def _budgets(text: str) -> list[float]:
    try:
        out = sorted({float(v) for v in text.split(",") if v.strip()})
    except ValueError:
        out = []
    if not out or min(out) <= 0:
        raise typer.BadParameter(f"{text!r} is not a list of budgets in seconds: give them comma-separated, "
                                 "for example --budgets 60,150,300")
    return out


@app.command("noise")
def noise(budgets: Annotated[str, typer.Option(help="Training budgets to compare, in seconds, comma-separated.")]
          = "60,150,300",
          runs: Annotated[int, typer.Option(min=2, help="Runs at each budget (seeds from ar).")] = 3,
          repo: RepoOpt = Path("."), tag: TagOpt = None, config: ConfigOpt = None) -> None:
    """Measure the noise of the tag's best at several budgets (each trained RUNS times with ar's seeds, as an
    experiment runs) and recommend the budget that tells the smallest gains from noise per hour of GPU. Nothing
    is committed; each run is a trial in runs/TAG/trials.tsv, the table in runs/TAG/noise-budgets.json."""
    from autoresearch.budgets import table
    from autoresearch.records.durable import write_json

    wanted = _budgets(budgets)
    cfg = load_config(config, {})
    view = LiveView()

    def measure(t: tryout.Tryout):
        rows = tryout.measure_budgets(t, wanted, runs)
        lines = table(rows)
        write_json(t.tag_dir / "noise-budgets.json", {
            "commit": t.best_sha, "runs": runs, "lines": lines,
            "budgets": [{"budget": r.budget, "values": r.values, "seconds": r.seconds, "epochs": r.epochs,
                         "sigma": r.sigma, "failed": r.failed} for r in rows]})
        return lines

    with view.live:
        lines = tryout.run(cfg, repo, tag, measure, on_event=view, command="ar " + " ".join(sys.argv[1:]))
    for line in lines:
        console.print(line, highlight=False, soft_wrap=True)
