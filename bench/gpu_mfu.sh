#!/usr/bin/env bash
# One call on the GPU host (repo root, root, no internet): the default train.py against its MFU knobs, side by
# side on the same tokens (bench/bench_mfu.py), in under 5 minutes with the compiles.
#   MFU_BUDGET_S  seconds from this script's start to finish by (default 280); runs that would pass it are skipped
#   MFU_ONLY      comma list of NAME@LOG2 from bench_mfu.PLAN (default: the plan, most informative first)
#   MFU_STEPS     optimizer steps per run (default: 15 at 2**19, 28 at 2**17)
#   MFU_PROFILE   set: bench/profile_step.py of the default and of the plain one (the three knobs off) after the plan (+~90 s)
#   MAX_BYTES     corpus cap (default 1e8: about 28 M training tokens, prepared in ~15 s)
# Writes to $OUT: setup.log, plan.log, runs.log (every run's full log, in order), results.json, table.txt
# (and profile.txt).
set -uo pipefail
START=$(date +%s)
export PYTHONUNBUFFERED=1 AR_CACHE=${AR_CACHE:-/tmp/arcache} AR_DATASET=${AR_DATASET:-builtin-site}
export AR_PROFILE=${AR_PROFILE:-gpu} VOCAB=${VOCAB:-8192}      # AR_PROFILE=cpu VOCAB=2048: a dry run on a CPU box
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WORK=/tmp/mfu-runs; rm -rf "$WORK"; mkdir -p "$WORK"
export PYTHONPATH=$PWD                 # the repo's own package first, the carried wheels (if any) after it
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    2>&1 | tail -3 > "$OUT/setup.log"
  export PYTHONPATH=$PWD:/tmp/site
fi
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader; nproc
  python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA')"
  python3 -c "import triton; print('triton', triton.__version__)"
  python3 -c "import autoresearch.harness.tokenizer, autoresearch.harness.data, safetensors, yaml" \
    || echo "FAIL: the harness does not import (carry the wheels in .whl/ or install the dependencies)"
  if ! python3 -c "from autoresearch.harness.data import check_prepared as c; from pathlib import Path; import os; c(Path(os.environ['AR_CACHE']), os.environ['AR_DATASET'], int(os.environ['VOCAB']))" 2>/dev/null; then
    t0=$(date +%s)
    python3 -m autoresearch prepare "$AR_DATASET" --vocab-size "$VOCAB" --max-bytes "${MAX_BYTES:-100000000}" 2>&1 | tail -3
    echo "prepare: $(( $(date +%s) - t0 )) s"
  fi
  echo "setup took $(( $(date +%s) - START )) s"
} 2>&1 | tee -a "$OUT/setup.log"
python3 bench/bench_mfu.py plan --out "$OUT" --work "$WORK" --deadline $(( START + ${MFU_BUDGET_S:-280} )) \
    ${MFU_ONLY:+--only "$MFU_ONLY"} ${MFU_STEPS:+--steps "$MFU_STEPS"} 2>&1 | tee "$OUT/plan.log"
if [[ -n ${MFU_PROFILE:-} ]]; then       # where the time goes, default vs the three knobs off (about 45 s each)
  for knobs in '{}' '{"FUSED_CE": false, "BF16_RESIDUAL": false, "RELU2_KEEPS_OUTPUT": false}'; do
    timeout 120 python3 bench/profile_step.py --rows 64 --knobs "$knobs" 2>&1 | grep -v Warning | tail -26
  done > "$OUT/profile.txt" 2>&1
fi
echo "total $(( $(date +%s) - START )) s"
