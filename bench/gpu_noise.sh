#!/usr/bin/env bash
# `ar noise` on a GPU: the default train.py (TOTAL_BATCH_SIZE=$BATCH) trained RUNS times at each of BUDGETS, as
# experiments run, and the budget recommended. One call on the GPU host, from the repo root (wheels in .whl/):
#   BUDGETS=15,30 RUNS=3 BATCH=2**17 MAX_BYTES=300000000 bash bench/gpu_noise.sh
# Writes to $OUT: noise.log (ar noise's output), noise-budgets.json, trials.tsv.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BUDGETS=${BUDGETS:-15,30}; RUNS=${RUNS:-3}; BATCH=${BATCH:-2**17}; LIMIT=${LIMIT:-540}
t0=$(date +%s)
source bench/gpu_setup.sh
export AR_CACHE=${AR_CACHE:-/tmp/arcache-noise}
python3 -m autoresearch prepare builtin-site --vocab-size 8192 --max-bytes ${MAX_BYTES:-300000000} 2>&1 | tail -1
echo "setup: $(( $(date +%s) - t0 )) s"
ws=/tmp/ws-noise; rm -rf "$ws"
python3 -m autoresearch init "$ws" >/dev/null && cd "$ws" || exit 1
sed -i "s/^TOTAL_BATCH_SIZE = [^ ]*/TOTAL_BATCH_SIZE = $BATCH/" train.py
git -c user.name=b -c user.email=b@b commit -qam "TOTAL_BATCH_SIZE $BATCH"
printf 'dataset: builtin-site\n' > ar.yaml
start=$(date +%s)
timeout -s INT "$LIMIT" python3 -m autoresearch noise --budgets "$BUDGETS" --runs "$RUNS" --config ar.yaml \
    --tag noise > "$OUT/noise.log" 2>&1
echo "ar noise: rc $? in $(( $(date +%s) - start )) s"
grep -E "^(budget|recommended|σ|no budget)" "$OUT/noise.log"
cp runs/noise/noise-budgets.json runs/noise/trials.tsv "$OUT"/ 2>/dev/null; true
