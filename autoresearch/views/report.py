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
import re
import shlex
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from autoresearch.proposers import cost
from autoresearch.views import gpu_use
from autoresearch.records import tags as tags_mod
from autoresearch.errors import ArError, ConfigError
from autoresearch import objective
from autoresearch.records.layout import RunsLayout
from autoresearch.objective import DEFAULT, VAL_BPB, Objective
from autoresearch.records.rows import (FINISHED_STATUSES, norm_knobs, point_label, seed_stats, show_number, show_value,
                       status_of, verdicts)

CANDIDATES = frozenset({"keep", "discard"})  # rows the top table ranks
_TIMES = ("training_seconds", "total_seconds", "num_steps", "tokens_per_s", "total_tokens_M", "started_at",
          "finished_at")                       # what the best's run took, in --json's `best`
KEPT = frozenset({"keep"})  # a run's best: what the branch holds, as `ar run`, `ar status` and the journal say
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
    return tags_mod.newest(Path(repo))


def load(repo: str | Path, tag: str | None = None, all_tags: bool = False,
         warn=None) -> tuple[list[str], list, "tags_mod.Choice | None"]:
    """(tags, rows, how the tag was chosen: tags.py's rule; None with --all). Nothing to report (no runs/, no such
    tag, no row yet) is an ArError saying how to get results. A corrupt line of results.tsv is named through `warn`
    and skipped, as `ar run` and `ar status` do."""
    from autoresearch.records.ledger import read_results

    runs = RunsLayout(Path(repo)).runs
    if tag and all_tags:
        raise ConfigError("--tag and --all exclude each other; pass one")
    choice = None
    if not tag and not find_tags(repo):
        tags = []
    elif all_tags:
        tags = tags_mod.oldest_first(Path(repo), find_tags(repo))   # experiments in the order they ran
    else:
        choice = tags_mod.for_reading(Path(repo), tag)
        tags = [choice.tag]
    if not tags:
        raise ArError(f"no results yet: no {runs}/<tag>/results.tsv; run `ar run` (or `ar sweep FILE`) in this "
                      "repository first")
    rows = []
    for t in tags:
        path = RunsLayout(Path(repo)).tag(t).results
        if not path.is_file():
            others = find_tags(repo)
            ruled = choice is not None and choice.why != "--tag"
            raise ArError(f"no results for tag {t!r}{f' ({choice.why})' if ruled else ''}: {path} does not exist; "
                          + (f"tags with results: {', '.join(others)}{' (--tag NAME)' if ruled else ''}" if others else
                             "run `ar run` (or `ar sweep FILE`) first"))
        for r in read_results(path, warn=warn or (lambda msg: None)):
            r.tag = r.tag or t  # upstream's rows have no tag column
            rows.append(r)
    if not rows:
        raise ArError(f"no results yet in {', '.join(str(runs / t / 'results.tsv') for t in tags)}: a row is "
                      "written when an experiment finishes (`ar status` shows the one running)")
    return tags, rows, choice


# ---------------------------------------------------------------- pure summaries

def experiment(row, index: int) -> dict:
    d = {f: getattr(row, f, None) for f in _FIELDS}
    d["status"] = status_of(row)
    d["knobs"] = dict(row.knobs or {})
    d["sweep"] = dict(getattr(row, "sweep", None) or {})
    d["index"] = index
    return {k: _clean(v) for k, v in d.items()}


_EVIDENCE = re.compile(r"(?:kept|discarded): (\S+ \S+ over \d+ runs? .*)")   # a sequential decision's reason


def window_note(e: dict) -> str | None:
    """What ar's clock said of a run whose training window was shorter than its budget (from its reason)."""
    import re
    m = re.search(r"[^;(]*training window was[^;)]*", e.get("reason") or "")
    return m.group(0).strip() if m else None


