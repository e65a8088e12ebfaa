"""Where the time between training windows goes, from the `timing.json` ar writes for every experiment.

    python bench/loop_gaps.py RUNS_DIR/TAG [--json OUT]

Per experiment: workspace (prepare -> process start), start-up split at the model line (imports + build,
then compile + warm-up on random tokens up to the first batch of ar's feed, which opens the window), the
window ar gave it (first batch -> the feed's deadline) and its share of the budget, the start-up's CPU seconds,
the last step + save (deadline -> checkpoint), exit, evaluation (the evaluator's go -> its record), and the GPU
idle gap: the previous window's end (its last step line) to this window's start (its first batch). Medians at the end, and experiments per hour at a 300-s budget
computed from the median gap.
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path


def load(tag_dir: Path) -> list[dict]:
    rows = {}
    results = tag_dir / "results.tsv"
    if results.exists():
        with open(results) as f:
            for r in csv.DictReader(f, delimiter="\t"):
                rows[int(r["exp_id"])] = r
    out = []
    for t in sorted(tag_dir.glob("[0-9][0-9][0-9][0-9]-*/timing.json")):
        exp = int(t.parent.name[:4])
        d = json.loads(t.read_text())
        d["exp"], d["row"] = exp, rows.get(exp, {})
        m = t.parent / "metrics.json"
        d["metrics"] = json.loads(m.read_text()) if m.exists() else {}
        rec = t.parent / "record.json"
        record = json.loads(rec.read_text()) if rec.exists() else {}
        d["transfer"] = record.get("transfer")
        d["eval_after_go"] = (record.get("seconds") or {}).get("after_go")
        d["fresh_seconds"] = record.get("fresh_seconds")
        d["slow_steps"] = slow_steps(t.parent / "train.log")
        out.append(d)
    return out


def slow_steps(log: Path, factor: float = 1.3) -> tuple[int, float] | None:
    """(how many steps took over `factor` × the run's median step, the seconds they took beyond the median): what
    ran beside the window (the last run's evaluation, the next run's head start) cost it. None without steps."""
    from autoresearch.experiment.metrics import parse_step
    try:
        dts = [p.dt_ms / 1e3 for line in log.read_text(errors="replace").splitlines()
               if line.startswith("step ") and (p := parse_step(line)) is not None]
    except OSError:
        return None
    if not dts:
        return None
    med = statistics.median(dts)
    slow = [dt for dt in dts if dt > factor * med]
    return len(slow), sum(dt - med for dt in slow)


def span(d: dict, a: str, b: str) -> float | None:
    return d[b] - d[a] if d.get(a) is not None and d.get(b) is not None else None


def table(tag_dir: Path) -> dict:
    exps = load(tag_dir)
    by_window = sorted((d for d in exps if d.get("window_start")), key=lambda d: d["window_start"])
    prev = None
    for d in by_window:
        d["gap"] = d["window_start"] - prev["last_step"] if prev and prev.get("last_step") else None
        d["eval_overlaps_window"] = bool(prev and prev.get("eval_done") and prev["eval_done"] > d["window_start"])
        prev = d
    cols = [("workspace + wait", "prepare", "process_start"), ("pre-start", "spawned", "process_start"),
            ("to model", "process_start", "model_built"), ("compile + warm-up", "model_built", "window_start"),
            ("window", "window_start", "window_end"), ("last step + save", "window_end", "checkpoint"),
            ("exit", "checkpoint", "process_exit"), ("eval", "eval_start", "eval_done")]
    lines = ["| exp | status | trusted | seeded MB | " + " | ".join(c[0] for c in cols)
             + " | window % of budget | start-up CPU s | head start s | turn wait s | given back s (head start + "
             "eval) | slow steps (excess s) | tok/s | GPU idle gap |",
             "|" + " --- |" * (len(cols) + 12)]
    budget = lambda d: float(d["row"].get("time_budget") or 0) or None          # noqa: E731
    for d in exps:
        r = d["row"]
        cells = [span(d, a, b) for _, a, b in cols]
        w, cpu = d["metrics"].get("window_seconds"), d["metrics"].get("startup_cpu")
        share = f"{100 * w / budget(d):.2f}" if w is not None and budget(d) else "–"
        lines.append(f"| {d['exp']} | {r.get('status', '?')} | {'yes' if d.get('trusted_code') else 'no'} | "
                     f"{d.get('cache_seeded_bytes', 0) / 2**20:.0f} | "
                     + " | ".join("–" if c is None else f"{c:.1f}" for c in cells)
                     + f" | {share} | {'–' if cpu is None else f'{cpu:.1f}'}"
                     + "".join(f" | {'–' if d.get(k) is None else f'{d[k]:.1f}'}" for k in ("head_start", "turn_wait"))
                     + f" | {d.get('given_back_head_start') or 0:.1f} + {d.get('given_back_evaluations') or 0:.1f}"
                     + (f" | {d['slow_steps'][0]} ({d['slow_steps'][1]:.1f})" if d.get("slow_steps") else " | –")
                     + f" | {r.get('tokens_per_s') or '–'} | "
                     + ("–" if d.get("gap") is None else f"{d['gap']:.1f}" + (" (eval overlapped)" if d.get(
                         "eval_overlaps_window") else "")) + " |")
    gaps = [d["gap"] for d in by_window if d.get("gap") is not None]
    summary = {"experiments": len(exps), "gaps": gaps,
               "median_gap": statistics.median(gaps) if gaps else None,
               "phase_medians": {c[0]: statistics.median(v) for c in cols
                                 if (v := [x for d in exps[1:] if (x := span(d, c[1], c[2])) is not None])},
               "tokens_per_s": [float(d["row"]["tokens_per_s"]) for d in exps if d["row"].get("tokens_per_s")],
               "eval_overlaps": sum(d.get("eval_overlaps_window", False) for d in by_window),
               "window_share": [d["metrics"]["window_seconds"] / budget(d) for d in exps
                                if d["metrics"].get("window_seconds") is not None and budget(d)],
               "startup_cpu": [d["metrics"].get("startup_cpu") for d in exps],
               # a head start (experiment/headstart.py): "go" this long before the other window's end, then the
               # first batch waited this long for the turn; the GPU memory (free, total, the other run's) then
               "head_start": [d.get("head_start") for d in exps], "turn_wait": [d.get("turn_wait") for d in exps],
               "memory_seen": [d.get("memory_seen") for d in exps],
               "window_extended": [d.get("window_extended") for d in exps],   # given back beside a head start
               "given_back": [(d.get("given_back_head_start"), d.get("given_back_evaluations")) for d in exps],
               "slow_steps": [d.get("slow_steps") for d in exps],      # what ran beside each window cost it
               "transfer": [d.get("transfer") for d in exps],
               "eval_after_go": [d.get("eval_after_go") for d in exps],
               "fresh_seconds": [d.get("fresh_seconds") for d in exps],
               # the finish (experiment/clock.py): the window's end -> the checkpoint, what the run trained of its
               # budget (train.py does not start a step that would end past the window), the baseline's finish
               "tails": [span(d, "window_end", "checkpoint") for d in exps],
               "trained_share": [float(d["row"]["training_seconds"]) / budget(d) for d in exps
                                 if d["row"].get("training_seconds") and budget(d)],
               "clock": json.loads((tag_dir / "clock.json").read_text()) if (tag_dir / "clock.json").exists()
               else None}
    if summary["median_gap"] is not None:
        summary["experiments_per_hour_at_300s"] = 3600 / (300 + summary["median_gap"])
    lines.append("")
    lines.append(f"median GPU idle gap {summary['median_gap'] and round(summary['median_gap'], 1)} s over "
                 f"{len(gaps)} gaps; experiments/hour at a 300-s budget: "
                 f"{summary.get('experiments_per_hour_at_300s', 0):.2f}; phase medians (after the first): "
                 + ", ".join(f"{k} {v:.1f}" for k, v in summary["phase_medians"].items()))
    if summary["window_share"]:
        lines.append(f"windows: {min(summary['window_share']):.2%} to {max(summary['window_share']):.2%} of the "
                     f"budget; evaluator transfer: {', '.join(str(t) for t in summary['transfer'])}; evaluator "
                     f"seconds after go: {summary['eval_after_go']} (of which the fresh re-score "
                     f"{summary['fresh_seconds']})")
    tails = [t for t in summary["tails"] if t is not None]
    if tails and summary["trained_share"]:
        lines.append(f"window's end -> checkpoint: {min(tails):.2f} to {max(tails):.2f} s (median "
                     f"{statistics.median(tails):.2f}); trained {min(summary['trained_share']):.2%} to "
                     f"{max(summary['trained_share']):.2%} of the budget; clock.json {summary['clock']}")
    try:                                  # what `ar report` says of the same runs (views/gpu_use.py)
        from autoresearch.views import gpu_use
        summary["gpu_use"] = gpu_use.summarize(gpu_use.load(tag_dir))
        for u in summary["gpu_use"]:
            lines.append(f"ar report: GPU {u['gpu'] or '-'} busy {u['busy']:.1%} over {u['windows']} windows, gaps "
                         f"{u['gaps']}, of which the next run late (median) {u['median_late']}; "
                         f"advice: {u['advice']}")
    except ImportError:
        pass
    summary["table"] = "\n".join(lines)
    return summary


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("tag_dir", type=Path)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    s = table(a.tag_dir)
    print(s["table"])
    if a.json:
        a.json.write_text(json.dumps(s, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
