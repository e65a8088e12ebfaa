"""The evaluation's forward pass, as the model worker runs it, eager and compiled (issue 39: evaluation ≤ 4 s).

The worker builds the model with train.py's factory and calls it on 2^16 tokens a call, in bf16 autocast under
no_grad, eager. This measures, each series in a fresh process on the same random weights' shapes:
  eager          the worker as it is: ms per call (median), and the first call;
  compiled cold  torch.compile(model) with empty inductor/Triton caches: the first call (the compile) and ms per call;
  compiled warm  the same again in a new process on the caches the cold one filled (a store hit);
  cold, 1 thread compiled with empty caches of its own and one compile thread (the sandboxed worker's setting);
and, with --kernels, the eager forward's ten costliest CUDA kernels (torch.profiler), to see where it goes.
Every series scores one call's logits against fixed random targets as the evaluator does (per-token
cross-entropy), on the same perturbed weights (every block active, not the identity of the init): each compiled
series says how far its per-token losses are from the eager ones (`vs_eager`: max and mean |Δ| in nats), the
figure to hold against the evaluator's 1e-3 tolerance if a compiled worker were re-scored by an eager one.

    python3 bench/bench_eval_forward.py [--train train.py --rows 32 --seq 2048 --repeat 10 --kernels]
                                        [--knobs '{"BF16_RESIDUAL": true}']      (train.py knobs set first)
                                        [--series eager,cold]     (of eager,cold,warm,one; warm needs cold)
On a CPU it runs the cpu profile's model at a small shape (a check that it runs; the figures are the GPU's).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(a) -> dict:
    import torch
    spec = importlib.util.spec_from_file_location("ar_proposal", a.train)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ar_proposal"] = mod
    spec.loader.exec_module(mod)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    cfg = dataclasses.asdict(mod.make_config(a.vocab, a.seq, "gpu" if cuda else "cpu"))
    torch.manual_seed(0)
    with torch.device(device):
        model = mod.model_from_config(cfg)
    with torch.no_grad():                        # every block active: the init's zero projections compare nothing
        gen = torch.Generator(device=device).manual_seed(1)
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen, device=device))
    model = model.eval()
    fwd = torch.compile(model, dynamic=False) if a.mode != "eager" else model
    gen = torch.Generator(device=device).manual_seed(2)
    x = torch.randint(0, a.vocab, (a.rows, a.seq), device=device, generator=gen)
    y = torch.randint(0, a.vocab, (a.rows, a.seq), device=device, generator=gen)
    ctx = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else (lambda: torch.autocast("cpu", enabled=False))
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def call():
        with torch.no_grad(), ctx():
            return fwd(x)

    t = time.perf_counter()
    logits = call()
    sync()
    first = time.perf_counter() - t
    losses = torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), y.flatten(), reduction="none")
    torch.save(losses.double().cpu(), a.save)
    del logits
    times = []
    for _ in range(a.repeat):
        sync()
        t = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - t)
    out = {"mode": a.mode, "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "tokens_per_call": a.rows * a.seq, "first_call_s": round(first, 3),
           "ms_per_call": {"min": round(min(times) * 1e3, 2), "median": round(statistics.median(times) * 1e3, 2),
                           "max": round(max(times) * 1e3, 2)}}
    if a.kernels and cuda and a.mode == "eager":
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            sync()
        rows = sorted((e for e in prof.key_averages() if e.device_time_total > 0),
                      key=lambda e: e.device_time_total, reverse=True)
        total = sum(e.device_time_total for e in rows)
        out["kernels"] = [{"name": e.key[:90], "calls": e.count, "ms": round(e.device_time_total / 1e3, 3),
                           "share": round(e.device_time_total / total, 3)} for e in rows[:10]]
        out["kernel_ms"] = round(total / 1e3, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", default="train.py")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--knobs", default="", help='train.py knobs to set first, JSON: \'{"BF16_RESIDUAL": true}\'')
    ap.add_argument("--series", default="eager,cold,warm,one", help="which series, in order (warm needs cold)")
    ap.add_argument("--mode", help=argparse.SUPPRESS)       # a child's series
    ap.add_argument("--save", help=argparse.SUPPRESS)       # where a child leaves its per-token losses
    a = ap.parse_args()
    if a.mode:
        print(json.dumps(child(a)))
        return
    train, knobs = Path(a.train).resolve(), json.loads(a.knobs) if a.knobs else None
    if knobs:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_train import with_knobs
        train = with_knobs(knobs)
    base = [sys.executable, __file__, "--train", str(train), "--rows", str(a.rows), "--seq",
            str(a.seq), "--vocab", str(a.vocab), "--repeat", str(a.repeat)] + (["--kernels"] if a.kernels else [])
    import torch
    with tempfile.TemporaryDirectory(prefix="ar-eval-fwd-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor", "TRITON_CACHE_DIR": f"{cache}/triton"}
        # "cold, 1 thread": empty caches of its own and one compile thread, as the sandboxed worker compiles on a GPU
        one = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{cache}/one/inductor",
               "TRITON_CACHE_DIR": f"{cache}/one/triton", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
        wanted, eager = set(a.series.split(",")), None
        for key, mode, series_env in (("eager", "eager", env), ("cold", "cold", env), ("warm", "warm", env),
                                      ("one", "cold, 1 thread", one)):
            if key not in wanted:
                continue
            t = time.perf_counter()
            save = f"{cache}/losses-{mode.replace(' ', '').replace(',', '-')}.pt"
            p = subprocess.run(base + ["--mode", mode, "--save", save], env=series_env, capture_output=True, text=True)
            if p.returncode:
                print(json.dumps({"mode": mode, "error": p.stderr.strip().splitlines()[-1:]}))
                continue
            doc = json.loads(p.stdout.strip().splitlines()[-1])
            doc["process_s"] = round(time.perf_counter() - t, 2)
            if mode == "eager":
                eager = torch.load(save)
            elif eager is not None:
                d = (torch.load(save) - eager).abs()
                doc["vs_eager"] = {"max_abs_nats": float(d.max()), "mean_abs_nats": float(d.mean())}
            if knobs:
                doc["knobs"] = knobs
            print(json.dumps(doc))


if __name__ == "__main__":
    main()
