#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1 AR_CACHE=/tmp/arcache TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu_setup.sh          # the carried wheels and this package; machine, python, torch
DIAG_OUT=/tmp/diag-works python3 bench/diag_sandbox_cuda.py 2>&1 | tee "$OUT/diag.txt"
echo "first single write root that lets CUDA start: $(cat /tmp/diag-works)"
