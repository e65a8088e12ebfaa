"""The second-round trust path on a GPU host (run there as root; not a test): does a sandboxed process that
dropped to `nobody` in its own namespaces start CUDA, and do torch.compile's worker processes; does the
evaluator's CUDA IPC work (each model worker's buffers made by a buffer owner of its own; each record's
`transfer` is "ipc", or "host" with the reason in `transfer_note`); what does the fresh worker's re-score cost. Needs only torch, numpy and safetensors (no prepared corpus: a hand-made random split).

    python bench/diag_trust_gpu.py --eval-tokens 10485760 --repeat 3 --leads 0 5 --out trust.json

Each lead is a separate series: 0 is "go" only (the workers start at the checkpoint), 5 is "prestart" 5 s before it.
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

ROOT = Path(__file__).resolve().parents[1]


def handmade_split(tok: Path, vocab: int, tokens: int) -> None:
    """Random documents of 1000 tokens ([BOS=0] + 999 ids), random byte counts per token: the evaluator's cost
    does not depend on what the text is."""
    import numpy as np
    from autoresearch.harness import data
    tok.mkdir(parents=True)
    rng = np.random.default_rng(0)
    meta = {"format": data.FORMAT, "bos_id": 0, "n_vocab": vocab, "vocab_size": vocab}
    for split, n in (("val", tokens), ("train", 1 << 20)):
        docs = n // 1000
        ids = rng.integers(1, vocab, docs * 1000, dtype=np.uint16)
        ids[::1000] = 0
        ids.tofile(tok / f"{split}.bin")
        np.save(tok / f"{split}.idx.npy", np.arange(0, docs * 1000 + 1, 1000, dtype=np.int64))
        meta[split] = {"docs": docs, "tokens": docs * 1000}
    tb = rng.integers(1, 5, vocab).astype(np.int32)
    tb[0] = 0
    np.save(tok / "token_bytes.npy", tb)
    (tok / "tokenizer.json").write_text("{}")
    (tok / "meta.json").write_text(json.dumps(meta))


def sandboxed_cuda(work: Path) -> dict:
    """A sandboxed process (as ar starts training) initialises CUDA and runs torch.compile with worker processes."""
    from autoresearch.harness import sandbox
    scratch = work / "scratch"
    scratch.mkdir()
    sandbox.give_to_sandbox(scratch)
    policy = sandbox.base_policy()
    policy["write"] += [str(scratch)]
    (work / "policy.json").write_text(json.dumps(policy))
    code = ("import os, torch, time\n"
            "t=time.time(); x=torch.randn(256,256,device='cuda'); torch.cuda.synchronize()\n"
            "f=torch.compile(lambda a: (a @ a).relu().sum(), dynamic=False)\n"
            "print('uid', os.getuid(), 'cuda ok', float(f(x)), 'compile ok', round(time.time()-t,1), flush=True)\n")
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH",
                                                         "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                         "NVSHMEM_DISABLE_NVLS")}
    env.update(HOME=str(scratch), TMPDIR=str(scratch), TORCHINDUCTOR_CACHE_DIR=str(scratch / "inductor"),
               TRITON_CACHE_DIR=str(scratch / "triton"))
    t0 = time.time()
    r = subprocess.run([sys.executable, "-I", "-B", "-m", "autoresearch.harness.sandbox", str(work / "policy.json"),
                        "--", sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    return {"rc": r.returncode, "out": r.stdout[-500:], "err": r.stderr[-1500:], "seconds": round(time.time() - t0, 1)}


def checkpoint_of_train_py(ckpt: Path, vocab: int) -> None:
    from autoresearch.harness import checkpoint
    spec = importlib.util.spec_from_file_location("train_diag", ROOT / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = mod.make_config(vocab, 2048, "gpu")
    model = mod.model_from_config(dataclasses.asdict(cfg))
    checkpoint.save(ckpt, factory="model_from_config", config=dataclasses.asdict(cfg), model=model)


BUSY = """
import sys, time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
with open(sys.argv[1], "w", buffering=1) as f:
    while True:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
        f.write(f"{time.time()}\\n")
"""


def busy_ms(marks: list[float], a: float, b: float) -> float | None:
    """The training stand-in's median iteration (10 bf16 8192^3 products) between wall times a and b, in ms."""
    gaps = [(y - x) * 1000 for x, y in zip(marks, marks[1:]) if a <= x and y <= b]
    return round(statistics.median(gaps), 2) if gaps else None


