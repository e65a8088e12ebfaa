#!/usr/bin/env bash
# Do paired seeds see what one run cannot? (issue: decisions with power). One call on the GPU host, repo root,
# wheels in .whl/:   BUDGET=30 BATCH=2**17 SEEDS="42 43 44" bash bench/gpu_paired.sh
# `ar init`, builtin-site; three versions of train.py, each trained once per seed with `ar try` (ar's clock, sandbox
# and trusted evaluator; the seed from ar.yaml): the baseline handicapped (each step sleeps 15 % of its own time),
# the handicap removed (the real improvement: the same arithmetic, more steps), and a near-null edit (LR_MULT 0.99).
# Per seed, the difference from the baseline: a same-seed comparison helps where that difference varies less than
# two independent runs do. Writes $OUT/paired.tsv (version, seed, what `ar try` said) and the tag's trials.tsv (the
# trials in that order: val_bpb, steps, tokens/s).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-30}; BATCH=${BATCH:-2**17}; SEEDS=${SEEDS:-"42 43 44"}; VERSIONS=${VERSIONS:-"base fast lr099"}
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-cache-dir .whl/*.whl 2>&1 | grep -v WARNING | tail -2
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir . 2>&1 | grep -v WARNING | tail -2
date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch,sys; print('python', sys.version.split()[0], 'torch', torch.__version__)"
export AR_CACHE=${AR_CACHE:-/tmp/arcache-paired}
python3 -m autoresearch prepare builtin-site --vocab-size 8192 --max-bytes ${MAX_BYTES:-300000000} 2>&1 | tail -1
echo "setup: $(( $(date +%s) - t0 )) s"
ws=/tmp/ws-paired; rm -rf "$ws"
python3 -m autoresearch init "$ws" >/dev/null && cd "$ws" || exit 1
cp train.py /tmp/train-orig.py
version() {   # write train.py for one version
  BATCH="$BATCH" V="$1" python3 - <<'PY'
import os, re
from pathlib import Path
s = Path("/tmp/train-orig.py").read_text()
s, n = re.subn(r"^TOTAL_BATCH_SIZE = \S+", f"TOTAL_BATCH_SIZE = {os.environ['BATCH']}", s, count=1, flags=re.M)
assert n == 1
v = os.environ["V"]
if v in ("base", "lr099"):
    old = "            dt = time.time() - t0\n"
    assert s.count(old) == 1
    s = s.replace(old, "            time.sleep(0.15 * (time.time() - t0))           # HANDICAP: 15 % slower steps\n" + old)
if v == "lr099":
    s, n = re.subn(r"^LR_MULT = \S+", "LR_MULT = 0.99", s, count=1, flags=re.M)
    assert n == 1
Path("train.py").write_text(s)
PY
}
version base
git -c user.name=b -c user.email=b@b commit -qam "the baseline, handicapped"
printf 'version\tseed\tsaid\n' > "$OUT/paired.tsv"
for seed in $SEEDS; do
  for v in $VERSIONS; do
    version "$v"
    printf 'dataset: builtin-site\nseed: %s\ntime_budget: %s\n' "$seed" "$BUDGET" > ar.yaml
    s=$(date +%s)
    python3 -m autoresearch try --config ar.yaml > "$OUT/try-$v-$seed.log" 2>&1
    printf '%s\t%s\t%s\n' "$v" "$seed" "$(tail -2 "$OUT/try-$v-$seed.log" | tr '\n' ' ' | cut -c1-150)" \
        | tee -a "$OUT/paired.tsv"
    echo "   ($(( $(date +%s) - s )) s)"
  done
done
git checkout -q train.py
cp runs/*/trials.tsv "$OUT"/ 2>/dev/null; cat runs/*/trials.tsv | cut -c1-300
echo "total: $(( $(date +%s) - t0 )) s"
