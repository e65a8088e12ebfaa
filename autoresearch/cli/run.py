"""CLI commands: run (the loop) and status (what a loop is doing, from any shell)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.live import Live
from rich.text import Text

from autoresearch.config import load_config
from autoresearch.harness.gpus import check_override as check_gpu_table
from autoresearch.records.ledger import Row, Status
from autoresearch.session.loop import Event, Summary
from autoresearch.session.loop import build
from autoresearch.views.status import read_status
from autoresearch.cli.app import app, brackets, console, err_console

_STYLE = {"keep": "bold green", "discard": "yellow", "crash": "red", "timeout": "red", "rejected": "magenta",
          "degraded": "red", "pruned": "cyan", "interrupted": "bold red", "validation": "blue"}


def _bpb(v: float | None) -> str:
    return "-" if v is None else f"{v:.6f}"


def _row_line(r: Row) -> Text:
    t = Text(f"{r.exp_id or 0:04d} ")
    t.append(f"{r.status.value:<11}", style=_STYLE.get(r.status.value, ""))
    t.append(f" {_bpb(r.val_bpb):>9}  {r.commit or '-------':7}  {r.description}")
    if r.reason and r.status is not Status.KEEP:
        t.append(f"  ({r.reason})", style="dim")
    return t


class LiveView:
    """Turns loop events into lines, and a live line (step, %, loss, tokens/s, MFU, remaining) while training."""

    def __init__(self):
        self.live = Live(Text(""), console=console, transient=True, refresh_per_second=4)
        self._lock = threading.Lock()

    def __call__(self, e: Event) -> None:
        with self._lock:
            if e.kind in ("info", "warn"):
                self.live.console.print(Text(e.message, style="yellow" if e.kind == "warn" else ""))
            elif e.kind == "start":
                self.live.update(Text(f"{e.spec.id:04d} {e.spec.kind} {e.message} …".replace("  ", " "), style="dim"))
            elif e.kind == "step":
                p = e.step
                mfu = "?" if p.mfu is None else f"{p.mfu:.1f}%"
                self.live.update(Text(f"{e.spec.id:04d} step {p.step} | {p.pct:5.1f}% | loss {p.loss:.4f} | "
                                      f"tok/s {p.tokens_per_s:,.0f} | mfu {mfu} | {p.remaining_s}s left"))
            elif e.kind == "result":
                self.live.update(Text(""))
                self.live.console.print(_row_line(e.row))

    def finish(self, s: Summary) -> None:
        b = s.best
        best = (f"best: {b.val_bpb:.6f} {s.objective} at {b.commit} (experiment {b.exp_id or 0:04d}: {b.description})"
                if b else "best: no kept result yet")
        console.print(Text(best, style="bold"))
        console.print(f"{s.experiments} experiment(s) this run, {s.kept} kept; results in {s.results}; "
                      f"branch {s.branch}", highlight=False)


GpusOpt = Annotated[Optional[str], typer.Option(help="Slots: GPU indices 0,1,…, all, or cpu:N (N slots without a "
                                                   "GPU); with --executor ray: ray:N experiments in flight.")]
StaleOpt = Annotated[Optional[str], typer.Option(help="A win whose parent is no longer the best: rerun (on the new "
                                                      "best, default) or record (as stale).")]
ExecutorOpt = Annotated[Optional[str], typer.Option(help=brackets("local (this machine's slots) or ray (a Ray "
                                                                  "cluster; pip install 'autoresearch-ar[ray]')."))]
AddressOpt = Annotated[Optional[str], typer.Option(help="Ray cluster address (with --executor ray).")]


def scale_out(gpus: str | None, stale_policy: str | None, executor: str | None, address: str | None) -> dict:
    """The several-GPU flags as config overrides."""
    return {"gpus": gpus, "stale_policy": stale_policy, "executor": executor, "ray_address": address}


@app.command()
def run(
    repo: Annotated[Path, typer.Option(help="The git repo holding train.py.")] = Path("."),
    tag: Annotated[Optional[str], typer.Option(help="Experiment tag: branch autoresearch/TAG, runs/TAG/ "
                                                   "(default: the tag of the branch you are on, else today's, "
                                                   "like nov30). An existing tag resumes.")] = None,
    proposer: Annotated[Optional[str], typer.Option(help="agent | grid | random | strategy "
                                                        "(default: agent if --agent is set, else strategy).")] = None,
    agent: Annotated[Optional[str], typer.Option(help="claude | codex | aider, or a command with {prompt} or "
                                                     "{prompt_file}.")] = None,
    max_experiments: Annotated[Optional[int], typer.Option(min=1, help="Stop after N experiments.")] = None,
    max_hours: Annotated[Optional[float], typer.Option(min=0, help="Start no experiment after H hours.")] = None,
    max_usd: Annotated[Optional[float], typer.Option(help="Start no proposal once the tag's agents have spent X "
                                                         "USD (as they report it; see results.tsv agent_usd).")] = None,
    time_budget: Annotated[Optional[float], typer.Option(help="Training seconds per experiment.")] = None,
    config: Annotated[Optional[Path], typer.Option(help="YAML config (see configs/run.yaml).")] = None,
    calibrate_noise: Annotated[int, typer.Option(min=0, help="Run the baseline K times (K >= 2; 0: off) and keep "
                                                              "only wins beyond their spread. Skipped when a noise "
                                                              "threshold is configured.")] = 3,
    unsandboxed: Annotated[bool, typer.Option("--unsandboxed", help="Run proposal code without the Landlock "
                                                                    "sandbox (where the kernel has none); every "
                                                                    "result is marked unsandboxed.")] = False,
    max_consecutive_crashes: Annotated[Optional[int], typer.Option(min=1, help="Stop after N failures in a row "
                                                                               "(default 5).")] = None,
    gpus: GpusOpt = None,
    stale_policy: StaleOpt = None,
    executor: ExecutorOpt = None,
    address: AddressOpt = None,
) -> None:
    """Propose, commit, train for a fixed budget, measure val_bpb, keep or revert — until a limit."""
    cfg = load_config(config, {"proposer": proposer, "agent": agent, "time_budget": time_budget, "max_usd": max_usd,
                               "max_consecutive_crashes": max_consecutive_crashes,
                               "max_experiments": max_experiments, "max_hours": max_hours,
                               "sandbox": False if unsandboxed else None, **scale_out(
                                   gpus, stale_policy, executor, address)})
    check_gpu_table()  # a broken override file: exit 2 now, not a crash of the first GPU experiment
    view = LiveView()
    loop = build(cfg, repo, tag=tag, on_event=view, calibrate_noise=calibrate_noise,
                 command="ar " + " ".join(sys.argv[1:]), require_noise=True)
    with view.live:
        summary = loop.run(cfg.max_experiments, cfg.max_hours)
    view.finish(summary)
    raise typer.Exit(130 if summary.interrupted else 1 if summary.failed else 0)


@app.command()
def status(repo: Annotated[Path, typer.Option(help="The git repo holding train.py.")] = Path("."),
           tag: Annotated[Optional[str], typer.Option(help="Which runs/<tag>/ (default: the running loop's, else "
                                                          "the branch you are on, else today's, else the "
                                                          "newest).")] = None,
           as_json: Annotated[bool, typer.Option("--json", help="Print the status document (lock holder, the "
                                                               "session's state, best, counts) as JSON.")] = False) -> None:
    """Who holds the lock, what runs now and how far it is, and the best result so far."""
    st = read_status(repo, tag)
    if st["tag"] and tag is None and not as_json:         # JSON: its `tag_from`
        err_console.print(f"tag {st['tag']} ({st['tag_from']})", highlight=False, soft_wrap=True)   # tags.py
    if as_json:
        import json
        console.out(json.dumps({"running": st["holder"] is not None, **st}, default=str), highlight=False)
        return
    console.print(_holder_line(st), highlight=False)
    if st["tag"]:
        console.print(_experiment_line(st), highlight=False)
        for line in _slot_lines(st):
            console.print(line, highlight=False)
        b = st["best"]
        counts = ", ".join(f"{n} {k}" for k, n in sorted(st["counts"].items())) or "no results yet"
        metric = (st.get("objective") or {}).get("name", "val_bpb")
        console.print(f"best: {_bpb(b['val_bpb'])} {metric} at {b['commit']} ({b['description']})" if b else
                      "best: none yet", highlight=False)
        console.print(f"results: {counts} (runs/{st['tag']}/results.tsv)", highlight=False)
        s = st["status"] or {}
        if s.get("sigma"):   # what the session can see (experiment/measure.py)
            console.print(f"noise: σ {s['sigma']:.6f} a run; a gain of {s['detectable']:.6f} is kept 4 times in 5, "
                          f"one of nothing at most {s['false_keep']:.0%} of the time", highlight=False)


def _holder_line(st: dict) -> str:
    h, why = st["holder"], (st["status"] or {}).get("why")
    if not h:
        return f"no ar loop is running in {st['repo']}" + (f"; last tag: {st['tag']}" if st["tag"] else "") + (
            f", last stop: {why}" if why else "")
    return f"running: pid {h.get('pid')} on {h.get('host')} since {h.get('since')}, tag {h.get('tag')} " \
           f"(`{h.get('command')}`)"


_KIND = {"baseline": "the baseline", "propose": "a proposal", "knobs": "a knob edit", "rerun": "a re-run of a commit",
         "commit": "a commit of yours"}
_PHASE = {"proposing": "being written by the proposer", "committing": "being checked and committed",
          "training": "training", "evaluating": "being scored by the evaluator",
          "settling": "being decided and recorded"}


def _doing(x: dict) -> str:
    """`experiment 0004, a proposal, is training: <description>`: what it is and what happens to it, in words."""
    kind, phase = x.get("kind"), x.get("phase")
    what = f"experiment {x['id']:04d}, {_KIND.get(kind, kind or 'an experiment')}, is {_PHASE.get(phase, phase)}"
    return f"{what}: {x['description']}" if x.get("description") else what


def _experiment_line(st: dict) -> str:
    s = st["status"] or {}
    x, p = s.get("experiment"), s.get("step")
    if not st["running"] or not x:
        return "now: idle"
    line = f"now: {_doing(x)}"
    if p and x["phase"] == "training":
        mfu = "?" if p.get("mfu") is None else f"{p['mfu']:.1f}%"
        line += (f" — step {p['step']}, {p['pct']:.1f}%, loss {p['loss']:.4f}, tok/s {p['tokens_per_s']:,.0f}, "
                 f"mfu {mfu}, {p['remaining_s']}s left")
    return line


def _slot_lines(st: dict) -> list[str]:
    """One line per slot (several GPUs or Ray): which experiment, how far, on which GPU or node."""
    slots = (st["status"] or {}).get("slots") or []
    out = []
    for sl in slots if st["running"] else []:
        where = sl["label"] + (f" on {sl['node']}" if sl.get("node") else "")
        x, p = sl.get("experiment"), sl.get("step")
        if not x:
            out.append(f"  {where}: idle")
            continue
        line = f"  {where}: {_doing(x)}"
        if p and x["phase"] == "training":
            line += f" — step {p['step']}, {p['pct']:.1f}%, loss {p['loss']:.4f}, {p['remaining_s']}s left"
        out.append(line)
    return out
