#!/usr/bin/env bash
# Issue 39 on one GPU host, in calls from the repo root (each under 10 minutes, the machine kept warm between):
#   bash bench/gpu_issue39.sh 1   # install; GPU tests as root and as a normal user; the evaluator's scoring and
#                                 # forward benches; the evaluation's phases alone (bench/diag_trust_gpu.py)
#   bash bench/gpu_issue39.sh 2   # a normal user's `ar run`: two slots on GPU 0, the 30-s scripted agent,
#                                 # 60-s budgets (bench/gpu_loop.sh; RUNS overrides)
#   bash bench/gpu_issue39.sh 3   # GPU tests as root and as a normal user, the trust diag once, then MFU
#                                 # (bench/gpu_mfu.sh: MFU_ONLY, by default the default train.py at 2**19 and 2**17)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; chmod 777 "$OUT"
t0=$(date +%s)
source bench/gpu_setup.sh          # the carried wheels and this package; machine, python, torch
id bench >/dev/null 2>&1 || useradd -m bench
chmod -R a+rX "$PWD"
gpu_tests() {
  for who in root bench; do
    echo "== GPU tests as $who"
    run=(env); [[ $who == bench ]] && run=(runuser -u bench -- env HOME=/home/bench PYTHONUNBUFFERED=1)
    timeout 150 "${run[@]}" python3 -m pytest -o addopts="" -p no:cacheprovider -q -rs -m gpu \
        --basetemp=/tmp/pt-$who tests/test_evaluate.py tests/test_doctor.py 2>&1 | tail -4
  done
  echo "tests: $(( $(date +%s) - t0 )) s"
}
if [[ ${1:-1} == 3 ]]; then
  gpu_tests
  timeout ${DIAG_S:-120} python3 bench/diag_trust_gpu.py --eval-tokens 10485760 --repeat 1 --leads 0 \
      --out "$OUT/trust.json" 2>&1 | cut -c1-1200 | tee "$OUT/diag.log" | grep -v '^{"available' | tail -12
  echo "diag: $(( $(date +%s) - t0 )) s"
  MFU_ONLY=${MFU_ONLY:-base@19,base@17,plain@19} MFU_BUDGET_S=$(( ${CALL_S:-570} - ($(date +%s) - t0) )) \
      bash bench/gpu_mfu.sh 2>&1 | tail -30
elif [[ ${1:-1} == 1 ]]; then
  gpu_tests
  timeout 60 python3 bench/bench_eval_score.py --repeat 20 2>&1 | tee "$OUT/eval_score.log" | tail -8
  timeout 200 python3 bench/bench_eval_forward.py --kernels 2>&1 | tee "$OUT/eval_forward.log" | tail -30
  echo "benches: $(( $(date +%s) - t0 )) s"
  timeout ${DIAG_S:-150} python3 bench/diag_trust_gpu.py --eval-tokens 10485760 --repeat ${REPEAT:-2} --leads 0 \
      --out "$OUT/trust.json" 2>&1 | cut -c1-1200 | tee "$OUT/diag.log" | grep -v '^{"available' | tail -20
else
  SKIP_INSTALL=1 RUNS="${RUNS:-user:0,0:agent30:5:60:450}" bash bench/gpu_loop.sh
  [[ -n ${TESTS_AFTER:-} ]] && gpu_tests       # the GPU tests too, in the same call
fi
echo "call total: $(( $(date +%s) - t0 )) s"
