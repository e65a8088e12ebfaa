"""The plots of `ar report`: the progress plot of a run (val_bpb per experiment, kept changes named, the
running best) and the grid plot of a sweep (val_bpb against each axis, seed spread as error bars). matplotlib
with the Agg backend, imported only when a plot is drawn."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Callable, Sequence

from autoresearch.errors import ArError
from autoresearch.records.layout import GRID, RunsLayout
from autoresearch.records.rows import status_of
from autoresearch.views.report import axis_name, axis_value, hashable

KEPT, DISCARDED, BEST = "#2ca02c", "#b0b0b0", "#1f5f1f"
MAX_LABELS = 30  # kept changes named on the progress plot; beyond that only the biggest steps down


def progress_figure(rows: Sequence, title: str = "", objective: dict | None = None, noise: float | None = None):
    """The progress plot as a matplotlib Figure (Agg): val_bpb per experiment in order on integer ticks, discarded
    runs faint, kept runs marked and named (wrapped, never past the plot's edge), the running best as a step line,
    the legend under the plot; re-runs of a commit with other seeds hollow. Runs far above the kept ones sit on the
    top edge instead of squashing the scale."""
    plt, MaxNLocator = _pyplot()
    obj = objective or {"name": "val_bpb", "unit": "", "direction": "min"}
    lower = obj["direction"] != "max"
    done = [(i, r) for i, r in enumerate(rows, 1) if r.val_bpb is not None and math.isfinite(r.val_bpb)
            and status_of(r) not in ("crash", "pruned", "rejected")]
    kept = [(i, r.val_bpb, r.description) for i, r in done if status_of(r) == "keep"]
    other = [(i, r.val_bpb) for i, r in done if status_of(r) not in ("keep", "validation")]
    reruns = [(i, r.val_bpb) for i, r in done if status_of(r) == "validation"]   # seeds of a commit, not proposals
    fig, ax = plt.subplots(figsize=(12, 5.5), dpi=100)
    ceiling = None
    if kept and lower:  # far worse than the bulk (exploded runs): above twice the bulk's height from the best
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
    if reruns:
        ax.scatter(*zip(*reruns), s=24, facecolors="none", edgecolors="#5b7fa6", linewidths=0.9,
                   label="re-run of a commit (another seed, noise calibration)", zorder=2)
    if kept:
        xs, ys, texts = zip(*kept)
        running = [(min if lower else max)(ys[:k + 1]) for k in range(len(ys))]
        ax.step(list(xs) + [len(rows)], running + [running[-1]], where="post", color=BEST, lw=2,
                label="running best", zorder=2)
        if noise:   # a win must clear the band: a discard inside it beat the best by less than the noise
            edge = [v - noise if lower else v + noise for v in running]
            ax.fill_between(list(xs) + [len(rows)], running + [running[-1]], edge + [edge[-1]], step="post",
                            color=BEST, alpha=0.12, lw=0, label=f"noise threshold ({noise:g}): a win clears it",
                            zorder=1)
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
    unit = f"{obj['unit']}, " if obj.get("unit") and obj["name"] != "val_bpb" else ""
    ax.set_ylabel(f"{obj['name']} ({unit}{'lower' if lower else 'higher'} is better)")
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


def plot(rows: Sequence, path: str | Path, title: str = "", objective: dict | None = None,
         noise: float | None = None) -> Path:
    """The progress plot (`progress_figure`) written as PNG."""
    return _save(progress_figure(rows, title, objective, noise), path)


def tag_noise(repo: str | Path, tags: Sequence[str]) -> float | None:
    """The calibrated keep threshold of one tag (its noise.json), for the band of the progress plot."""
    import json
    if len(tags) != 1:
        return None
    try:
        return float(json.loads(RunsLayout(Path(repo)).tag(tags[0]).noise.read_text())["noise"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


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
            ax.set_title(f"sweep {name}: val_bpb vs {axis_name(panels[name][col])}", fontsize=10)
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
        lines.setdefault(tuple(hashable(p["axes"].get(a)) for a in others), []).append(p)
    for key in sorted(lines, key=lambda k: [(str(type(v)), v) for v in k]):
        pts = sorted(lines[key], key=lambda p: position(p["axes"].get(axis)))
        label = (axis_value(others[0], key[0]) if len(others) == 1 else  # the legend's title names the axis
                 ", ".join(f"{axis_name(a)}={axis_value(a, v)}" for a, v in zip(others, key)) or None)
        ax.errorbar([position(p["axes"].get(axis)) for p in pts], [p["mean"] for p in pts],
                    yerr=[p["spread"] or 0.0 for p in pts], marker="o", ms=5, capsize=3, lw=1.5, label=label)
    if best is not None:
        ax.scatter([position(best["axes"].get(axis))], [best["mean"]], marker="*", s=220, color="gold",
                   edgecolors="black", linewidths=0.6, zorder=5, label="best point")
    if numeric and values and min(values) > 0 and max(values) / min(values) >= 8:
        ax.set_xscale("log", base=2)  # batch sizes, learning rates: the grid is geometric
    ticks = [position(v) for v in values]
    ax.set_xticks(ticks)
    ax.set_xticklabels([axis_value(axis, v) for v in values])
    ax.minorticks_off()
    ax.set_xlabel(axis_name(axis) + (" (seconds)" if axis == "TIME_BUDGET" else ""))
    ax.set_ylabel("val_bpb (mean over seeds; bars: sd)")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if labels:  # the lines in order, the best point last
        order = sorted(range(len(labels)), key=lambda i: labels[i] == "best point")
        ax.legend([handles[i] for i in order], [labels[i] for i in order], fontsize=8,
                  title=", ".join(map(axis_name, others)) or None, title_fontsize=8)


def _ordered(values) -> list:
    """Distinct values, numbers ascending, anything else in first-seen order."""
    out = list(dict.fromkeys(hashable(v) for v in values))
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
        out["plot"] = str(plot(race_rows, path, title=f"{', '.join(tags)}: {len(race_rows)} experiments",
                               objective=data.get("objective"), noise=tag_noise(repo, tags)))
    if data["points"]:
        if path is None and len(tags) != 1:
            return out
        where = (RunsLayout(Path(repo)).tag(tags[0]).dir / GRID if path is None else
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
