#!/usr/bin/env bash
# The clock on a busy CPU: `ar run` of the real train.py (cpu profile) with HOGS busy processes beside it, and
# each run's window against its budget and its start-up in wall and CPU seconds (bench/loop_gaps.py). An honest
# start-up slowed by the load must cost no window. From the repo root, with ar installed:
#   HOGS=1 N=5 BUDGET=20 bash bench/bench_clock_cpu.sh
set -euo pipefail
REPO=$PWD; PY=${PY:-python3}
WS=${WS:-/tmp/bench-clock}; N=${N:-5}; HOGS=${HOGS:-1}; BUDGET=${BUDGET:-20}
rm -rf "$WS"
"$PY" -m autoresearch init "$WS" >/dev/null
cd "$WS"
"$PY" -m autoresearch prepare builtin >/dev/null 2>&1 || true      # data first: its time is not the runs'
pids=()
for _ in $(seq "$HOGS"); do "$PY" -c "while True: pass" & pids+=($!); done
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
date -u; nproc; "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__)"
start=$(date +%s)
printf 'noise: 0.002\n' > clock.yaml        # a stated threshold: the clock is measured, not the noise
"$PY" -m autoresearch run --tag clock --max-experiments "$N" --time-budget "$BUDGET" --config clock.yaml 2>&1 \
    | grep -E "^[0-9]{4} " || true
echo "ar run: $(( $(date +%s) - start )) s with $HOGS busy process(es) beside it"
"$PY" "$REPO/bench/loop_gaps.py" runs/clock
"$PY" - <<'PY'
import json, pathlib
for m in sorted(pathlib.Path("runs/clock").glob("0*/metrics.json")):
    d = json.loads(m.read_text())
    print(f"{m.parent.name[:4]}: start-up {d.get('startup_seconds') or 0:.1f}s wall, {d.get('startup_cpu') or 0:.1f} "
          f"CPU-s; window {d.get('window_seconds')}s; {d.get('window_note') or 'no cut'}")
PY
