"""Benchmark: `ar report` over 10,000 synthetic results (target: < 1 s). Not a test.

Writes a sweep-like results.tsv (knobs, budgets, every status) into a temp repo, then times the command
through its real entry point, in-process (the command's own work: read, summarise, print), for the table,
--json and --plot; the median of several runs each. Also shows one cold `ar report` subprocess for
reference (interpreter start and imports included).

    python bench/bench_report.py [--rows 10000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import csv
import io
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import redirect_stdout
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoresearch.records.ledger import COLUMNS, Row, Status  # noqa: E402


def write_results(path: Path, n: int, seed: int = 0) -> None:
    rnd = random.Random(seed)
    statuses = [Status.DISCARD] * 70 + [Status.KEEP] * 5 + [Status.CRASH] * 10 + [Status.PRUNED] * 10 + \
               [Status.TIMEOUT] * 3 + [Status.VALIDATION] * 2
    best = 1.2
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f, dialect="excel-tab", lineterminator="\n")
        w.writerow(COLUMNS)
        for i in range(1, n + 1):
            status = rnd.choice(statuses)
            budget = rnd.choice([300.0, 600.0, 1200.0])
            val = None
            if status in (Status.KEEP, Status.DISCARD, Status.VALIDATION):
                val = best - 0.001 if status is Status.KEEP else best + rnd.random() * 0.05
                best = min(best, val)
            knobs = {"TOTAL_BATCH_SIZE": 2 ** rnd.randint(16, 19), "LR_MULT": rnd.choice([0.5, 1.0, 2.0]),
                     "DEPTH": rnd.choice([6, 8, 10])}
            row = Row(commit=f"{rnd.getrandbits(160):040x}", val_bpb=val, memory_gb=40.0, status=status,
                      description=f"synthetic point {i}", exp_id=i, tag="bench", parent="0" * 40, mfu=40.0,
                      tokens_per_s=1.2e6, training_seconds=budget, total_seconds=budget + 25.0, num_steps=900,
                      total_tokens_M=480.0, time_budget=budget, seed=42, knobs=knobs,
                      started_at="2025-01-01T00:00:00+00:00", finished_at="2025-01-01T00:05:00+00:00")
            w.writerow(row.to_fields())


def time_in_process(args: list[str], repeat: int) -> float:
    from autoresearch.cli import main

    times = []
    for _ in range(repeat):
        sys.argv = ["ar", *args]
        t = time.perf_counter()
        with redirect_stdout(io.StringIO()):
            try:
                main()
            except SystemExit as e:
                if e.code:
                    raise
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        write_results(Path(tmp) / "runs" / "bench" / "results.tsv", a.rows)
        png = Path(tmp) / "progress.png"
        rows = [("table", ["report", "--repo", tmp]),
                ("--json", ["report", "--repo", tmp, "--json"]),
                ("--plot", ["report", "--repo", tmp, "--plot", str(png)])]
        time_in_process(rows[0][1], 1)  # warm the imports once
        print(f"ar report over {a.rows:,} results (median of {a.repeat}, in-process):")
        for name, args in rows:
            print(f"  {name:<7} {time_in_process(args, a.repeat):.3f} s")
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "autoresearch", "report", "--repo", tmp], check=True,
                       stdout=subprocess.DEVNULL)
        print(f"  one cold subprocess (interpreter + imports included): {time.perf_counter() - t:.3f} s")


if __name__ == "__main__":
    main()
