"""What a run or a sweep found: the best config, the top table, the per-knob summary, the plots, JSON.

Data in, dicts and rows out: `build` turns ledger rows into one plain dict (what `ar report --json`
prints); `sections` turns that dict into titled tables of strings for the CLI to print. Reads our
results.tsv and upstream's five-column one alike (through the ledger).

A run is a keep/discard race: its report ranks experiments and plots progress. A sweep is not: the Loop
still marks its rows keep or discard, but its report is about grid points (rows with a `sweep` identity):
one per point, its seeds pooled into a mean and a spread, and a grid plot of val_bpb against each axis.
"""

from __future__ import annotations

import math
import shlex
import statistics
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from .errors import ArError, ConfigError
from .layout import RESULTS, RunsLayout
from .sweep import seed_stats, verdicts
from .sweepfile import FINISHED_STATUSES, _norm_knobs, point_label, show_number, show_value, status_of

CANDIDATES = frozenset({"keep", "discard"})  # rows that may be "the best config"
_FIELDS = ("commit", "val_bpb", "memory_gb", "status", "description", "exp_id", "tag", "parent", "mfu",
           "tokens_per_s", "training_seconds", "total_seconds", "num_steps", "total_tokens_M", "time_budget",
           "seed", "knobs", "reason", "started_at", "finished_at", "sweep")


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
    d["sweep"] = dict(getattr(row, "sweep", None) or {})
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


def sweep_points(rows: Sequence) -> list[dict]:
    """One dict per grid point of the sweep rows, best mean first: its axes, the label (every axis that varies
    in its sweep, the budget included), val_bpb over its seeds (mean, sample spread, n), its commits and state.
    A validation re-run without an identity (an older ar's) joins the point whose commit it re-ran."""
    members: dict[tuple, list] = {}
    idents: dict[tuple, dict] = {}
    by_commit: dict[str, tuple] = {}
    for r in rows:
        ident = getattr(r, "sweep", None) or {}
        if isinstance(ident.get("axes"), dict):
            key = (ident.get("name"), ident.get("base"), _norm_knobs(ident["axes"]))
            idents.setdefault(key, ident)
            members.setdefault(key, []).append(r)
            if status_of(r) != "validation":
                by_commit.setdefault(r.commit, key)
        elif status_of(r) == "validation" and r.commit in by_commit:
            members[by_commit[r.commit]].append(r)
    values_on: dict[tuple[Any, str], set] = {}  # (sweep, axis) -> the values seen on it
    for ident in idents.values():
        for k, v in ident["axes"].items():
            values_on.setdefault((ident.get("name"), k), set()).add(_norm_knobs({k: v}))
    out = []
    for key, ident in idents.items():
        name, mine = ident.get("name"), members[key]
        by_seed = {r.seed: r.val_bpb for r in mine  # the latest run of each seed
                   if status_of(r) in FINISHED_STATUSES | {"validation"} and r.val_bpb is not None
                   and math.isfinite(r.val_bpb)}
        vals = list(by_seed.values())
        varying = [k for k in ident["axes"] if len(values_on[(name, k)]) > 1]
        out.append({"sweep": name, "base": ident.get("base"), "point": ident.get("point"),
                    "axes": dict(ident["axes"]), "label": point_label(ident["axes"], varying), "varying": varying,
                    "mean": statistics.fmean(vals) if vals else None,
                    "spread": statistics.stdev(vals) if len(vals) > 1 else None,
                    "n": len(vals), "seeds": list(by_seed), "values": vals,
                    "commits": list(dict.fromkeys(r.commit for r in mine if r.commit)),
                    "state": "done" if vals else status_of(mine[-1])})
    out.sort(key=lambda p: (p["mean"] is None, p["mean"] or 0.0))
    return out


def _in_sweep(rows: Sequence, points: Sequence[dict]) -> set[int]:
    """Indices of the rows that belong to a grid point (its runs and re-runs)."""
    commits = {c for p in points for c in p["commits"]}
    return {i for i, r in enumerate(rows) if getattr(r, "sweep", None) or (status_of(r) == "validation"
                                                                            and r.commit in commits)}


