"""GPU benchmark: the default train.py against its MFU knobs, side by side on the same tokens (not a test).

Each run is its own process (a crash costs one line and the next run goes on). A run is train.py's own setup
(its "auto" micro-batch, attention and compile choices), then a fixed number of optimizer steps with the LR
schedule laid over those steps, so every variant of one batch size sees the same tokens and the same schedule;
step times come from the per-step sync (`loss.item()`), the first UNTIMED steps (compilation) left out. Then
val loss and val_bpb on fixed validation rows with the eager model, scored as the evaluator scores (logits from
`model(idx)`, targets that stand for no bytes left out).

    python bench/bench_mfu.py plan --out DIR [--deadline EPOCH] [--only base@19,plain@19]
    python bench/bench_mfu.py one --label plain --batch 524288 --knobs '{"BF16_RESIDUAL": false}' --record r.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_train import with_knobs  # noqa: E402

# train.py's defaults since 2026-12-07 are FUSED_CE ("auto": on CUDA), RELU2_KEEPS_OUTPUT and BF16_RESIDUAL;
# "plain" is the default before them, so the plan keeps measuring what they are worth
PLAIN = {"FUSED_CE": False, "RELU2_KEEPS_OUTPUT": False, "BF16_RESIDUAL": False}
FP32_RESIDUAL = {"BF16_RESIDUAL": False}                     # the two knobs that keep the plain numerics
# (label, log2 of TOTAL_BATCH_SIZE, knob overrides, extra environment), most informative first: the plan stops
# where the deadline would be passed, so the head of this list is what a short call measures.
PLAN = [
    ("base", 19, {}, {}),
    ("plain", 19, PLAIN, {}),
    ("base", 17, {}, {}),
    ("plain", 17, PLAIN, {}),
    ("base-5090", 19, {}, {"AR_GPU_MEMORY_GB": "32"}),
    ("mb128", 19, {"DEVICE_BATCH_SIZE": 128}, {}),
    ("mb256", 19, {"DEVICE_BATCH_SIZE": 256}, {}),
    ("cdtune", 19, {}, {"TORCHINDUCTOR_COORDINATE_DESCENT_TUNING": "1"}),
    ("fp32_residual", 19, FP32_RESIDUAL, {}),
    ("no_fused_ce", 19, {"FUSED_CE": False}, {}),
    ("no_relu2", 19, {"RELU2_KEEPS_OUTPUT": False}, {}),
    ("flash", 19, {"ATTENTION": "flash"}, {}),               # FlashAttention-2 via SDPA (2.4 points below cuDNN)
    ("plain-5090", 19, PLAIN, {"AR_GPU_MEMORY_GB": "32"}),
]
STEPS = {19: 15, 17: 28}          # optimizer steps per run (UNTIMED of them compile and warm up)
UNTIMED = 3
VAL_ROWS = 256                    # fixed validation rows (× sequence length tokens), the same for every run
COLUMNS = ("run", "batch", "micro", "MFU %", "vs base", "tok/s", "step ms p10/med/p90", "VRAM MB", "GEMM %", "1st step s",
           "train loss", "val loss", "val_bpb", "wall s")


def load_train(path: Path):
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_variant", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module            # dynamo imports a function's module by name when it inlines it
    spec.loader.exec_module(module)
    return module


def measure(label: str, batch: int, knobs: dict, steps: int, untimed: int, val_rows: int,
            profile_steps: int = 1) -> dict:
    """One run of the variant: train.py's setup, `steps` optimizer steps, the eager validation score, then
    (CUDA) one more step under the profiler."""
    import torch

    from autoresearch.harness.data import check_prepared
    from autoresearch.harness.env import RunEnv
    from autoresearch.harness.loader import PackedLoader
    from autoresearch.harness.tokenizer import Tokenizer

    t_start = time.time()
    T = load_train(with_knobs({**knobs, "TOTAL_BATCH_SIZE": batch}))
    env = RunEnv.from_environ()
    torch.manual_seed(env.seed)
    device, gpu_name, mem_limit = T.setup_device(env)
    cuda = device.type == "cuda"
    seq_len = env.profile.seq_len
    tok_dir = check_prepared(env.cache, env.dataset, env.profile.vocab_size)
    cfg = T.make_config(Tokenizer.load(tok_dir).vocab_size, seq_len, env.profile.name)
    model = T.build_model(cfg, device)
    choice = T.resolve_backend(T.ATTENTION, T.COMPILE_MODEL, T.DEVICE_BATCH_SIZE, device_name=gpu_name,
                               cache=env.cache, compile_optimizer=T.COMPILE_OPTIMIZER, seq_len=seq_len)
    attention = choice["attention"] if cuda or T.ATTENTION != "auto" else "math"
    compile_model, compile_opt = bool(choice["compile_model"]) and cuda, bool(choice["compile_optimizer"]) and cuda
    model.set_attention(attention, device.type)
    sizes = T.sizes_for(env.profile.name)                       # as train() does it
    total_batch = sizes["total_batch"]
    rows = total_batch // seq_len
    device_batch = sizes["device_batch"]
    if device_batch == "auto" and choice["source"]["device_batch"] == "probe" and cuda:
        device_batch = choice["device_batch"]
        while rows % device_batch:
            device_batch //= 2
    if device_batch == "auto":
        device_batch = T.fit_device_batch(model, rows, seq_len, attention, mem_limit) if cuda else min(rows, 16)
    device_batch = int(device_batch)
    accum = rows // device_batch
    print(f"{label}: batch {total_batch} = {accum} × {device_batch} × {seq_len}, attention {attention}, compile "
          f"model {compile_model} optimizer {compile_opt}, knobs {knobs}, device {gpu_name}", flush=True)

    optimizer = T.MuonAdamW(model, lr_mult=T.LR_MULT, compile_update=compile_opt)
    step_model = torch.compile(model, dynamic=False) if compile_model else model
    loader = PackedLoader(tok_dir, "train", device_batch, seq_len, device=device, seed=env.seed)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, losses, first_step_s = [], [], None

    def train_step(step: int) -> float:
        for _ in range(accum):
            x, y = next(loader)
            with T.autocast(device.type), T.attention_context(attention):
                loss = step_model(x, y)
            (loss / accum).backward()
        optimizer.step(T.lr_scale(step / steps), T.muon_momentum(step))
        optimizer.zero_grad()
        return loss.item()                                # the per-step sync

    try:
        for step in range(steps):
            t0 = time.time()
            losses.append(train_step(step))
            times.append(time.time() - t0)
            first_step_s = first_step_s or time.time() - t_start
            print(f"step {step + 1}/{steps} loss {losses[-1]:.4f} dt {1000 * times[-1]:.1f} ms", flush=True)
        peak_mb = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
        val_loss, val_bpb, val_tokens = validate(T, model, tok_dir, seq_len, val_rows, device, attention)
        kernels = profile(lambda: train_step(steps - 1)) if cuda and profile_steps else None
    finally:
        loader.close()

    timed = sorted(times[untimed:]) or sorted(times)
    dt = statistics.median(timed)
    peak = T.lookup_peak(gpu_name, override=env.peak_tflops) if cuda else None
    tps = total_batch / dt
    return dict(label=label, batch=total_batch, knobs=knobs, micro=f"{accum}x{device_batch}", steps=steps,
                tokens=steps * total_batch, tokens_per_s=tps,
                mfu=T.mfu_percent(tps, model.flops_per_token(), peak.tflops if peak else None),
                step_ms=[1000 * timed[len(timed) // 10], 1000 * dt, 1000 * timed[(9 * len(timed)) // 10]],
                peak_vram_mb=peak_mb, first_step_s=first_step_s,
                train_loss=statistics.mean(losses[-3:]), losses=losses,
                val_loss=val_loss, val_bpb=val_bpb, val_tokens=val_tokens, kernels=kernels,
                gpu=gpu_name, torch=torch.__version__, wall_s=time.time() - t_start)


def validate(T, model, tok_dir: Path, seq_len: int, val_rows: int, device, attention: str):
    """(val loss, val_bpb, tokens) of the eager model on fixed rows, 32 rows per call like the evaluator."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from autoresearch.harness.loader import PackedLoader

    token_bytes = torch.from_numpy(np.load(tok_dir / "token_bytes.npy").astype(np.int64)).to(device)
    nats, nbytes, ntok = 0.0, 0, 0
    per_call = min(32, val_rows)
    with PackedLoader(tok_dir, "val", per_call, seq_len, device=device, seed=0, shuffle=False) as val:
        for _ in range(val_rows // per_call):
            x, y = next(val)
            with torch.no_grad(), T.autocast(device.type), T.attention_context(attention):
                logits = model(x)
            ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")
            b = token_bytes[y.flatten()]
            nats += float((ce * (b > 0)).sum())
            nbytes, ntok = nbytes + int(b.sum()), ntok + int((b > 0).sum())
    return nats / max(1, ntok), nats / (math.log(2) * nbytes) if nbytes else None, ntok


def profile(step) -> dict | None:
    """GPU time of one more optimizer step by kernel group (profile_step.py's groups) and the top kernels."""
    import torch
    from collections import defaultdict

    from profile_step import group

    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        totals = defaultdict(float)
        for e in prof.key_averages():
            us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if us and e.key and not e.key.startswith("ProfilerStep"):
                totals[e.key] += us
        whole = sum(totals.values()) or 1.0
        groups = defaultdict(float)
        for k, us in totals.items():
            groups[group(k)] += us
        top = sorted(totals.items(), key=lambda kv: -kv[1])[:12]
        out = dict(step_ms=whole / 1000, groups={g: round(100 * us / whole, 1) for g, us in
                                                 sorted(groups.items(), key=lambda kv: -kv[1])},
                   top=[(round(100 * us / whole, 2), round(us / 1000, 2), k[:100]) for k, us in top])
        print("profile: " + ", ".join(f"{g} {s}%" for g, s in out["groups"].items()), flush=True)
        for share, ms, k in out["top"]:
            print(f"  {share:6.2f}%  {ms:8.2f} ms  {k}", flush=True)
        return out
    except Exception as e:  # a profiler that fails must not cost the run's figures
        print(f"profile failed: {type(e).__name__}: {e}", flush=True)
        return None


def one(args) -> int:
    try:
        record = measure(args.label, args.batch, json.loads(args.knobs), args.steps, args.untimed, args.val_rows,
                         args.profile)
    except Exception as e:  # the record says what failed; the plan goes on
        import traceback
        traceback.print_exc()
        msg = str(e).strip().splitlines()
        record = dict(label=args.label, batch=args.batch, error=f"{type(e).__name__}: {msg[0] if msg else ''}"[:300])
    Path(args.record).write_text(json.dumps(record))
    print("RECORD " + json.dumps({k: v for k, v in record.items() if k != "losses"}), flush=True)
    return 1 if "error" in record else 0


def last_line(path: Path) -> str:
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()] if path.exists() else []
    errs = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errs or lines or ["(no output)"])[-1][:300]


