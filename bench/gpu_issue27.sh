#!/usr/bin/env bash
# The evaluator's CUDA IPC through buffer owners and the feed's clock on one GPU host, in two calls from the repo
# root (each under 10 minutes):
#   bash bench/gpu_issue27.sh 1   # install; GPU tests and IPC diagnostics as root and as a normal user; a root run
#   bash bench/gpu_issue27.sh 2   # a normal user's run with the 30-s scripted agent; the trust path's diagnostic
#   bash bench/gpu_issue27.sh 3   # GPU tests as root and as a user; the evaluation's phases with and without
#                                 # the workers' pre-start (bench/diag_trust_gpu.py), a GPU-bound training stand-in
# Runs are `ar run` with two slots on GPU 0 (bench/gpu_loop.sh), 30-s budgets; tables by bench/loop_gaps.py.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; chmod 777 "$OUT"
t0=$(date +%s)
source bench/gpu_setup.sh          # the carried wheels and this package; machine, python, torch
id bench >/dev/null 2>&1 || useradd -m bench
chmod -R a+rX "$PWD"
if [[ ${1:-1} == 1 ]]; then
  for who in root bench; do
    echo "== GPU tests as $who"
    run=(env); [[ $who == bench ]] && run=(runuser -u bench -- env HOME=/home/bench PYTHONUNBUFFERED=1)
    timeout 150 "${run[@]}" python3 -m pytest -o addopts="" -p no:cacheprovider -q -rs -m gpu \
        --basetemp=/tmp/pt-$who tests/test_evaluate.py -k cuda_ipc 2>&1 | tail -6
    echo "== IPC owner diagnostic as $who"
    timeout 100 "${run[@]}" python3 bench/diag_ipc_owner.py --out "$OUT/ipc_owner_$who.json" 2>&1 | cut -c1-600 | tail -12
  done
  echo "tests + diagnostics: $(( $(date +%s) - t0 )) s"
  SKIP_INSTALL=1 RUNS="root:0,0:strategy:3:30:230" bash bench/gpu_loop.sh
elif [[ $1 == 3 ]]; then
  for who in root bench; do
    echo "== GPU tests as $who"
    run=(env); [[ $who == bench ]] && run=(runuser -u bench -- env HOME=/home/bench PYTHONUNBUFFERED=1)
    timeout 90 "${run[@]}" python3 -m pytest -o addopts="" -p no:cacheprovider -q -rs -m gpu \
        --basetemp=/tmp/pt-$who tests/test_evaluate.py -k cuda_ipc 2>&1 | tail -3
  done
  echo "tests: $(( $(date +%s) - t0 )) s"
  timeout ${DIAG_S:-230} python3 bench/diag_trust_gpu.py --repeat ${REPEAT:-3} --leads 0 5 --out "$OUT/trust.json" 2>&1 \
      | cut -c1-1200 | tee "$OUT/diag.log" | grep -v '^{"available'
else
  timeout 90 runuser -u bench -- env HOME=/home/bench python3 -m pytest -o addopts="" -p no:cacheprovider -q -rs \
      -m gpu --basetemp=/tmp/pt-bench tests/test_evaluate.py -k cuda_ipc 2>&1 | tail -2
  SKIP_INSTALL=1 RUNS="${RUNS:-root:0,0:strategy:3:30:200 user:0,0:agent30:4:30:300}" bash bench/gpu_loop.sh
fi
echo "call total: $(( $(date +%s) - t0 )) s"
