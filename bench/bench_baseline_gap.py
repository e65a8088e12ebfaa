"""The time between the baseline's window and the next one, with two slots taking turns on one GPU.

    python bench/bench_baseline_gap.py [--budget 10] [--repeats 3] [--out FILE.json]

`ar init` workspace (the real train.py at the `cpu` profile, the builtin corpus), a stated noise threshold (no
calibration runs), `LocalExecutor([Slot(0, 0), Slot(1, 0)])`: two slots that take turns on "GPU 0" (on a machine
without one the turn is the same lock), and one knob edit queued beside the baseline. From the `timing.json` ar
writes: the baseline's evaluation (its process exit to its record), when the run beside it started its launcher
and its clock, and the gap between the baseline's last step line and the next run's first batch. Each repeat is a
fresh workspace and a fresh compile store. Run it once per version, each in its own venv (the evaluator and the
launcher are `python -I` subprocesses: they import the installed package, not PYTHONPATH's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def one(budget: float, cache: Path) -> dict:
    from autoresearch.config import RunConfig
    from autoresearch.executors.local import LocalExecutor
    from autoresearch.records.ledger import read_results
    from autoresearch.session.loop import Loop
    from autoresearch.slots import Slot
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ws"
        subprocess.run([sys.executable, "-m", "autoresearch", "init", str(root)], check=True, capture_output=True)
        cfg = RunConfig(profile="cpu", time_budget=budget, noise=0.002)
        with Loop(cfg, root, "gap", executor=LocalExecutor([Slot(0, 0), Slot(1, 0)])) as lp:
            lp.enqueue_knobs({"LR_MULT": 0.9})
            lp.run(max_experiments=2)
        rows = read_results(root / "runs" / "gap" / "results.tsv")
        t = [json.loads((root / "runs" / "gap" / f"{r.exp_id:04d}-{r.commit}" / "timing.json").read_text())
             for r in rows]
    base, nxt = t[0], t[1]
    return {"statuses": [r.status.value for r in rows],
            "baseline_eval": base["eval_done"] - base["process_exit"],
            "launcher_before_baseline_exit": base["process_exit"] - nxt["spawned"],
            "clock_after_baseline_exit": nxt["process_start"] - base["process_exit"],
            "gap": nxt["window_start"] - base["last_step"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    cache = Path(os.environ.setdefault("AR_CACHE", tempfile.mkdtemp(prefix="ar-gap-cache-")))
    runs = []
    for i in range(a.repeats):
        store = cache / "compile"
        subprocess.run(["rm", "-rf", str(store)], check=True)        # each repeat compiles from an empty store
        runs.append(one(a.budget, cache))
        print(json.dumps(runs[-1]), flush=True)
    keys = [k for k in runs[0] if k != "statuses"]
    med = {k: statistics.median(r[k] for r in runs) for k in keys}
    import autoresearch
    summary = {"package": str(Path(autoresearch.__file__).parent), "budget": a.budget, "runs": runs,
               "median": med}
    print("median: " + ", ".join(f"{k} {v:.2f} s" for k, v in med.items()))
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