def gpu_use_of(repo: str | Path, tags: Sequence[str]) -> dict[str, list[dict]]:
    """Per tag with GPU runs, how busy each GPU was between its training windows (views/gpu_use.py)."""
    out = {}
    for t in tags:
        used = gpu_use.summarize(gpu_use.load(RunsLayout(Path(repo)).tag(t).dir))
        if used:
            out[t] = used
    return out


def journals(repo: str | Path, tags: Sequence[str]) -> dict[str, str]:
    """tag -> its research journal (runs/<tag>/journal.md, written by `ar run` and `ar journal`), where it exists."""
    runs = RunsLayout(Path(repo))
    return {t: str(runs.tag(t).journal) for t in tags if runs.tag(t).journal.exists()}


def best_row(rows: Sequence, objective: Objective = DEFAULT, statuses: frozenset = CANDIDATES):
    cands = [r for r in rows if status_of(r) in statuses and r.val_bpb is not None and math.isfinite(r.val_bpb)]
    return min(cands, key=lambda r: objective.loss(r.val_bpb)) if cands else None


def objective_of(repo: str | Path, tags: Sequence[str]) -> Objective:
    """What the tags were measured by (their meta.json); tags of different objectives do not mix."""
    runs = RunsLayout(Path(repo))
    loaded = [objective.load(runs.tag(t).dir) for t in tags]
    found = {tuple(o.describe()[k] for k in ("name", "unit", "direction")): o for o in loaded}
    if len(found) > 1:
        names = ", ".join(sorted(o.name for o in found.values()))
        raise ArError(f"the tags were measured by different objectives ({names}); report one with --tag")
    return loaded[0] if loaded else DEFAULT


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


def per_knob(rows: Sequence, objective: Objective = DEFAULT) -> dict[str, list[dict]]:
    """For each knob that takes two or more values (a sweep axis, TIME_BUDGET included): the best val_bpb,
    the number of runs and the best commit per value."""
    values: dict[str, dict[Any, list]] = {}
    for r in rows:
        items = list((r.knobs or {}).items())
        if r.time_budget is not None:
            tb = float(r.time_budget)
            items.append(("TIME_BUDGET", int(tb) if tb.is_integer() else tb))
        for k, v in items:
            values.setdefault(k, {}).setdefault(hashable(v), []).append(r)
    out = {}
    for k, groups in values.items():
        if len(groups) < 2:
            continue
        entries = []
        for v, rs in groups.items():
            b = best_row(rs, objective) or _best_finished(rs)
            entries.append({"value": v, "runs": len(rs), "best_val_bpb": None if b is None else b.val_bpb,
                            "commit": None if b is None else b.commit})
        entries.sort(key=lambda e: (e["best_val_bpb"] is None, objective.loss(e["best_val_bpb"] or 0.0)))
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
            key = (ident.get("name"), ident.get("base"), norm_knobs(ident["axes"]))
            idents.setdefault(key, ident)
            members.setdefault(key, []).append(r)
            if status_of(r) != "validation":
                by_commit.setdefault(r.commit, key)
        elif status_of(r) == "validation" and r.commit in by_commit:
            members[by_commit[r.commit]].append(r)
    values_on: dict[tuple[Any, str], set] = {}  # (sweep, axis) -> the values seen on it
    for ident in idents.values():
        for k, v in ident["axes"].items():
            values_on.setdefault((ident.get("name"), k), set()).add(norm_knobs({k: v}))
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


