#!/usr/bin/env bash
# One call on the GPU host: install ar (and the wheels it lacks there), build the offline corpus, then measure
# the trusted evaluation's cost (bench/bench_eval.py). Results in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 AR_CACHE=/tmp/arcache TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-cache-dir .whl/*.whl 2>&1 | grep -v WARNING | tail -2
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir . 2>&1 | grep -v WARNING | tail -2
date -u; uname -r; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
python3 -c "import torch,sys; from autoresearch.harness import sandbox; print('python', sys.version.split()[0], 'torch', torch.__version__, torch.cuda.get_device_name(0), 'sandbox:', sandbox.available())"
/usr/bin/time -f "prepare: %e s" python3 -m autoresearch prepare builtin-site --vocab-size 8192 --max-bytes "${MAX_BYTES:-300000000}" 2>&1 | tail -3
cd bench && python3 bench_eval.py --dataset builtin-site --budget "${BUDGET:-20}" --repeat "${REPEAT:-3}" --out "$OUT/eval.json" ${EXTRA:-} 2>&1 | tee "$OUT/eval.log" | grep -v '^ \|^{"after' | tail -60
