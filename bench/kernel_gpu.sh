#!/usr/bin/env bash
# The kernel example on a GPU: the gate, then the timing harness, for several kernel.py variants, side by side
# in one session. Usage (repo root): bash bench/kernel_gpu.sh OUT_DIR
set -u
out=${1:-/tmp/kernel-gpu}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}       # ar's sandbox for the candidate's worker
py=${PYTHON:-python3}
$py -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$out/env.txt"
run_variant() {   # name, then a python snippet that edits kernel.py in the copy
  local name=$1 edit=$2 d; d=$(mktemp -d); cp -r examples/kernel/. "$d"
  (cd "$d" && $py -c "$edit" && { $py check.py > gate.txt 2>&1; echo "gate_exit=$?" >> gate.txt; }
   for i in 1 2; do $py bench.py 2>>bench.err | tail -1; done > bench.txt)
  echo "== $name"; cat "$d/gate.txt" "$d/bench.txt"; tail -3 "$d/bench.err" 2>/dev/null
  { echo "== $name"; cat "$d/gate.txt" "$d/bench.txt"; } >> "$out/kernel.txt"
}
knob='import re,sys;p="kernel.py";s=open(p).read();s=re.sub(r"^{k} = \d+", "{k} = {v}", s, flags=re.M);open(p,"w").write(s)'
for b in 64 256 1024 4096; do
  run_variant "triton-block$b" "$(echo "$knob" | sed "s/{k}/BLOCK_V/g; s/{v}/$b/")"
done
run_variant "triton-block1024-warps8" "$(echo "$knob" | sed "s/{k}/BLOCK_V/g; s/{v}/1024/")
s=open(p).read();s=s.replace('NUM_WARPS = 4 ','NUM_WARPS = 8 ');open(p,'w').write(s)"
eager='p="kernel.py";s=open(p).read();s+="""

def softcap_ce(logits, targets, cap):   # eager PyTorch: what one writes first
    z = cap * torch.tanh(logits.float() / cap)
    return torch.logsumexp(z, dim=-1) - z.gather(1, targets[:, None]).squeeze(1)
""";open(p,"w").write(s)'
run_variant "torch-eager" "$eager"
run_variant "torch-compile" "${eager%;open*};s+='\nsoftcap_ce = torch.compile(softcap_ce, dynamic=True)\n';open(p,'w').write(s)"
