#!/usr/bin/env bash
# Do paired seeds see what one run cannot? (issue: decisions with power). One call on the GPU host, repo root,
# wheels in .whl/:   BUDGET=30 BATCH=2**17 SEEDS="42 43 44" [LR=0.5] bash bench/gpu_paired.sh
# `ar init`, builtin-site; three versions of train.py, each trained once per seed with `ar try` (ar's clock, sandbox
# and trusted evaluator; the seed from ar.yaml): the baseline handicapped (each step sleeps 15 % of its own time),
# the handicap removed (the real improvement: the same arithmetic, more steps), and a near-null edit (LR_MULT 0.99);
# LR sets base's and fast's LR_MULT, and `ref` is base at LR_MULT 1 (VERSIONS="ref base" LR=0.5: the spread at both).
# Per seed, the difference from the baseline: a same-seed comparison helps where that difference varies less than
# two independent runs do. Writes $OUT/paired.tsv (version, seed, what `ar try` said) and the tag's trials.tsv (the
# trials in that order: val_bpb, steps, tokens/s).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-30}; BATCH=${BATCH:-2**17}; SEEDS=${SEEDS:-"42 43 44"}; VERSIONS=${VERSIONS:-"base fast lr099"}
t0=$(date +%s)
REPO=$PWD
source bench/gpu_setup.sh
export AR_CACHE=${AR_CACHE:-/tmp/arcache-paired}
python3 -m autoresearch prepare builtin-site --vocab-size 8192 --max-bytes ${MAX_BYTES:-300000000} 2>&1 | tail -1
echo "setup: $(( $(date +%s) - t0 )) s"
ws=/tmp/ws-paired; rm -rf "$ws"
python3 -m autoresearch init "$ws" >/dev/null && cd "$ws" || exit 1
cp train.py /tmp/train-orig.py
LR=${LR:-1.0}   # LR_MULT of base and fast: is the seed spread at 2**17 the learning rate's (tuned for 2**19)?
version() {   # write train.py for one version
  case $1 in
    base)  python3 "$REPO/bench/handicap.py" /tmp/train-orig.py train.py --batch "$BATCH" --slow --lr-mult "$LR" ;;
    fast)  python3 "$REPO/bench/handicap.py" /tmp/train-orig.py train.py --batch "$BATCH" --lr-mult "$LR" ;;
    ref)   python3 "$REPO/bench/handicap.py" /tmp/train-orig.py train.py --batch "$BATCH" --slow ;;   # base at LR_MULT 1
    lr099) python3 "$REPO/bench/handicap.py" /tmp/train-orig.py train.py --batch "$BATCH" --slow --lr-mult 0.99 ;;
  esac
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
