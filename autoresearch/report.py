"""What a run or a sweep found: the best config, the top table, the per-knob summary, a progress plot, JSON.

Data in, dicts and rows out: `build` turns ledger rows into one plain dict (what `ar report --json`
prints); `sections` turns that dict into titled tables of strings for the CLI to print. Reads our
results.tsv and upstream's five-column one alike (through the ledger).
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from .errors import ArError, ConfigError
from .layout import RESULTS, RunsLayout
from .sweep import seed_stats, verdicts
from .sweepfile import FINISHED_STATUSES, show_number, show_value, status_of

CANDIDATES = frozenset({"keep", "discard"})  # rows that may be "the best config"
_FIELDS = ("commit", "val_bpb", "memory_gb", "status", "description", "exp_id", "tag", "parent", "mfu",
           "tokens_per_s", "training_seconds", "total_seconds", "num_steps", "total_tokens_M", "time_budget",
           "seed", "knobs", "reason", "started_at", "finished_at")


@dataclass(frozen=True)
class Section:
    title: str
    columns: tuple[str, ...]
    rows: list[tuple[str, ...]]


def find_tags(repo: str | Path) -> list[str]:
    """Tags under runs/ that have a results.tsv, newest first."""
    found = RunsLayout(Path(repo)).tags_with(RESULTS)
    found.sort(key=lambda p: (p.stat().st_mtime, p.parent.name), reverse=True)
    return [p.parent.name for p in found]


def load(repo: str | Path, tag: str | None = None, all_tags: bool = False, warn=None) -> tuple[list[str], list]:
    """(tags, rows). Nothing to report (no runs/, no such tag, no row yet) is an ArError saying how to get
    results. A corrupt line of results.tsv is named through `warn` and skipped, as `ar run` and `ar status` do."""
    from .ledger import read_results

    runs = RunsLayout(Path(repo)).runs
    if tag and all_tags:
        raise ConfigError("--tag and --all exclude each other; pass one")
    if tag:
        tags = [tag]
    else:
        tags = find_tags(repo)
        if not all_tags:
            tags = tags[:1]
        else:
            tags.reverse()  # oldest first: experiments in the order they ran
    if not tags:
        raise ArError(f"no results yet: no {runs}/<tag>/results.tsv; run `ar run` (or `ar sweep FILE`) in this "
                      "repository first")
    rows = []
    for t in tags:
        path = RunsLayout(Path(repo)).tag(t).results
        if not path.is_file():
            others = find_tags(repo)
            raise ArError(f"no results for tag {t!r}: {path} does not exist; "
                          + (f"tags with results: {', '.join(others)}" if others else
                             "run `ar run` (or `ar sweep FILE`) first"))
        for r in read_results(path, warn=warn or (lambda msg: None)):
            r.tag = r.tag or t  # upstream's rows have no tag column
            rows.append(r)
    if not rows:
        raise ArError(f"no results yet in {', '.join(str(runs / t / 'results.tsv') for t in tags)}: a row is "
                      "written when an experiment finishes (`ar status` shows the one running)")
    return tags, rows


# ---------------------------------------------------------------- pure summaries

def experiment(row, index: int) -> dict:
    d = {f: getattr(row, f, None) for f in _FIELDS}
    d["status"] = status_of(row)
    d["knobs"] = dict(row.knobs or {})
    d["index"] = index
    return {k: _clean(v) for k, v in d.items()}


def best_row(rows: Sequence):
    cands = [r for r in rows if status_of(r) in CANDIDATES and r.val_bpb is not None and math.isfinite(r.val_bpb)]
    return min(cands, key=lambda r: r.val_bpb) if cands else None


def run_spec(repo: str | Path, row) -> dict:
    """What the runner passed to this row's run, from runs/<tag>/<NNNN>-<sha7>/spec.json ({} when absent)."""
    if row.exp_id is None or not row.tag:
        return {}
    try:
        import json
        return json.loads((RunsLayout(Path(repo)).tag(row.tag).exp_dir(row.exp_id, row.commit) /
                           "spec.json").read_text())
    except (OSError, ValueError):
        return {}


