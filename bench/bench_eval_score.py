"""The evaluator's side of one evaluation call, old and new, on the same logits.

The model worker writes its float32 logits [rows, T, V] into a shared buffer; the evaluator then scores them.
Old: a private copy, a finiteness check, logsumexp, gather and a subtraction. New (harness/evaluator.py): the
buffer read in place, the finiteness check, and one cross-entropy kernel (log-softmax and gather), its losses
checked finite. Both are timed side by side on one buffer of random logits, in turns, and the per-target losses
are compared.

    python3 bench/bench_eval_score.py [--rows 32 --seq 2048 --vocab 8192 --repeat 20]   (GPU if there is one)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from autoresearch.harness.evaluator import _nll


def old(out, y):
    logits = out.to(out.device, copy=True)
    if not torch.isfinite(logits).all():
        raise ValueError("not finite")
    return logits.logsumexp(-1) - logits.gather(-1, y.unsqueeze(-1)).squeeze(-1)


def new(out, y):
    if not torch.isfinite(out).all():
        raise ValueError("not finite")
    loss = _nll(out, y)
    if not torch.isfinite(loss).all():
        raise ValueError("not finite")
    return loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=20)
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=device).manual_seed(0)
    out = 15 * torch.tanh(torch.randn(a.rows, a.seq, a.vocab, device=device, generator=gen) * 2 / 15)
    y = torch.randint(0, a.vocab, (a.rows, a.seq), device=device, generator=gen)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = {"old": [], "new": []}
    for i in range(a.repeat + 2):
        for name, fn in (("old", old), ("new", new)) if i % 2 == 0 else (("new", new), ("old", old)):
            sync()
            t = time.perf_counter()
            fn(out, y)
            sync()
            if i >= 2:                       # the first two rounds warm the kernels and the allocator
                times[name].append(time.perf_counter() - t)
    diff = float((old(out, y) - new(out, y)).abs().max())
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(json.dumps({"device": name, "torch": torch.__version__, "shape": [a.rows, a.seq, a.vocab],
                      "old_ms": {k: round(f(times["old"]) * 1e3, 3) for k, f in (("min", min), ("median", statistics.median), ("max", max))},
                      "new_ms": {k: round(f(times["new"]) * 1e3, 3) for k, f in (("min", min), ("median", statistics.median), ("max", max))},
                      "max_loss_diff": diff}))


if __name__ == "__main__":
    main()