def build(rows: Sequence, tags: Sequence[str] = (), top: int = 10, specs: Callable[[Any], dict] | None = None) -> dict:
    """Everything `ar report` shows, as one JSON-ready dict. `specs(row)` gives the run's spec.json, for the
    best row's exact command (see `run_spec`). Sweep rows go into `points` instead of `top`, `per_knob` and
    `validation`, which rank a run's experiments."""
    experiments = [experiment(r, i) for i, r in enumerate(rows, 1)]
    points = sweep_points(rows)
    in_sweep = _in_sweep(rows, points)
    race = [i for i in range(len(rows)) if i not in in_sweep]
    race_rows = [rows[i] for i in race]
    best, best_point = best_row(race_rows), None
    if best is None and points and points[0]["mean"] is not None:  # a sweep: the best point, its best seed
        best_point = points[0]
        best = _best_finished([r for i, r in enumerate(rows) if i in in_sweep and r.commit in best_point["commits"]])
    ranked = sorted((i for i in race if status_of(rows[i]) in CANDIDATES and rows[i].val_bpb is not None),
                    key=lambda i: rows[i].val_bpb)[:max(0, top)]
    best_d = None
    if best is not None:
        best_d = {"commit": best.commit, "val_bpb": best.val_bpb, "mfu": _clean(best.mfu),
                  "knobs": dict(best.knobs or {}), "time_budget": _clean(best.time_budget), "seed": best.seed,
                  "tag": best.tag, "description": best.description,
                  "command": reproduce_command(best, specs(best) if specs else None)}
        if best_point is not None:
            best_d["point"] = {k: best_point[k] for k in ("sweep", "label", "axes", "mean", "spread", "n")}
    return {"tags": list(tags), "counts": _counts(rows), "run_counts": _counts(race_rows), "best": best_d,
            "top": [experiments[i] for i in ranked], "per_knob": per_knob(race_rows),
            "validation": validation(race_rows), "points": points, "experiments": experiments}


def _counts(rows: Sequence) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in rows:
        counts[status_of(r)] = counts.get(status_of(r), 0) + 1
    return counts


def sections(report: dict) -> list[Section]:
    """The report as titled tables of strings, in the order the CLI prints them."""
    out = []
    n = sum(report["run_counts"].values())
    counts = ", ".join(f"{v} {k}" for k, v in sorted(report["run_counts"].items(), key=lambda kv: -kv[1]))
    top = [(str(e["index"]), e["commit"][:7], _f(e["val_bpb"], 6), _f(e["mfu"], 1, "%"), _tokens(e),
            _f(e["num_steps"], 0), _f(e["time_budget"], 0, "s"), e["status"], e["description"])
           for e in report["top"]]
    if n or not report["points"]:
        out.append(Section(f"top {len(top)} of {n} experiments ({counts}) — {', '.join(report['tags'])}",
                           ("#", "commit", "val_bpb", "MFU", "tokens", "steps", "budget", "status", "description"),
                           top))
    out += points_sections(report["points"], report["tags"])
    best = report["best"]
    if best:
        point = best.get("point")
        axes = point["axes"] if point else report["per_knob"]
        shown = [k for k in best["knobs"] if k in axes] or list(best["knobs"])
        rows = [(k, _value(best["knobs"][k])) for k in shown]
        if len(shown) < len(best["knobs"]):
            rows.append(("other knobs", f"{len(best['knobs']) - len(shown)} more, as committed in {best['commit'][:7]} "
                                        "(--json lists them)"))
        rows += [(k, v) for k, v in (("TIME_BUDGET", _axis_value("TIME_BUDGET", best["time_budget"])),
                                     ("seed", _f(best["seed"], 0))) if v != "-"]
        rows.append(("reproduce", best["command"]))
        title = f"best: {best['commit'][:7]}  val_bpb {best['val_bpb']:.6f}"
        if point:
            spread = f" ± {point['spread']:.6f}" if point["spread"] is not None else ""
            title = (f"best point: {point['label']}  val_bpb {point['mean']:.6f}{spread} over {point['n']} seed(s); "
                     f"its best run {best['commit'][:7]} ({best['val_bpb']:.6f})")
        out.append(Section(title, ("knob", "value"), rows))
    for knob, entries in report["per_knob"].items():
        out.append(Section(f"per-knob: {knob}", ("value", "best val_bpb", "runs", "commit"),
                           [(_value(e["value"]), _f(e["best_val_bpb"], 6), str(e["runs"]), (e["commit"] or "-")[:7])
                            for e in entries]))
    if report["validation"]:
        out.append(Section("validation re-runs (mean ± spread over seeds)", ("commit", "val_bpb", "n", "verdict"),
                           [(v["commit"][:7], f"{v['mean']:.6f} ± {v['spread']:.6f}", str(v["n"]), v["verdict"])
                            for v in report["validation"]]))
    return out