def reproduce_command(row, spec: dict | None = None) -> str:
    """The command that re-trains this row's experiment by hand: its commit, profile, budget, seed. (The run
    saves a checkpoint; the score is the evaluator's, which `ar run` computes with the spec's eval_tokens.)"""
    spec = spec or {}
    env = []
    if spec.get("profile"):
        env.append(f"AR_PROFILE={spec['profile']}")
    if row.time_budget is not None:
        env.append(f"AR_TIME_BUDGET={show_number(float(row.time_budget))}")
    if row.seed is not None:
        env.append(f"AR_SEED={row.seed}")
    return " ".join([f"git checkout {shlex.quote(row.commit)} &&", *env, "python train.py"])


def per_knob(rows: Sequence) -> dict[str, list[dict]]:
    """For each knob that takes two or more values (a sweep axis, TIME_BUDGET included): the best val_bpb,
    the number of runs and the best commit per value."""
    values: dict[str, dict[Any, list]] = {}
    for r in rows:
        items = list((r.knobs or {}).items())
        if r.time_budget is not None:
            tb = float(r.time_budget)
            items.append(("TIME_BUDGET", int(tb) if tb.is_integer() else tb))
        for k, v in items:
            values.setdefault(k, {}).setdefault(_hashable(v), []).append(r)
    out = {}
    for k, groups in values.items():
        if len(groups) < 2:
            continue
        entries = []
        for v, rs in groups.items():
            b = best_row(rs) or _best_finished(rs)
            entries.append({"value": v, "runs": len(rs), "best_val_bpb": None if b is None else b.val_bpb,
                            "commit": None if b is None else b.commit})
        entries.sort(key=lambda e: (e["best_val_bpb"] is None, e["best_val_bpb"] or 0.0))
        out[k] = entries
    return out


def validation(rows: Sequence) -> list[dict]:
    """Commits with `validation` re-runs: mean ± spread over all their seeds, ranked, ties called ties."""
    commits = list(dict.fromkeys(r.commit for r in rows if status_of(r) == "validation"))
    stats = seed_stats(rows, commits)
    return [{"commit": s.commit, "mean": s.mean, "spread": s.spread, "n": len(s.values), "verdict": v}
            for s, v in verdicts(stats)]


def build(rows: Sequence, tags: Sequence[str] = (), top: int = 10, specs: Callable[[Any], dict] | None = None) -> dict:
    """Everything `ar report` shows, as one JSON-ready dict. `specs(row)` gives the run's spec.json, for the
    best row's exact command (see `run_spec`)."""
    experiments = [experiment(r, i) for i, r in enumerate(rows, 1)]
    best = best_row(rows)
    ranked = sorted((i for i, r in enumerate(rows) if status_of(r) in CANDIDATES and r.val_bpb is not None),
                    key=lambda i: rows[i].val_bpb)[:max(0, top)]
    counts: dict[str, int] = {}
    for r in rows:
        counts[status_of(r)] = counts.get(status_of(r), 0) + 1
    best_d = None
    if best is not None:
        best_d = {"commit": best.commit, "val_bpb": best.val_bpb, "mfu": _clean(best.mfu),
                  "knobs": dict(best.knobs or {}), "time_budget": _clean(best.time_budget), "seed": best.seed,
                  "tag": best.tag, "description": best.description,
                  "command": reproduce_command(best, specs(best) if specs else None)}
    return {"tags": list(tags), "counts": counts, "best": best_d, "top": [experiments[i] for i in ranked],
            "per_knob": per_knob(rows), "validation": validation(rows), "experiments": experiments}