def evaluate(work: Path, tok: Path, ckpt: Path, eval_tokens: int, repeat: int, lead: float, busy: Path,
             device: str = "cuda", rows: int = 2**16 // 2048) -> dict:
    """`repeat` evaluations of one checkpoint as the runner asks for them on a GPU: the request when "training"
    starts, "prestart" `lead` s before its 8-s window ends (none with lead 0), then "go". A GPU-bound stand-in
    for training runs all along: its speed in the lead's seconds says what the pre-start costs a window."""
    from autoresearch.experiment.evaluate import fresh_job, worker_policy
    from autoresearch.experiment.execute import Workspace
    from autoresearch.harness.evaluator import manifest
    from autoresearch.harness.sandbox import give_to_sandbox
    import shutil
    ws = Workspace.at(work / f"ws-lead{lead:g}")
    for d in (ws.src, ws.job):
        d.mkdir(parents=True)
    shutil.copy(ROOT / "train.py", ws.src / "train.py")
    shutil.copytree(ckpt, ws.checkpoint)
    give_to_sandbox(ws.src, ws.checkpoint, ws.job)
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "CUDA_VISIBLE_DEVICES", "NCCL_NVLS_ENABLE",
                                                         "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")}
    log = open(work / "evaluator.log", "ab")
    proc = subprocess.Popen([sys.executable, "-I", "-B", "-m", "autoresearch.harness.evaluator", "serve"], cwd="/",
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1)
    runs = []
    window = 8.0
    for i in range(1, repeat + 1):
        record = ws.root / f"record-{i}.json"
        doc = {"id": i, "tok_dir": str(tok), "dataset": "diag", "seq_len": 2048, "eval_tokens": eval_tokens,
               "holdout_tokens": 0, "rows": rows, "device": device, "manifest": manifest(tok),
               "checkpoint": str(ws.checkpoint), "source": str(ws.src), "train_file": "train.py",
               "job_dir": str(ws.job), "record": str(record), "private": str(ws.root / "private.json"),
               "timeout": 300, "sandbox": True, "policy": worker_policy(ws), "tolerance": 2e-3,
               "fresh_job_dir": str(fresh_job(ws)), "fresh_policy": worker_policy(ws, fresh_job(ws)), "fresh_rows": rows}
        proc.stdin.write(json.dumps(doc) + "\n")
        proc.stdin.flush()
        t_req = time.time()
        t_lead = t_req + window - (lead or 5.0)   # without a pre-start: the same seconds, for the control
        time.sleep(max(0.0, t_lead - time.time()))
        if lead:
            proc.stdin.write(f"prestart {i}\n")
            proc.stdin.flush()
        time.sleep(max(0.0, t_req + window - time.time()))
        t0 = time.time()
        proc.stdin.write(f"go {i}\n")
        proc.stdin.flush()
        line = proc.stdout.readline().strip()
        rec = json.loads(record.read_text())
        marks = [float(x) for x in busy.read_text().split()] if busy.exists() else []
        runs.append({"after_go_s": round(time.time() - t0, 3), "line": line,
                     "busy_ms_before": busy_ms(marks, t_req + 0.5, t_lead), "busy_ms_lead": busy_ms(marks, t_lead, t0),
                     **{k: rec.get(k) for k in ("val_bpb", "rejected", "error", "transfer", "transfer_note",
                                                "causal_max_diff", "purity_max_diff", "fresh_max_diff", "seconds")}})
        print(f"lead {lead:g} " + json.dumps(runs[-1]), flush=True)
    proc.stdin.close()
    proc.wait(timeout=120)
    log.close()
    return {"runs": runs, "median_after_go_s": statistics.median(r["after_go_s"] for r in runs),
            "log_tail": (work / "evaluator.log").read_text()[-2000:]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--eval-tokens", type=int, default=10 * 2**20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="trust.json")
    ap.add_argument("--leads", type=float, nargs="+", default=[0.0, 5.0], help="prestart leads to compare (0: none)")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to try the script itself")
    ap.add_argument("--rows", type=int, default=2**16 // 2048, help="rows of 2048 tokens per evaluation call")
    ap.add_argument("--sandboxed-cuda", action="store_true", help="also check CUDA and compile in the run sandbox")
    args = ap.parse_args()
    from autoresearch.harness import sandbox
    out = {"available": sandbox.available(), "isolation": sandbox.isolation(), "ids": sandbox.sandbox_ids()}
    print(json.dumps(out), flush=True)
    work = Path(tempfile.mkdtemp(prefix="ar-diag-trust-"))
    os.chmod(work, 0o755)
    if args.sandboxed_cuda:
        out["sandboxed_cuda"] = sandboxed_cuda(work)
        print(json.dumps(out["sandboxed_cuda"]), flush=True)
    tok = work / "diag" / "tok-8192"
    handmade_split(tok, 8192, args.eval_tokens + 2**21)
    checkpoint_of_train_py(work / "ckpt", 8192)
    busy = work / "busy.txt"
    stand_in = subprocess.Popen([sys.executable, "-c", BUSY if args.device == "cuda" else "", str(busy)])
    try:
        for lead in args.leads:
            out[f"lead{lead:g}"] = evaluate(work, tok, work / "ckpt", args.eval_tokens, args.repeat, lead, busy,
                                              args.device, args.rows)
    finally:
        stand_in.kill()
    for lead in args.leads:
        runs = out[f"lead{lead:g}"]["runs"]
        def med(k):
            got = [r[k] for r in runs if r[k] is not None]
            return statistics.median(got) if got else None
        print(f"lead {lead:g} s: after go {med('after_go_s')} s (median of {len(runs)}), transfer "
              f"{[r['transfer'] for r in runs]}, phases {[r['seconds'] for r in runs]}, stand-in ms/iter "
              f"{med('busy_ms_before')} before, {med('busy_ms_lead')} in the lead's seconds", flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
