"""What the trusted evaluation costs on a GPU, against scoring in the training process (run on the GPU host; not a
test).

1. Train the real train.py once at TOTAL_BATCH_SIZE 2**19 for --budget seconds, straight into a checkpoint.
2. In-process: that model loaded here, cross-entropy over the same evaluation tokens in the same batch shape
   (what train.py used to do at its end). Seconds, median of --repeat.
3. Trusted: a session evaluator (`python -I -B -m autoresearch.harness.evaluator serve`), the request sent
   ahead (as the runner does when training starts), then "go" -> "done": seconds after go, median of --repeat;
   with the record's causal / purity differences and the transfer mode (CUDA IPC or host).
4. End to end: the loop (`Loop`) running the real train.py: the baseline and one knob change; per experiment
   ar's wall time, training seconds, and the gap between two training windows.

    python bench/bench_eval.py --dataset builtin-site --budget 20 --out eval.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train_once(tok_dir: Path, ckpt: Path, budget: float, dataset: str, extra_env: dict) -> float:
    env = dict(os.environ, AR_TIME_BUDGET=str(budget), AR_PROFILE="gpu", AR_DATASET=dataset, AR_TOK_DIR=str(tok_dir),
               AR_CHECKPOINT_DIR=str(ckpt), PYTHONUNBUFFERED="1", **extra_env)
    t0 = time.time()
    out = subprocess.run([sys.executable, str(ROOT / "train.py")], cwd=ROOT, env=env, capture_output=True, text=True)
    print(out.stdout[-1500:], out.stderr[-3000:], flush=True)
    assert out.returncode == 0, "training failed"
    return time.time() - t0


def in_process(tok_dir: Path, ckpt: Path, rows: int, seq_len: int, eval_tokens: int, repeat: int) -> dict:
    import importlib.util

    import numpy as np
    import torch
    from safetensors.torch import load_model

    from autoresearch.harness import checkpoint
    from autoresearch.harness.evaluator import _batches
    spec = importlib.util.spec_from_file_location("train_bench", ROOT / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    meta = checkpoint.read_meta(ckpt)
    batches = _batches(tok_dir, rows, seq_len, eval_tokens)
    token_bytes = torch.from_numpy(np.load(tok_dir / "token_bytes.npy").astype(np.int64)).cuda()
    times, bpb = [], None
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.time()
        model = mod.model_from_config(meta["config"])
        load_model(model, str(ckpt / checkpoint.WEIGHTS))
        model = model.cuda().eval()
        nats = torch.zeros((), dtype=torch.float64, device="cuda")
        nbytes = torch.zeros((), dtype=torch.int64, device="cuda")
        left = eval_tokens
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for x, y in batches:
                x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
                logits = model(x).float()
                nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
                w = token_bytes[y].flatten()
                if left < w.numel():
                    w = w * (torch.arange(w.numel(), device="cuda") < left)
                nats += torch.where(w > 0, nll.double(), 0.0).sum()
                nbytes += w.sum()
                left -= min(left, w.numel())
        bpb = nats.item() / (math.log(2) * nbytes.item())
        times.append(time.time() - t0)
        del model
    return {"seconds": times, "median_s": statistics.median(times), "val_bpb": bpb}


def trusted(tok_dir: Path, ckpt: Path, rows: int, seq_len: int, eval_tokens: int, repeat: int, sandbox: bool,
            dataset: str, fresh: bool = True) -> dict:
    """`fresh`: with the fresh worker's re-score of a secret sample (what ar does), or without (the cost of it)."""
    from autoresearch.experiment.evaluate import fresh_job, worker_policy
    from autoresearch.experiment.execute import Workspace
    from autoresearch.harness.evaluator import manifest
    from autoresearch.harness.sandbox import give_to_sandbox
    work = Path(tempfile.mkdtemp(prefix="ar-bench-eval-"))
    ws = Workspace.at(work)
    ws.src.mkdir(parents=True)
    ws.job.mkdir(parents=True)
    shutil.copy(ROOT / "train.py", ws.src / "train.py")
    shutil.copytree(ckpt, ws.checkpoint)
    give_to_sandbox(ws.src, ws.checkpoint, ws.job)          # as make_workspace does (root: the worker is nobody)
    man = manifest(tok_dir)
    log = open(work / "evaluator.log", "ab")
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "CUDA_VISIBLE_DEVICES", "NCCL_NVLS_ENABLE",
                                                         "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")}
    proc = subprocess.Popen([sys.executable, "-I", "-B", "-m", "autoresearch.harness.evaluator", "serve"], cwd="/",
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1)
    runs = []
    for i in range(1, repeat + 1):
        record = work / f"record-{i}.json"
        doc = {"id": i, "tok_dir": str(tok_dir), "dataset": dataset, "seq_len": seq_len, "eval_tokens": eval_tokens,
               "holdout_tokens": 0, "rows": rows, "device": "cuda", "manifest": man, "checkpoint": str(ws.checkpoint),
               "source": str(ws.src), "train_file": "train.py", "job_dir": str(ws.job), "record": str(record),
               "private": str(work / "private.json"), "timeout": 300, "sandbox": sandbox,
               "policy": worker_policy(ws), "tolerance": 2e-3}
        if fresh:
            doc.update(fresh_job_dir=str(fresh_job(ws)), fresh_policy=worker_policy(ws, fresh_job(ws)), fresh_rows=rows)
        t_sub = time.time()
        proc.stdin.write(json.dumps(doc) + "\n")
        proc.stdin.flush()
        time.sleep(8)                      # the runner sends the request when training starts: let it get ready
        t0 = time.time()
        proc.stdin.write(f"go {i}\n")
        proc.stdin.flush()
        line = proc.stdout.readline().strip()
        after_go = time.time() - t0
        rec = json.loads(record.read_text())
        runs.append({"after_go_s": after_go, "since_submit_s": time.time() - t_sub, "line": line, "record": rec})
        print(json.dumps(runs[-1]), flush=True)
    proc.stdin.close()
    proc.wait(timeout=60)
    log.close()
    tail = (work / "evaluator.log").read_text()[-3000:]
    return {"runs": runs, "median_after_go_s": statistics.median(r["after_go_s"] for r in runs), "log_tail": tail}