def points_sections(points: Sequence[dict], tags: Sequence[str]) -> list[Section]:
    """One table per sweep: a row per grid point, best mean first, a column per axis that varies."""
    out = []
    for name in dict.fromkeys(p["sweep"] for p in points):
        mine = [p for p in points if p["sweep"] == name]
        axes = mine[0]["varying"] or list(mine[0]["axes"])
        states: dict[str, int] = {}
        for p in mine:
            states[p["state"]] = states.get(p["state"], 0) + 1
        summary = ", ".join(f"{v} {k}" for k, v in sorted(states.items(), key=lambda kv: -kv[1]))
        rows = [(str(i), *(_axis_value(a, p["axes"].get(a)) for a in axes), _f(p["mean"], 6), _f(p["spread"], 6),
                 str(p["n"]), p["state"], ",".join(c[:7] for c in p["commits"]) or "-")
                for i, p in enumerate(mine, 1)]
        out.append(Section(f"sweep {name}: {len(mine)} points ({summary}) — {', '.join(tags)}",
                           ("#", *(_axis_name(a) for a in axes), "val_bpb (mean)", "± (sd)", "seeds", "state",
                            "commit"), rows))
    return out


def _axis_name(axis: str) -> str:
    return "budget" if axis == "TIME_BUDGET" else axis


def _axis_value(axis: str, v) -> str:
    if v is None:
        return "-"
    return f"{show_number(float(v))}s" if axis == "TIME_BUDGET" else show_value(v)


# ---------------------------------------------------------------- plots

KEPT, DISCARDED, BEST = "#2ca02c", "#b0b0b0", "#1f5f1f"
MAX_LABELS = 30  # kept changes named on the progress plot; beyond that only the biggest steps down


def progress_figure(rows: Sequence, title: str = ""):
    """The progress plot as a matplotlib Figure (Agg): val_bpb per experiment in order on integer ticks, discarded
    runs faint, kept runs marked and named (wrapped, never past the plot's edge), the running best as a step line,
    the legend under the plot. Runs far above the kept ones sit on the top edge instead of squashing the scale."""
    plt, MaxNLocator = _pyplot()
    done = [(i, r) for i, r in enumerate(rows, 1) if r.val_bpb is not None and math.isfinite(r.val_bpb)
            and status_of(r) not in ("crash", "pruned", "rejected")]
    kept = [(i, r.val_bpb, r.description) for i, r in done if status_of(r) == "keep"]
    other = [(i, r.val_bpb) for i, r in done if status_of(r) != "keep"]
    fig, ax = plt.subplots(figsize=(12, 5.5), dpi=100)
    ceiling = None
    if kept:  # far worse than the bulk (exploded runs): above twice the bulk's height from the best
        values = sorted(v for _, v in other)
        bulk = max([v for _, v, _ in kept] + values[:max(1, int(0.9 * len(values)))])
        lo = min([v for _, v, _ in kept] + values)
        ceiling = bulk + max(bulk - lo, 0.01)
    shown = [(x, y) for x, y in other if ceiling is None or y <= ceiling]
    above = [x for x, y in other if ceiling is not None and y > ceiling]
    if shown:
        ax.scatter(*zip(*shown), s=14, color=DISCARDED, alpha=0.6, label="discarded", zorder=1)
    if above:
        ax.scatter(above, [ceiling] * len(above), s=18, marker="^", color=DISCARDED, alpha=0.6, clip_on=False,
                   label=f"discarded, above the scale ({len(above)})", zorder=1)
    if kept:
        xs, ys, texts = zip(*kept)
        running = [min(ys[:k + 1]) for k in range(len(ys))]
        ax.step(list(xs) + [len(rows)], running + [running[-1]], where="post", color=BEST, lw=2,
                label="running best", zorder=2)
        ax.scatter(xs, ys, s=46, color=KEPT, edgecolors="black", linewidths=0.6, label="kept", zorder=3)
        for x, y, text in _labelled(kept):
            ax.annotate(_short_label(text), (x, y), xytext=(3, 5), textcoords="offset points", fontsize=8,
                        rotation=30, rotation_mode="anchor", color="#333333", ha="left", va="bottom", zorder=4)
    ax.set_xlim(0.5, max(len(rows), 1) + 0.5)
    if above:
        bottom = min(y for _, y in shown + [(0, v) for _, v, _ in kept])
        ax.set_ylim(bottom - 0.05 * (ceiling - bottom), ceiling + 0.02 * (ceiling - bottom))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("experiment #")
    ax.set_ylabel("val_bpb (lower is better)")
    ax.set_title(title or f"{len(rows)} experiments, {len(kept)} kept")
    ax.grid(alpha=0.3)
    if done:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=4, frameon=False)
    _fit(fig, [ax])
    return fig


