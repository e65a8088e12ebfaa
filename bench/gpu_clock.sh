#!/usr/bin/env bash
# The GPU clock (issue: start-up charged in GPU time). One call on the GPU host, from the repo root (wheels in .whl/):
#   bash bench/gpu_clock.sh
# Runs tests/test_gpu_clock.py as root, then as an ordinary user: the baseline, an honest new shape (a cold compile),
# steps on readable text before the first batch, and GPU work in a daemonized grandchild; prints each run's
# start-up in wall and GPU seconds, its window, and what was charged.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu_setup.sh          # the carried wheels and this package; machine, python, torch
K=/tmp/gpu-clock-out; mkdir -p $K; chmod 777 $K
export AR_CACHE=/tmp/arcache     # one cache: the corpus is prepared once (the user's run finds its compiles warm)
AR_TEST_OUT=$K python3 -m pytest -p no:cacheprovider -n 0 -q -s -m gpu tests/test_gpu_clock.py 2>&1 | tee "$OUT/root.log" | grep -E "^(credit|baseline|new shape|attack|grandchild)[ :]|passed|failed|Error|assert" | head -40
id u1 >/dev/null 2>&1 || useradd -m u1
chmod -R a+rX . ; chmod -R a+rwX "$AR_CACHE" "$OUT"
runuser -u u1 -- env AR_CACHE=$AR_CACHE AR_TEST_OUT=$K PYTHONUNBUFFERED=1 python3 -m pytest -p no:cacheprovider -n 0 -q -s -m gpu \
    tests/test_gpu_clock.py 2>&1 | tee "$OUT/user.log" | grep -E "^(credit|baseline|new shape|attack|grandchild)[ :]|passed|failed|Error|assert" | head -40
cp $K/* "$OUT"/ 2>/dev/null; true