def build(rows: Sequence, tags: Sequence[str] = (), top: int = 10, specs: Callable[[Any], dict] | None = None,
          objective: Objective = DEFAULT) -> dict:
    """Everything `ar report` shows, as one JSON-ready dict. `specs(row)` gives the run's spec.json, for the
    best row's exact command (see `run_spec`). Sweep rows go into `points` instead of `top`, `per_knob` and
    `validation`, which rank a run's experiments."""
    experiments = [experiment(r, i) for i, r in enumerate(rows, 1)]
    points = sweep_points(rows)
    in_sweep = _in_sweep(rows, points)
    race = [i for i in range(len(rows)) if i not in in_sweep]
    race_rows = [rows[i] for i in race]
    # a discard may score lower (a gain inside the noise), but it is not on the branch: never the best
    best, best_point = best_row(race_rows, objective, KEPT), None
    if best is None and points and points[0]["mean"] is not None:  # a sweep: the best point, its best seed
        best_point = points[0]
        best = _best_finished([r for i, r in enumerate(rows) if i in in_sweep and r.commit in best_point["commits"]])
    ranked = sorted((i for i in race if status_of(rows[i]) in CANDIDATES and rows[i].val_bpb is not None),
                    key=lambda i: objective.loss(rows[i].val_bpb))[:max(0, top)]
    best_d = None
    if best is not None:
        best_d = {"commit": best.commit, "val_bpb": best.val_bpb, "mfu": _clean(best.mfu),
                  "knobs": dict(best.knobs or {}), "time_budget": _clean(best.time_budget), "seed": best.seed,
                  "exp_id": best.exp_id, **{k: _clean(getattr(best, k, None)) for k in _TIMES},
                  "tag": best.tag, "description": best.description,
                  "command": (reproduce_command(best, specs(best) if specs else None) if objective.name == VAL_BPB
                              else f"git checkout {shlex.quote(best.commit)}")}
        if best_point is not None:
            best_d["point"] = {k: best_point[k] for k in ("sweep", "label", "axes", "mean", "spread", "n")}
    out = {"tags": list(tags), "objective": objective.describe(), "counts": _counts(rows),
           "run_counts": _counts(race_rows), "best": best_d,
           "top": [experiments[i] for i in ranked], "per_knob": per_knob(race_rows, objective),
           "validation": validation(race_rows), "points": points, "experiments": experiments}
    return _with_agent_cost(out, rows)