def plan(args) -> int:
    out = Path(args.out)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    only = set(filter(None, args.only.split(",")))
    (out / "runs.log").write_text("")
    results, est = [], {}
    for label, log2, knobs, env_extra in PLAN:
        name = f"{label}@{log2}"
        if only and name not in only:
            continue
        guess = est.get(log2, max(est.values(), default=args.guess))
        left = args.deadline - time.time()
        if left < guess:
            print(f"{name}: skipped, {left:.0f} s left before the deadline and a run takes about {guess:.0f} s",
                  flush=True)
            results.append(dict(label=label, batch=2**log2, error=f"skipped (deadline, {left:.0f} s left)"))
            continue
        log, record = work / f"{name}.log", work / f"{name}.json"
        record.unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "one", "--label", label, "--batch", str(2**log2),
               "--knobs", json.dumps(knobs), "--steps", str(args.steps or STEPS[log2]), "--untimed", str(UNTIMED),
               "--val-rows", str(VAL_ROWS), "--record", str(record)]
        env = dict(os.environ, PYTHONUNBUFFERED="1", **env_extra)
        env["PYTHONPATH"] = f"{ROOT}:{env.get('PYTHONPATH', '')}"
        t0 = time.time()
        with open(log, "w") as f:
            f.write(f"$ {' '.join(env_extra and [f'{k}={v}' for k, v in env_extra.items()] or [])} {' '.join(cmd)}\n")
            f.flush()
            try:
                rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                    timeout=max(30.0, args.deadline - time.time() + 15)).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        wall = time.time() - t0
        with open(out / "runs.log", "a") as f:
            f.write(f"===== {name} ({wall:.0f} s)\n{log.read_text(errors='replace')}\n")
        est[log2] = max(est.get(log2, 0.0), wall)
        r = json.loads(record.read_text()) if record.exists() else \
            dict(label=label, batch=2**log2, error=f"exit {rc}: {last_line(log)}")
        r["name"], r["env"] = name, env_extra
        results.append(r)
        print(f"{name}: {'ERROR ' + r['error'] if 'error' in r else 'ok'} ({wall:.0f} s)"
              + ("" if "error" in r else f"  MFU {r['mfu'] or float('nan'):.1f} %  {r['tokens_per_s']:,.0f} tok/s  "
                 f"micro {r['micro']}  val {r['val_loss']:.4f}"), flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    table = format_table(results)
    (out / "table.txt").write_text(table + "\n")
    print("\n" + table, flush=True)
    return 0


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_table(results: list[dict]) -> str:
    rows = [COLUMNS]
    base = {(r["label"], r["batch"]): r["mfu"] for r in results if r.get("mfu") is not None}
    for r in results:
        batch = f"2**{int(math.log2(r['batch']))}" if r.get("batch") else "-"
        if "error" in r:
            rows.append((r["label"], batch, r["error"]))
            continue
        ms = "/".join(f"{v:.0f}" for v in r["step_ms"])
        ref = base.get(("base-5090" if "5090" in r["label"] else "base", r["batch"]))
        delta = None if ref is None or r["mfu"] is None else r["mfu"] - ref
        rows.append((r["label"], batch, r["micro"], fmt(r["mfu"], ".1f"), fmt(delta, "+.1f"),
                     fmt(r["tokens_per_s"], ",.0f"), ms,
                     fmt(r["peak_vram_mb"], ",.0f"), fmt((r.get("kernels") or {}).get("groups", {}).get("gemm"), ".1f"),
                     fmt(r["first_step_s"], ".1f"), fmt(r["train_loss"], ".4f"),
                     fmt(r["val_loss"], ".4f"), fmt(r["val_bpb"], ".4f"), fmt(r["wall_s"], ".0f")))
    widths = [max(len(str(row[i])) for row in rows if len(row) == len(COLUMNS)) for i in range(len(COLUMNS))]
    lines = []
    for row in rows:
        if len(row) == len(COLUMNS):
            lines.append("  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
        else:
            lines.append(f"{row[0].ljust(widths[0])}  {row[1].rjust(widths[1])}  {row[2]}")
    tokens = {r["batch"]: r["tokens"] for r in results if "tokens" in r}
    lines.append("losses after the same tokens per batch size: " +
                 ", ".join(f"2**{int(math.log2(b))}: {t / 1e6:.1f} M" for b, t in sorted(tokens.items())))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/mfu-runs")
    p.add_argument("--deadline", type=float, default=time.time() + 280, help="epoch seconds to finish by")
    p.add_argument("--guess", type=float, default=50.0, help="seconds a run takes until one has been timed")
    p.add_argument("--only", default="", help="comma list of NAME@LOG2 (base@19,plain@17)")
    p.add_argument("--steps", type=int, default=0, help="optimizer steps per run (0: the plan's)")
    o = sub.add_parser("one")
    o.add_argument("--label", required=True)
    o.add_argument("--batch", type=int, required=True)
    o.add_argument("--knobs", default="{}")
    o.add_argument("--steps", type=int, default=15)
    o.add_argument("--untimed", type=int, default=UNTIMED)
    o.add_argument("--val-rows", type=int, default=VAL_ROWS)
    o.add_argument("--record", required=True)
    o.add_argument("--profile", type=int, default=1, help="1: profile one more step after validation (CUDA)")
    args = ap.parse_args()
    return plan(args) if args.cmd == "plan" else one(args)


if __name__ == "__main__":
    sys.exit(main())
