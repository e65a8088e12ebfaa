#!/usr/bin/env bash
# The keep decision on a GPU (issue: decisions with power). One call on the GPU host, from the repo root:
#   BUDGET=15 BATCH=2**17 [LR=0.5] bash bench/gpu_decisions.sh         (then RESUME=1 bash bench/gpu_decisions.sh on the
#                                                              same warm machine: the session goes on where it stopped)
# `ar init` workspace, builtin-site corpus, the baseline handicapped (each step sleeps 15 % of its own time,
# so it is 15 % slower per step), the noise calibrated (3 runs), then a scripted agent proposes six near-null
# edits of LR_MULT (x 1.005, 0.995, 1.01, 0.99, 1.02, 0.98; LR sets the baseline's) after the real improvement (the handicap removed;
# PLAN=null-first: before it).
# Expected: no near-null edit kept; the improvement kept. GPUS=0 (default): one slot; 0,0: two on one GPU (a
# neighbour's evaluation then takes GPU time from a window: more noise).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-15}; LIMIT=${LIMIT:-480}; BATCH=${BATCH:-2**19}; GPUS=${GPUS:-0}
t0=$(date +%s)
REPO=$PWD; ws=/tmp/ws-dec
if [[ -n ${RESUME:-} ]]; then SKIP_INSTALL=1; fi
source bench/gpu_setup.sh
export AR_CACHE=${AR_CACHE:-/tmp/arcache-dec}
[[ -n ${RESUME:-} ]] || python3 -m autoresearch prepare builtin-site --vocab-size ${VOCAB:-8192} --max-bytes ${MAX_BYTES:-100000000} 2>&1 | tail -1
echo "setup: $(( $(date +%s) - t0 )) s"
if [[ -z ${RESUME:-} ]]; then
rm -rf "$ws" /tmp/near-null-agent.count /tmp/near-null
mkdir -p /tmp/near-null      # the agent's count: in a folder of its own (the agent's sandbox lets it create files
                             # in /tmp, which holds AR_CACHE, but not write them; a folder that exists is its own)
python3 -m autoresearch init "$ws" >/dev/null
cd "$ws"
python3 "$REPO/bench/handicap.py" train.py train.py --batch "$BATCH" --slow --lr-mult "${LR:-1.0}" || exit 1
git -c user.name=b -c user.email=b@b commit -qam "the baseline, handicapped: each step 15 % slower (batch $BATCH)"
printf 'dataset: builtin-site\n' > ar.yaml
fi
cd "$ws"
export NEAR_NULL_STATE=/tmp/near-null/count
start=$(date +%s)
timeout -s INT "$LIMIT" python3 -m autoresearch run --tag dec --max-experiments ${MAX_EXP:-14} --time-budget "$BUDGET" \
    --config ar.yaml --gpus "$GPUS" --agent "python3 $REPO/bench/agents/near_null_agent.py {prompt_file}" >> "$OUT/dec.log" 2>&1
echo "ar run: $(( $(date +%s) - start )) s"
grep -E "^noise|^[0-9]{4} " "$OUT/dec.log" | cut -c1-400
cp runs/dec/results.tsv "$OUT/results.tsv"
python3 - <<'PY' | tee "$OUT/decisions.md"
import json
from pathlib import Path
from autoresearch.records.ledger import read_results
rows = read_results(Path("runs/dec/results.tsv"))
print("| exp | what | decision | runs | mean | z / bar |")
print("| --- | --- | --- | --- | --- | --- |")
for r in rows:
    d = Path(f"runs/dec/{r.exp_id:04d}-{r.commit}/decision.json")
    doc = json.loads(d.read_text()) if d.exists() else {}
    runs = " ".join(f"{v:.4f}" for v in doc.get("runs", [r.val_bpb] if r.val_bpb else []))
    zb = f"{doc['z']:.2f} / {doc['bar']:.2f}" if doc.get("z") is not None else ""
    print(f"| {r.exp_id} | {r.description[:50]} | {r.status.value} | {runs} | "
          f"{'' if r.val_bpb is None else f'{r.val_bpb:.4f}'} | {zb} |")
PY