def _with_agent_cost(report: dict, rows: Sequence) -> dict:
    """The agents' total cost and tokens and the cost per kept improvement, and each experiment's own, under
    `agent_cost`; a report with no cost anywhere stays as it was."""
    spent = cost.summary(rows)
    if spent is None:
        return report
    for e, r in zip(report["experiments"], rows):   # `top` holds the same dicts
        e["agent_tokens"], e["agent_usd"] = getattr(r, "agent_tokens", None), getattr(r, "agent_usd", None)
    return {**report, "agent_cost": spent}


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
    obj = report.get("objective") or DEFAULT.describe()
    metric = obj["name"] + (f" ({obj['unit']}, {'lower' if obj['direction'] == 'min' else 'higher'} is better)"
                            if obj["name"] != VAL_BPB else "")
    several = len(report["tags"]) > 1          # --all: experiment numbers repeat across tags, the tag tells them
    top = [(_number(e), *((e["tag"] or "-",) if several else ()), e["commit"][:7], _f(e["val_bpb"], 6),
            _f(e["mfu"], 1, "%"), _tokens(e), _f(e["num_steps"], 0), _f(e["training_seconds"], 1, "s"),
            _f(e["time_budget"], 0, "s"), e["status"], e["description"])
           for e in report["top"]]
    if n or not report["points"]:
        out.append(Section(f"top {len(top)} of {n} experiments ({counts}) — {', '.join(report['tags'])}",
                           ("#", *(("tag",) if several else ()), "commit", metric, "MFU", "tokens", "steps",
                            "trained", "budget", "status", "description"), top))
    several_runs = [(_number(e), e["commit"][:7], e["status"], m.group(1)[:220]) for e in report["experiments"]
                    if (m := _EVIDENCE.search(e.get("reason") or ""))]
    if several_runs:       # experiment/measure.py: each decision's runs and evidence, as its row gives them
        out.append(Section("keep decisions on the evidence of several runs (runs/<tag>/<exp>/decision.json)",
                           ("#", "commit", "status", "evidence"), several_runs))
    short = [(_number(e), e["commit"][:7], note) for e in report["experiments"] if (note := window_note(e))]
    if short:
        out.append(Section("training windows shorter than the budget", ("#", "commit", "why"), short))
    spent = report.get("agent_cost")
    if spent:
        out.append(Section(f"agent cost — {', '.join(report['tags'])}",
                           ("USD", "tokens in+out", "proposals with a cost", "kept improvements", "USD per keep"),
                           [(_f(spent["usd"], 4, prefix="$"), f"{spent['tokens']:,}", str(spent["experiments"]),
                             str(spent["keeps"]), _f(spent["usd_per_keep"], 4, prefix="$"))]))
    for t, used in (report.get("gpu_use") or {}).items():
        out.append(Section(f"GPU use between training windows — {t}",
                           ("GPU", "windows", "busy", "median gap", "of it, the next run late", "advice"),
                           [(u["gpu"] or "-", str(u["windows"]), _f(u["busy"] and 100 * u["busy"], 1, "%"),
                             _f(u["median_gap"], 1, "s"), _f(u["median_late"], 1, "s"), u["advice"] or "-")
                            for u in used]))
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
        rows += [(k, v) for k, v in (("TIME_BUDGET", axis_value("TIME_BUDGET", best["time_budget"])),
                                     ("seed", _f(best["seed"], 0))) if v != "-"]
        rows.append(("reproduce", best["command"]))
        title = f"best: {best['commit'][:7]}  {obj['name']} {best['val_bpb']:.6f}{' ' + obj['unit'] if obj['name'] != VAL_BPB else ''}"
        if point:
            spread = f" ± {point['spread']:.6f}" if point["spread"] is not None else ""
            title = (f"best point: {point['label']}  val_bpb {point['mean']:.6f}{spread} over {point['n']} seed(s); "
                     f"its best run {best['commit'][:7]} ({best['val_bpb']:.6f})")
        out.append(Section(title, ("knob", "value"), rows))
    for knob, entries in report["per_knob"].items():
        out.append(Section(f"per-knob: {knob}", ("value", f"best {obj['name']}", "runs", "commit"),
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
        rows = [(str(i), *(axis_value(a, p["axes"].get(a)) for a in axes), _f(p["mean"], 6), _f(p["spread"], 6),
                 str(p["n"]), p["state"], ",".join(c[:7] for c in p["commits"]) or "-")
                for i, p in enumerate(mine, 1)]
        out.append(Section(f"sweep {name}: {len(mine)} points ({summary}) — {', '.join(tags)}",
                           ("#", *(axis_name(a) for a in axes), "val_bpb (mean)", "± (sd)", "seeds", "state",
                            "commit"), rows))
    return out


def axis_name(axis: str) -> str:
    return "budget" if axis == "TIME_BUDGET" else axis


def axis_value(axis: str, v) -> str:
    if v is None:
        return "-"
    return f"{show_number(float(v))}s" if axis == "TIME_BUDGET" else show_value(v)


# ---------------------------------------------------------------- helpers

def _best_finished(rows: Sequence):
    done = [r for r in rows if r.val_bpb is not None and status_of(r) in FINISHED_STATUSES]
    return min(done, key=lambda r: r.val_bpb) if done else None


def hashable(v):
    if isinstance(v, (list, dict)):
        return str(v)
    return v


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return getattr(v, "value", v)


def _f(v, digits: int, unit: str = "", prefix: str = "") -> str:
    if v is None:
        return "-"
    return f"{prefix}{v:.{digits}f}{unit}"


def _value(v) -> str:
    return show_value(v)


def _number(e: dict) -> str:
    """An experiment's number: its exp_id (what its folder, ref and `ar run`'s lines call it); upstream's rows,
    which have none, by their place in the file."""
    return str(e["exp_id"] if e.get("exp_id") is not None else e["index"])


def _tokens(e: dict) -> str:
    m = e.get("total_tokens_M")
    if m is not None:   # a CPU run reads tens of thousands of tokens: 0.0M would say nothing
        return f"{m:.1f}M" if m >= 0.1 else f"{m * 1000:.1f}K"
    return "-"
