#!/usr/bin/env bash
# `ar run` end to end on one GPU, as root and as a normal user, and where the time between training windows
# goes (bench/loop_gaps.py over each run's timing.json). One call on the GPU host, from the repo root:
#   RUNS="root:serial:strategy:3 user:serial:strategy:4 user:0,0:agent30:4"  BUDGET=20  bash bench/gpu_loop.sh
# Each entry is who:slots:proposer:experiments[:budget[:seconds]] (slots: serial, or a --gpus value such as 0,0; proposer:
# strategy, or agentN: the scripted agent of bench/agents/slow_agent.py thinking N s per proposal).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; chmod 777 "$OUT"
BUDGET=${BUDGET:-20}; RUNS=${RUNS:-"root:serial:strategy:3 user:serial:strategy:4"}
REPO=$PWD
t0=$(date +%s)
source bench/gpu_setup.sh          # the carried wheels and this package; machine, python, torch
nproc
export AR_CACHE=/tmp/arcache
python3 -m autoresearch prepare builtin-site --vocab-size ${VOCAB:-8192} --max-bytes ${MAX_BYTES:-100000000} 2>&1 | tail -1
echo "setup: $(( $(date +%s) - t0 )) s"
id bench >/dev/null 2>&1 || useradd -m bench
chmod 755 /tmp/arcache
printf 'dataset: builtin-site\nnoise: 0.002\n' > /tmp/bench-ar.yaml; chmod 644 /tmp/bench-ar.yaml   # a stated threshold: no calibration
n=0
for run in $RUNS; do
  IFS=: read -r who slots proposer count budget LIMIT <<<"$run"; n=$((n+1)); tag="r$n"; budget=${budget:-$BUDGET}
  ws=/tmp/ws-$tag; rm -rf "$ws"
  args=(--tag "$tag" --max-experiments "$count" --time-budget "$budget" --calibrate-noise 0 --config /tmp/bench-ar.yaml)
  [[ $slots != serial ]] && args+=(--gpus "$slots")
  if [[ $proposer == agent* ]]; then args+=(--agent "python3 $REPO/bench/agents/slow_agent.py ${proposer#agent} {prompt_file}"); fi
  if [[ $who == user ]]; then
    cache=/tmp/uscache
    if [[ ! -d $cache ]]; then   # root's data and trusted store; the store's placeholder paths name its folder
      cp -r /tmp/arcache $cache
      python3 - <<'PY'
import os
for root, _, files in os.walk("/tmp/uscache/compile"):
    for f in files:
        p = os.path.join(root, f); b = open(p, "rb").read()
        if b"/tmp/arcache/" in b: open(p, "wb").write(b.replace(b"/tmp/arcache/", b"/tmp/uscache/"))
PY
      chown -R bench $cache
    fi
    runuser -u bench -- env AR_CACHE=$cache HOME=/home/bench python3 -m autoresearch init "$ws" >/dev/null
    start=$(date +%s)
    (cd "$ws" && runuser -u bench -- env AR_CACHE=$cache HOME=/home/bench PYTHONUNBUFFERED=1 \
        timeout -s INT "${LIMIT:-100000}" python3 -m autoresearch run "${args[@]}") > "$OUT/$tag.log" 2>&1
  else
    python3 -m autoresearch init "$ws" >/dev/null
    start=$(date +%s)
    (cd "$ws" && timeout -s INT "${LIMIT:-100000}" python3 -m autoresearch run "${args[@]}") > "$OUT/$tag.log" 2>&1
  fi
  echo "== $tag: $run, ${budget}-s budget: ar run took $(( $(date +%s) - start )) s"
  tail -3 "$OUT/$tag.log"
  python3 "$REPO/bench/loop_gaps.py" "$ws/runs/$tag" --json "$OUT/$tag.json" | tee "$OUT/$tag.md"
  grep -h "model:" "$ws"/runs/$tag/0001-*/train.log | head -1
  for f in "$ws"/runs/$tag/0*/train.log; do grep -h "step 0000[12] " "$f" | cut -c1-90; done
  for f in "$ws"/runs/$tag/0*/train.log; do       # a failed run's last lines, to see why
    grep -q "^training_seconds" "$f" || { echo "-- $f"; grep -v "^step" "$f" | tail -8; }
  done
  du -sh $AR_CACHE/compile /tmp/uscache/compile 2>/dev/null
  # every step line, timing and record of each run, in one file (8 files come back from a call)
  (cd "$ws/runs/$tag" && tar czf "$OUT/$tag-logs.tgz" 0*/train.log 0*/timing.json 0*/record.json 0*/metrics.json \
      2>/dev/null)
done
if [[ -n ${DIAG:-} ]]; then    # the trust path's own check and the fresh re-score's cost (bench/diag_trust_gpu.py)
  timeout "${DIAG_LIMIT:-120}" python3 "$REPO/bench/diag_trust_gpu.py" --eval-tokens 10485760 --repeat "${DIAG:-2}" \
      --out "$OUT/trust.json" 2>&1 | tail -25
fi
echo "total: $(( $(date +%s) - t0 )) s"