def _labelled(kept: Sequence[tuple]) -> list[tuple]:
    """The kept runs to name: all of them, or the first and the biggest steps down of the running best."""
    if len(kept) <= MAX_LABELS:
        return list(kept)
    gains = []
    best = math.inf
    for k, (x, y, t) in enumerate(kept):
        gains.append((math.inf if k == 0 else best - y, k))
        best = min(best, y)
    chosen = sorted(k for _, k in sorted(gains, reverse=True)[:MAX_LABELS])
    return [kept[k] for k in chosen]


def _short_label(text: str, width: int = 44) -> str:
    """A description on one line of at most `width` characters, cut at a word with an ellipsis: slanted
    one-line labels of neighbouring points stay apart where wrapped blocks would pile up."""
    return textwrap.shorten(" ".join(text.split()), width, placeholder="…")


def _fit(fig, axes) -> None:
    """Keep every label inside its Axes: a slanted label that would cross the right or top edge is turned to
    slant the other way from its point (up-left, down-right or down-left); then the layout makes room for the
    ticks, titles and the legend."""
    for ax in axes:
        for t in ax.texts:
            t.set_in_layout(False)  # the layout is for ticks, titles and legends; labels are kept inside below
    fig.tight_layout()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in axes:
        box = ax.get_window_extent(renderer)
        for t in ax.texts:
            bb = t.get_window_extent(renderer)
            left, down = bb.x1 > box.x1, bb.y1 > box.y1
            if not (left or down):
                continue
            dx, dy = t.xyann
            t.xyann = (-abs(dx) if left else abs(dx), -abs(dy) if down else abs(dy))
            t.set_ha("right" if left else "left")
            t.set_va("top" if down else "bottom")
            if t.get_rotation():
                t.set_rotation(30 if left == down else -30)


def plot(rows: Sequence, path: str | Path, title: str = "") -> Path:
    """The progress plot (`progress_figure`) written as PNG."""
    return _save(progress_figure(rows, title), path)


def grid_figure(points: Sequence[dict], title: str = ""):
    """The grid of a sweep as a matplotlib Figure: for each axis that varies, val_bpb (mean over seeds, the
    sample spread as error bars) against that axis, one line per value of the other varying axes; the best
    point starred. One row of panels per sweep. Points with no finished run (pruned, crashed) are left out."""
    plt, MaxNLocator = _pyplot()
    sweeps = list(dict.fromkeys(p["sweep"] for p in points))
    panels = {name: [a for a in next(p for p in points if p["sweep"] == name)["varying"]] or
              list(next(p for p in points if p["sweep"] == name)["axes"])[:1] for name in sweeps}
    ncols = max(len(v) for v in panels.values())
    fig, grid = plt.subplots(len(sweeps), ncols, figsize=(5.5 * ncols + 1, 4.2 * len(sweeps)), dpi=100,
                             squeeze=False)
    used = []
    for row, name in enumerate(sweeps):
        mine = [p for p in points if p["sweep"] == name and p["mean"] is not None]
        best = min(mine, key=lambda p: p["mean"]) if mine else None
        for col in range(ncols):
            ax = grid[row][col]
            if col >= len(panels[name]):
                ax.set_visible(False)
                continue
            used.append(ax)
            _grid_panel(ax, mine, panels[name][col], [a for a in panels[name] if a != panels[name][col]], best)
            ax.set_title(f"sweep {name}: val_bpb vs {_axis_name(panels[name][col])}", fontsize=10)
    if title:
        fig.suptitle(title)
    _fit(fig, used)
    return fig


