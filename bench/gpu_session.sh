#!/usr/bin/env bash
# One call on the GPU host: install the carried wheels, build the offline corpus, then measure.
#   MAX_BYTES  corpus cap (default 1.5e9)     BUDGET  seconds per training run (default 30)
#   STEPS      which parts: any of prep,loader,train,probe,doctor (default all)   ONLY  bench_train labels
set -uo pipefail
export PYTHONUNBUFFERED=1 AR_CACHE=${AR_CACHE:-/tmp/arcache} TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
STEPS=${STEPS:-prep,loader,train,probe,doctor}
has() { [[ ",$STEPS," == *",$1,"* ]]; }
date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader; nproc
python3 -c "import torch,sys; print('python', sys.version.split()[0], 'torch', torch.__version__, torch.cuda.get_device_name(0), torch.cuda.get_device_capability())"
if has prep; then
  /usr/bin/time -f "prepare: %e s, max RSS %M KB" python3 -m autoresearch prepare builtin-site --vocab-size 8192 \
      --max-bytes "${MAX_BYTES:-1500000000}" 2>&1 | tail -4
fi
export AR_DATASET=builtin-site
if has loader; then
  python3 bench/bench_loader.py --dataset builtin-site --device cuda --threads 1,2 --seconds 4 2>&1 | tee "$OUT/loader.txt" | tail -12
fi
if has train; then
  python3 bench/bench_train.py --budget "${BUDGET:-30}" --out "$OUT/bench-train.json" ${ONLY:+--only "$ONLY"} 2>&1 | tee "$OUT/train.txt" | grep -v '^{' | tail -30
fi
if has doctor; then python3 -m autoresearch doctor 2>&1 | tee "$OUT/doctor.txt" | tail -25; fi
if has probe; then python3 -m autoresearch doctor --probe 2>&1 | tee "$OUT/probe.txt" | tail -40; fi