def sections(report: dict) -> list[Section]:
    """The report as titled tables of strings, in the order the CLI prints them."""
    out = []
    n = len(report["experiments"])
    counts = ", ".join(f"{v} {k}" for k, v in sorted(report["counts"].items(), key=lambda kv: -kv[1]))
    top = [(str(e["index"]), e["commit"][:7], _f(e["val_bpb"], 6), _f(e["mfu"], 1, "%"), _tokens(e),
            _f(e["num_steps"], 0), _f(e["time_budget"], 0, "s"), e["status"], e["description"])
           for e in report["top"]]
    out.append(Section(f"top {len(top)} of {n} experiments ({counts}) — {', '.join(report['tags'])}",
                       ("#", "commit", "val_bpb", "MFU", "tokens", "steps", "budget", "status", "description"), top))
    best = report["best"]
    if best:
        shown = [k for k in best["knobs"] if k in report["per_knob"]] or list(best["knobs"])
        rows = [(k, _value(best["knobs"][k])) for k in shown]
        if len(shown) < len(best["knobs"]):
            rows.append(("other knobs", f"{len(best['knobs']) - len(shown)} more, as committed in {best['commit'][:7]} "
                                        "(--json lists them)"))
        rows += [(k, v) for k, v in (("TIME_BUDGET", _f(best["time_budget"], 0, "s")), ("seed", _f(best["seed"], 0)))
                 if v != "-"]
        rows.append(("reproduce", best["command"]))
        out.append(Section(f"best: {best['commit'][:7]}  val_bpb {best['val_bpb']:.6f}", ("knob", "value"), rows))
    for knob, entries in report["per_knob"].items():
        out.append(Section(f"per-knob: {knob}", ("value", "best val_bpb", "runs", "commit"),
                           [(_value(e["value"]), _f(e["best_val_bpb"], 6), str(e["runs"]), (e["commit"] or "-")[:7])
                            for e in entries]))
    if report["validation"]:
        out.append(Section("validation re-runs (mean ± spread over seeds)", ("commit", "val_bpb", "n", "verdict"),
                           [(v["commit"][:7], f"{v['mean']:.6f} ± {v['spread']:.6f}", str(v["n"]), v["verdict"])
                            for v in report["validation"]]))
    return out


# ---------------------------------------------------------------- plot

def plot(rows: Sequence, path: str | Path, title: str = "") -> Path:
    """Progress plot in upstream's style: val_bpb per experiment in order, discarded runs faint, kept runs
    marked, the running best (over kept runs) as a step line. Written as PNG with the Agg backend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs_d, ys_d, xs_k, ys_k, labels = [], [], [], [], []
    for i, r in enumerate(rows, 1):
        if r.val_bpb is None or not math.isfinite(r.val_bpb) or status_of(r) in ("crash", "pruned", "rejected"):
            continue
        if status_of(r) == "keep":
            xs_k.append(i), ys_k.append(r.val_bpb), labels.append(r.description)
        else:
            xs_d.append(i), ys_d.append(r.val_bpb)
    fig, ax = plt.subplots(figsize=(12, 5), dpi=100)
    ax.scatter(xs_d, ys_d, s=10, color="#bbbbbb", alpha=0.5, label="discarded", zorder=1)
    ax.scatter(xs_k, ys_k, s=36, color="#2ca02c", edgecolors="black", linewidths=0.5, label="kept", zorder=3)
    if xs_k:
        best, run = math.inf, []
        for y in ys_k:
            best = min(best, y)
            run.append(best)
        ax.step(xs_k + [len(rows)], run + [run[-1]], where="post", color="#2ca02c", lw=1.5,
                label="running best", zorder=2)
        if len(xs_k) <= 30:
            for x, y, t in zip(xs_k, ys_k, labels):
                ax.annotate(t[:40], (x, y), fontsize=6, rotation=30, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("experiment #")
    ax.set_ylabel("val_bpb (lower is better)")
    ax.set_title(title or f"{len(rows)} experiments, {len(xs_k)} kept")
    ax.grid(alpha=0.3)
    if xs_d or xs_k:
        ax.legend(loc="upper right")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


# ---------------------------------------------------------------- helpers

def _best_finished(rows: Sequence):
    done = [r for r in rows if r.val_bpb is not None and status_of(r) in FINISHED_STATUSES]
    return min(done, key=lambda r: r.val_bpb) if done else None


def _hashable(v):
    if isinstance(v, (list, dict)):
        return str(v)
    return v


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return getattr(v, "value", v)


def _f(v, digits: int, unit: str = "") -> str:
    if v is None:
        return "-"
    return f"{v:.{digits}f}{unit}"


def _value(v) -> str:
    return show_value(v)


def _tokens(e: dict) -> str:
    if e.get("total_tokens_M") is not None:
        return f"{e['total_tokens_M']:.1f}M"
    return "-"