def _grid_panel(ax, points: Sequence[dict], axis: str, others: Sequence[str], best) -> None:
    values = _ordered(p["axes"].get(axis) for p in points)
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    position = (lambda v: float(v)) if numeric else (lambda v: values.index(v))
    lines: dict[tuple, list[dict]] = {}
    for p in points:
        lines.setdefault(tuple(_hashable(p["axes"].get(a)) for a in others), []).append(p)
    for key in sorted(lines, key=lambda k: [(str(type(v)), v) for v in k]):
        pts = sorted(lines[key], key=lambda p: position(p["axes"].get(axis)))
        label = (_axis_value(others[0], key[0]) if len(others) == 1 else  # the legend's title names the axis
                 ", ".join(f"{_axis_name(a)}={_axis_value(a, v)}" for a, v in zip(others, key)) or None)
        ax.errorbar([position(p["axes"].get(axis)) for p in pts], [p["mean"] for p in pts],
                    yerr=[p["spread"] or 0.0 for p in pts], marker="o", ms=5, capsize=3, lw=1.5, label=label)
    if best is not None:
        ax.scatter([position(best["axes"].get(axis))], [best["mean"]], marker="*", s=220, color="gold",
                   edgecolors="black", linewidths=0.6, zorder=5, label="best point")
    if numeric and values and min(values) > 0 and max(values) / min(values) >= 8:
        ax.set_xscale("log", base=2)  # batch sizes, learning rates: the grid is geometric
    ticks = [position(v) for v in values]
    ax.set_xticks(ticks)
    ax.set_xticklabels([_axis_value(axis, v) for v in values])
    ax.minorticks_off()
    ax.set_xlabel(_axis_name(axis) + (" (seconds)" if axis == "TIME_BUDGET" else ""))
    ax.set_ylabel("val_bpb (mean over seeds; bars: sd)")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if labels:  # the lines in order, the best point last
        order = sorted(range(len(labels)), key=lambda i: labels[i] == "best point")
        ax.legend([handles[i] for i in order], [labels[i] for i in order], fontsize=8,
                  title=", ".join(map(_axis_name, others)) or None, title_fontsize=8)


def _ordered(values) -> list:
    """Distinct values, numbers ascending, anything else in first-seen order."""
    out = list(dict.fromkeys(_hashable(v) for v in values))
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in out):
        out.sort()
    return out


def grid_plot(points: Sequence[dict], path: str | Path, title: str = "") -> Path:
    """The grid plot (`grid_figure`) written as PNG."""
    return _save(grid_figure(points, title), path)


def write_plots(data: dict, rows: Sequence, repo: str | Path, path: str | Path | None,
                warn: Callable[[str], None] = lambda msg: None) -> dict[str, str]:
    """The plots of a report: the progress plot of a run's experiments, the grid plot of a sweep's points.
    `path` (--plot) takes the one there is (the progress plot when there are both; the grid then beside it as
    <stem>-grid.png). With no `path`, a sweep's grid plot still goes to runs/<tag>/grid.png of its one tag."""
    out: dict[str, str] = {}
    tags = data["tags"]
    race = sum(data["run_counts"].values()) > 0
    if path is not None and (race or not data["points"]):
        race_rows = [r for r in rows if not getattr(r, "sweep", None)
                     and not (status_of(r) == "validation" and any(r.commit in p["commits"] for p in data["points"]))]
        out["plot"] = str(plot(race_rows, path, title=f"{', '.join(tags)}: {len(race_rows)} experiments"))
    if data["points"]:
        if path is None and len(tags) != 1:
            return out
        where = (RunsLayout(Path(repo)).tag(tags[0]).dir / "grid.png" if path is None else
                 Path(path) if "plot" not in out else Path(path).with_name(Path(path).stem + "-grid.png"))
        try:
            out["grid_plot"] = str(grid_plot(data["points"], where, title=", ".join(tags)))
        except ArError as e:
            if path is not None:
                raise
            warn(str(e))  # a read-only runs/ still gets its report
    return out


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    return plt, MaxNLocator


def _save(fig, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png", bbox_inches="tight")  # nothing drawn is cut at the edge
    except OSError as e:
        raise ArError(f"cannot write the plot {path}: {e.strerror or e}; pass --plot with a writable path") from e
    finally:
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
