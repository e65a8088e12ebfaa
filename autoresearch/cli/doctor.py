"""CLI commands: doctor (the checklist and the backend probe) and init (a new workspace).

`ar doctor` exits 1 when a check fails (✗: a run would not work), 2 when the GPU table override file is broken
(bad input, as for `ar run`), else 0. `ar doctor --probe` also exits 1
when no candidate passed the correctness check (or none could run); on a machine without a CUDA GPU it says
so in one line and adds nothing to the exit code (there is no backend to choose: CPU runs use fixed settings).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from autoresearch.cli.app import app, console, print_table
from autoresearch.views import doctor as dr
from autoresearch.views import probe as pr
from autoresearch.config import load_config
from autoresearch.workspace import init_workspace

SYMBOL = {dr.OK: "[green]✓[/]", dr.WARN: "[yellow]![/]", dr.FAIL: "[red]✗[/]"}
CHECKLIST_WIDTH = 80  # the checklist's widest line, in a pipe too: a terminal's default width
NAME = 11  # the check's name and a space; continuation lines start under the detail


@app.command()
def doctor(
    repo: Annotated[Path, typer.Option(help="The workspace to check.")] = Path("."),
    config: Annotated[Optional[Path], typer.Option(help="The run config (dataset, agent, profile).")] = None,
    agent: Annotated[Optional[str], typer.Option(help="The agent `ar run --agent` would use.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the checklist.")] = False,
    probe: Annotated[bool, typer.Option("--probe", help="Measure attention/compile/batch paths on the GPU "
                                        "and save the fastest correct one for train.py's \"auto\" knobs.")] = False,
    probe_budget: Annotated[float, typer.Option(help="Seconds the probe may spend in all.")] = 180.0,
) -> None:
    """Check what a run needs, each line with its fix; --probe finds the fastest correct GPU path."""
    cfg = load_config(config, {"agent": agent})
    checks = dr.run_checks(repo, dataset=cfg.dataset, agent=cfg.agent, profile=cfg.profile)
    if not as_json:
        _print_checks(checks)
    probe = probe and dr.config_error(checks) is None  # a broken GPU table: exit 2 now, not after the probe
    report = pr.probe(repo, budget_s=probe_budget, progress=None if as_json else _print_result) if probe else None
    if as_json:  # one document, the verdict inside: a second (error) object would make stdout invalid JSON
        doc = dr.as_json(checks, probe, report)
        console.out(json.dumps(doc), highlight=False)
        raise typer.Exit(doc.get("exit_code", 0))
    if report is not None:
        _print_probe(report)
    elif probe:
        console.print(dr.NO_GPU, highlight=False)
    dr.raise_if_blocking(checks, report)


@app.command()
def init(
    directory: Annotated[Path, typer.Argument(help="Where to create the workspace (new or empty).")],
    force: Annotated[bool, typer.Option(help="Write into a non-empty directory.")] = False,
) -> None:
    """Create a workspace — train.py, program.md, configs/, .gitignore — as a git repo with a first commit."""
    ws = init_workspace(directory, force=force)
    if ws.warning:
        console.print(f"[yellow]note:[/] {escape(ws.warning)}", highlight=False, soft_wrap=True)
    console.print(f"created {ws.path} with {len(ws.files)} files (commit {ws.commit[:7]}). Next:",
                  highlight=False, soft_wrap=True)
    # the README's quick start: 3 runs of the baseline (the noise), then 3 proposals
    console.print(f"  cd {directory} && ar run --max-experiments 6\n  ar report --plot progress.png", highlight=False,
                  soft_wrap=True)


def check_lines(c: dr.Check, width: int = CHECKLIST_WIDTH) -> list[tuple[str, str]]:
    """One check as lines of at most `width` columns once the symbol and a space lead the first: each line is
    (plain text, dim text). The name and the detail come first, then the fix after "→" (dim): on the detail's
    last line when it fits there, else on lines of its own. Words are never cut (a path stays whole, so a
    path longer than a line overflows it); joined with spaces the lines give the one-line text back."""
    room = width - 2  # "✓ " leads every line (continuations: two spaces)
    wrap = lambda text, first, rest: textwrap.wrap(text, room, initial_indent=first, subsequent_indent=rest,  # noqa: E731
                                                   break_long_words=False, break_on_hyphens=False)
    lines = [(ln, "") for ln in wrap(c.detail, f"{c.name:<10} ", " " * NAME) or [f"{c.name:<10}"]]
    if not c.fix:
        return lines
    fix = f"→ {c.fix}"
    if len(lines[-1][0]) + 1 + len(fix) <= room:
        lines[-1] = (lines[-1][0], fix)
        return lines
    return lines + [("", ln) for ln in wrap(fix, " " * NAME, " " * (NAME + 2))]


def _print_checks(checks: list[dr.Check]) -> None:
    width = min(console.width, CHECKLIST_WIDTH)  # a narrower terminal: its width
    for c in checks:
        for i, (text, dim) in enumerate(check_lines(c, width)):
            lead = f"{SYMBOL[c.state]} " if i == 0 else "  "
            tail = f"{' ' if text else ''}[dim]{escape(dim)}[/]" if dim else ""
            console.print(f"{lead}{escape(text)}{tail}", highlight=False, soft_wrap=True)


def _short(text: str, width: int = 90) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _print_result(r: pr.ProbeResult) -> None:
    outcome = (f"{r.tokens_per_s:,.0f} tokens/s" if r.ok and r.tokens_per_s else
               r.skipped or _short(r.error or "failed", 60))
    console.print(f"  probe: {r.candidate.label}: {outcome}", highlight=False, soft_wrap=True)


def _print_probe(report: pr.ProbeReport) -> None:
    num = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    print_table(f"probe ({report.seconds:.0f} s)", ("candidate", "tokens/s", "MFU", "VRAM MB", "Δloss", "status", "why"),
                [(r["label"], num(r["tokens_per_s"], ",.0f"), num(r["mfu"], ".1f"), num(r["peak_vram_mb"], ",.0f"),
                  num(r["max_loss_diff"], ".2%"), r["status"], _short(r["note"])) for r in report.rows])
    for note in report.notes:
        console.print(f"note: {note}", highlight=False)
    if report.choice is None:
        console.print("[red]✗[/] no candidate passed the correctness check; train.py keeps its defaults")
    else:
        console.print(f"[green]✓[/] chosen: {report.choice.label} → {report.path}", highlight=False)
