"""GPU benchmark: what reading per-process GPU time costs a training window (not a test).

ar's GPU meter (harness/gputime.py) polls NVML every 50 ms from a run's clock start to its first batch, so it is
off during the run's own window; with two slots or an overlapped start-up a neighbour's meter can poll while this
window trains. This measures the worst case: the default train.py, run by hand for BUDGET seconds, with a meter
polling over its process tree for the whole run ("on") and without ("off"), in the order off, on, on, off, ...
so drift cancels; the figure is each run's median tok/s over its steps after the first SKIP.

    python bench/gpu_meter_cost.py [--pairs 2] [--budget 15]     (AR_CACHE, AR_DATASET prepared; a CUDA GPU)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoresearch.experiment import execute  # noqa: E402
from autoresearch.harness import gputime, logfmt  # noqa: E402

SKIP = 10          # compile and warm-up steps left out


def one(work: Path, budget: int, metered: bool) -> tuple[float, int, float]:
    """(median tok/s after SKIP steps, steps, GPU-s the meter read or nan)."""
    env = {**os.environ, "AR_TIME_BUDGET": str(budget), "AR_PROFILE": os.environ.get("AR_PROFILE", "gpu")}
    proc = subprocess.Popen([sys.executable, "train.py"], cwd=work, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    meter = None
    if metered:
        meter, why = gputime.open_meter()
        if meter is None:
            raise SystemExit(f"no meter here: {why}")
        meter.start(lambda: execute.tree_pids(proc))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    proc.wait()
    reader.join(timeout=5)
    read = float("nan")
    if meter is not None:
        read = meter.seconds()
        meter.stop()
    tps = []
    for line in lines:
        m = logfmt.STEP_RE.match(line.rstrip("\n"))
        if m:
            tps.append(int(m.group("tps")))
    if proc.returncode or len(tps) <= SKIP:
        raise SystemExit(f"train.py exited {proc.returncode} after {len(tps)} steps:\n{''.join(lines[-30:])}")
    return statistics.median(tps[SKIP:]), len(tps), read


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--budget", type=int, default=15)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="meter-cost-"))
    shutil.copy(ROOT / "train.py", work / "train.py")
    one(work, 5, False)                            # the compile cache warmed: no run pays the first compile
    order = [m for i in range(args.pairs) for m in ((False, True) if i % 2 == 0 else (True, False))]
    got: dict[bool, list[float]] = {False: [], True: []}
    for metered in order:
        tps, steps, read = one(work, args.budget, metered)
        got[metered].append(tps)
        print(f"{'on ' if metered else 'off'}  median tok/s {tps:,.0f} over {steps - SKIP} steps"
              + (f"  (the meter read {read:.1f} GPU-s of a {args.budget}-s run)" if metered else ""), flush=True)
    off, on = statistics.median(got[False]), statistics.median(got[True])
    print(f"median of runs: off {off:,.0f} tok/s, on {on:,.0f} tok/s: {100 * (on - off) / off:+.2f} %")


if __name__ == "__main__":
    main()
