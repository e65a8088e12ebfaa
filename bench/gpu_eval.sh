#!/usr/bin/env bash
# One call on the GPU host: install ar (and the wheels it lacks there), build the offline corpus, then measure
# the trusted evaluation's cost (bench/bench_eval.py). Results in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 AR_CACHE=/tmp/arcache TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu_setup.sh          # the carried wheels and this package; machine, python, torch
uname -r; nproc
python3 -c "import torch; from autoresearch.harness import sandbox; print(torch.cuda.get_device_name(0), 'sandbox:', sandbox.available())"
/usr/bin/time -f "prepare: %e s" python3 -m autoresearch prepare builtin-site --vocab-size 8192 --max-bytes "${MAX_BYTES:-300000000}" 2>&1 | tail -3
cd bench && python3 bench_eval.py --dataset builtin-site --budget "${BUDGET:-20}" --repeat "${REPEAT:-3}" --out "$OUT/eval.json" ${EXTRA:-} 2>&1 | tee "$OUT/eval.log" | grep -v '^ \|^{"after' | tail -60