def loop_end_to_end(budget: float, dataset: str, sandbox: bool) -> dict:
    from autoresearch.config import RunConfig
    from autoresearch.records.ledger import read_results
    from autoresearch.session.loop import Loop
    repo = Path(tempfile.mkdtemp(prefix="ar-bench-loop-"))
    shutil.copy(ROOT / "train.py", repo / "train.py")
    (repo / ".gitignore").write_text("runs/\n")
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "start"]):
        subprocess.run(["git", "-c", "user.name=b", "-c", "user.email=b@b", *args], cwd=repo, check=True)
    cfg = RunConfig(profile="gpu", time_budget=budget, dataset=dataset, prepare_data=False, sandbox=sandbox,
                    noise=0.002)
    events = []
    t0 = time.time()
    loop = Loop(cfg, repo, "bench", None, on_event=lambda e: events.append((time.time() - t0, e.kind, e.message)))
    with loop:
        loop.enqueue_knobs({"WARMDOWN_RATIO": 0.6}, description="warmdown 0.6")
        loop.run()
    rows = read_results(repo / "runs" / "bench" / "results.tsv")
    return {"wall_s": time.time() - t0,
            "rows": [{"status": r.status.value, "val_bpb": r.val_bpb, "training_seconds": r.training_seconds,
                      "total_seconds": r.total_seconds, "mfu": r.mfu, "reason": r.reason} for r in rows],
            "events": [(round(t, 1), k, m[:100]) for t, k, m in events if k != "step"]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default="builtin-site")
    ap.add_argument("--budget", type=float, default=20)
    ap.add_argument("--eval-tokens", type=int, default=10 * 2**20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="eval.json")
    ap.add_argument("--skip-loop", action="store_true")
    ap.add_argument("--no-sandbox", action="store_true", help="measure without Landlock (marks nothing: a bench)")
    ap.add_argument("--fresh", choices=("on", "off", "both"), default="both",
                    help="the fresh worker's re-score of a secret sample: with it (ar's), without, or both (its cost)")
    args = ap.parse_args()
    from autoresearch.harness import sandbox
    from autoresearch.harness.data import check_prepared
    from autoresearch.harness.env import default_cache, resolve_profile
    prof = resolve_profile("gpu")
    tok_dir = check_prepared(default_cache(), args.dataset, prof.vocab_size)
    ok, why = sandbox.available()
    ok = ok and not args.no_sandbox
    result = {"sandbox": ok, "sandbox_note": why, "eval_tokens": args.eval_tokens}
    import torch
    result["gpu"], result["torch"] = torch.cuda.get_device_name(0), torch.__version__
    ckpt = Path(tempfile.mkdtemp(prefix="ar-bench-ckpt-"))
    result["train_s"] = train_once(tok_dir, ckpt, args.budget, args.dataset, {})
    rows = 2**16 // prof.seq_len
    result["in_process"] = in_process(tok_dir, ckpt, rows, prof.seq_len, args.eval_tokens, args.repeat)
    print("in-process", json.dumps(result["in_process"]), flush=True)
    if args.fresh in ("off", "both"):
        result["trusted_no_fresh"] = trusted(tok_dir, ckpt, rows, prof.seq_len, args.eval_tokens, args.repeat, ok,
                                             args.dataset, fresh=False)
    if args.fresh in ("on", "both"):
        result["trusted"] = trusted(tok_dir, ckpt, rows, prof.seq_len, args.eval_tokens, args.repeat, ok,
                                    args.dataset, fresh=True)
    main_run = result.get("trusted") or result["trusted_no_fresh"]
    result["overhead_s"] = main_run["median_after_go_s"] - result["in_process"]["median_s"]
    if "trusted" in result and "trusted_no_fresh" in result:
        result["fresh_rescore_s"] = (result["trusted"]["median_after_go_s"]
                                     - result["trusted_no_fresh"]["median_after_go_s"])
        print("fresh re-score", result["fresh_rescore_s"], flush=True)
    print("overhead", result["overhead_s"], flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    if not args.skip_loop:
        result["loop"] = loop_end_to_end(args.budget, args.dataset, ok)
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("trusted", "trusted_no_fresh")}, indent=1)[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
