"""Where one training step's GPU time goes: torch.profiler over a few steps of the default model.

    python bench/profile_step.py --rows 128 --compile 1 [--knobs '{"FUSED_CE": true, "RELU2_KEEPS_OUTPUT": true}']
Prints the top kernels and a grouping (GEMM, attention, fused elementwise, embedding, optimizer, other).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def load_train():
    spec = importlib.util.spec_from_file_location("train", ROOT / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def group(name: str) -> str:
    n = name.lower()
    if "gemm" in n or "cutlass" in n or "sm90_xmma" in n or "nvjet" in n or "matmul" in n:
        return "gemm"
    if "fmha" in n or "flash" in n or "cudnn" in n or "attention" in n or "sdpa" in n:
        return "attention"
    if "embedding" in n or "index" in n or "sort" in n or "scatter" in n or "segment" in n or "radix" in n:
        return "embedding/index"
    if "adam" in n or "foreach" in n or "multi_tensor" in n:
        return "optimizer"
    if n.startswith("triton"):
        return "triton fused"
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--compile", type=int, default=1)
    ap.add_argument("--attention", default="cudnn")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-ve", action="store_true", help="value embeddings off")
    ap.add_argument("--mode", default=None, help="torch.compile mode")
    ap.add_argument("--knobs", default="{}", help='train.py knobs to set, JSON: \'{"FUSED_CE": true}\'')
    args = ap.parse_args()
    train = load_train()
    if args.no_ve:
        train.VALUE_EMBEDS = False
    for name, value in json.loads(args.knobs).items():
        assert hasattr(train, name), name
        setattr(train, name, value)
    cfg = train.make_config(8192, 2048, "gpu")
    model = train.build_model(cfg, "cuda")
    model.set_attention(args.attention, "cuda")
    opt = train.MuonAdamW(model, lr_mult=1.0, compile_update=True)
    step_model = torch.compile(model, dynamic=False, mode=args.mode) if args.compile else model
    data = torch.randint(0, 8192, (args.rows, 2049), device="cuda")

    def step():
        with train.autocast("cuda"), train.attention_context(args.attention):
            loss = step_model(data[:, :-1], data[:, 1:])
        loss.backward()
        opt.step(1.0, 0.9)
        opt.zero_grad()
        return loss

    for _ in range(8):
        step()
    torch.cuda.synchronize()
    t0 = time.time()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    dt = (time.time() - t0) / 5
    tps = args.rows * 2048 / dt
    print(f"rows {args.rows} compile {args.compile} mode {args.mode} ve {not args.no_ve} attention {args.attention}: {dt * 1000:.1f} ms/step, "
          f"{tps:,.0f} tok/s, MFU {100 * tps * model.flops_per_token() / 989.5e12:.1f}% (H100/H200 peak)")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    totals, groups = defaultdict(float), defaultdict(float)
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t and e.key and not e.key.startswith("ProfilerStep"):
            totals[e.key] += t
    whole = sum(totals.values()) or 1
    for k, t in totals.items():
        groups[group(k)] += t
    print("group shares of GPU time:", ", ".join(f"{g} {100 * t / whole:.1f}%" for g, t in
                                                 sorted(groups.items(), key=lambda x: -x[1])))
    for k, t in sorted(totals.items(), key=lambda x: -x[1])[:22]:
        print(f"{100 * t / whole:6.2f}%  {t / args.steps / 1000:8.2f} ms/step  {k[:110]}")


if __name__ == "__main__":
    main()
