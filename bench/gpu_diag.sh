#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1 AR_CACHE=/tmp/arcache TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-cache-dir .whl/*.whl 2>&1 | grep -v WARNING | tail -2
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir . 2>&1 | grep -v WARNING | tail -2
DIAG_OUT=/tmp/diag-works python3 bench/diag_sandbox_cuda.py 2>&1 | tee "$OUT/diag.txt"
echo "first single write root that lets CUDA start: $(cat /tmp/diag-works)"
