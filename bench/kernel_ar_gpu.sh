#!/usr/bin/env bash
# `ar run` on the kernel example on a GPU, end to end: the scripted agent proposes a correct speed-up, a wrong
# result and a cheat. Usage (repo root, on the GPU host): bash bench/kernel_ar_gpu.sh OUT_DIR
set -uo pipefail
out=${1:-/tmp/kernel-ar}; mkdir -p "$out"
source bench/gpu_setup.sh          # the carried wheels and this package; machine, python, torch
w=$(mktemp -d)/kern; cp -r examples/kernel "$w"; cd "$w"
printf 'runs/\n__pycache__/\n' > .gitignore
git init -q && git -c user.name=t -c user.email=t@t add -A && git -c user.name=t -c user.email=t@t commit -qm base
plan='{"2": "speedup", "3": "wrong", "4": "skip"}'
agent="python3 $OLDPWD/tests/fixtures/agents/kernel_agent.py '$plan' {prompt_file}"
/usr/bin/time -f "ar run: %e s" python3 -m autoresearch run --config ar.yaml --tag gpu --max-experiments 4 --agent "$agent" 2>&1 | tee "$out/run.txt"
python3 -m autoresearch report 2>&1 | tee "$out/report.txt"
cut -f1-5,12,13,17 runs/gpu/results.tsv | tee "$out/results.tsv"
for d in runs/gpu/0*; do echo "== $d"; cat "$d/record.json" 2>/dev/null; tail -2 "$d/train.log" 2>/dev/null; done > "$out/records.txt"
