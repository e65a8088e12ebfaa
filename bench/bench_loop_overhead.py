"""Loop overhead per experiment: everything `ar run` does except the training subprocess and the agent.

A temp git repo with a trivial train.py (prints the summary and writes the evaluator record at once), a
proposer that rewrites one knob per experiment (every other one an improvement, so keeps and reverts
alternate), 50 experiments. Overhead = time in Loop.run_one minus time inside run_training (the
subprocess, from spawn to reaped). Prints the median, mean and 90th percentile.

    python bench/bench_loop_overhead.py [--experiments 50]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import autoresearch.session.loop as loop_mod
from autoresearch.config import RunConfig
from autoresearch.session.loop import Loop
from autoresearch.proposers import Proposal

TRAIN = '''
X = 0                        # the knob the bench proposer moves
import json, os, sys, time
from autoresearch.harness import logfmt
from autoresearch.harness.env import RunEnv
env = RunEnv.from_environ()
val = 1.0 - X * 1e-3 if X % 2 == 0 else 2.0
print(logfmt.format_step(1, 100.0, val, 1000, None, 0.001, 0), flush=True)
with open(str(env.result_file) + ".tmp", "w") as f:
    json.dump({"val_bpb": val, "eval_tokens": env.eval_tokens, "eval_bytes": 1, "dataset": env.dataset,
               "seq_len": 256, "pid": os.getpid(), "written_at": time.time()}, f)
os.replace(str(env.result_file) + ".tmp", env.result_file)
print(logfmt.format_summary(val_bpb=val, training_seconds=0.0, total_seconds=0.0, peak_vram_mb=None,
      mfu_percent=None, total_tokens_M=0.0, num_steps=1, num_params_M=0.0, depth=1, gpu="cpu", peak_tflops=None))
'''


class Counter:
    name = "bench"

    def __init__(self):
        self.i = 0

    def propose(self, ctx):
        self.i += 1
        return Proposal(f"X = {self.i}", knobs={"X": self.i})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experiments", type=int, default=50)
    n = ap.parse_args().experiments
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "repo"
        root.mkdir()
        (root / "train.py").write_text(TRAIN)
        for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "start"]):
            subprocess.run(["git", "-c", "user.name=b", "-c", "user.email=b@b", *args], cwd=root, check=True)

        inside: list[float] = []
        real_run = loop_mod.run_training

        def timed_run(*a, **kw):
            t0 = time.perf_counter()
            try:
                return real_run(*a, **kw)
            finally:
                inside.append(time.perf_counter() - t0)

        loop_mod.run_training = timed_run
        cfg = RunConfig(profile="cpu", time_budget=1.0, prepare_data=False, noise=0.0)
        loop = Loop(cfg, root, "bench", Counter())
        per_exp: list[float] = []
        real_one = loop.run_one

        def timed_one(spec):
            t0 = time.perf_counter()
            before = len(inside)
            row = real_one(spec)
            per_exp.append(time.perf_counter() - t0 - sum(inside[before:]))
            return row

        loop.run_one = timed_one
        t0 = time.perf_counter()
        s = loop.run(max_experiments=n + 1)          # + the baseline
        total = time.perf_counter() - t0
    overhead = per_exp[1:]                            # the proposals (the baseline has no proposal step)
    q = statistics.quantiles(overhead, n=10)
    print(f"{len(overhead)} experiments ({s.kept} kept), {total:.1f}s in all, "
          f"{statistics.median(inside):.3f}s median per training subprocess")
    print(f"loop overhead per experiment: median {statistics.median(overhead):.3f}s, "
          f"mean {statistics.mean(overhead):.3f}s, p90 {q[-1]:.3f}s")


if __name__ == "__main__":
    sys.exit(main())
