"""The timing harness: the candidate's speed, measured from this process, never the candidate's.

Each window sends REPS fresh seeds to the worker and waits for all REPS outputs: the worker must make the
inputs (unknown before the request, so nothing can be computed ahead) and run the kernel on each. This
process times the window on its own clock, subtracts what making the same inputs costs here (measured right
after, in the same window's turn), and divides by REPS. Every output of every window is checked against the reference, so a kernel that caches, skips work on
these shapes or returns something else fails here even when it passed the gate. The first windows warm up
(compilation, caches) and are not counted; the figure is the median of the rest.

Inputs are larger than the GPU's L2 and written before the others of their window, so no call finds its input
in cache; clocks are not assumed fixed: the median over windows absorbs drift. Prints one JSON line.
"""

import json
import statistics
import sys
import time

import torch

import harness
import inputs
import reference

SHAPES = {"cuda": (16384, 8192, "bfloat16", 10, 20, 3),   # n, v, dtype, reps per window, windows, warm-up
          "cpu": (32, 4096, "float32", 8, 11, 2)}   # small (CI runs it on 2 cores); 11 windows: a stall moves no median


def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def main() -> int:
    dev = harness.device()
    if dev == "cpu":
        torch.set_num_threads(1)      # as the worker: no thread of ours waits on a busy core mid-measurement
    n, v, dtype, reps, windows, warm = SHAPES[dev]
    worker = harness.Worker(dev)
    per_call, times, make_times = [], [], []
    try:
        for w in range(warm + windows):
            seeds = harness.fresh_seeds(reps)
            t0 = time.perf_counter()
            try:
                outs = worker.run(seeds, n, v, dtype)
            except harness.CandidateError as e:
                print(f"FAIL: window {w}: {e}")
                return 1
            elapsed = time.perf_counter() - t0
            sync(dev)
            t0 = time.perf_counter()                         # the same inputs, made here: their cost
            made = [inputs.make(s, n, v, dtype, dev) for s in seeds]
            sync(dev)
            making = time.perf_counter() - t0
            for i, ((x, t, cap), out) in enumerate(zip(made, outs)):
                ok, err = reference.close(out, reference.softcap_ce(x, t, cap).cpu())
                if not ok:
                    print(f"FAIL: window {w}, call {i}: the output differs from the reference (max error {err:.3g})")
                    return 1
            del made
            if w >= warm:       # each window's own difference: drift and load hit both halves of it alike
                per_call.append((elapsed - making) / reps)
                times.append(elapsed)
                make_times.append(making)
    finally:
        worker.close()
    per_call = statistics.median(per_call)
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(json.dumps({"us_per_call": round(per_call * 1e6, 2), "device": name, "n": n, "v": v, "dtype": dtype,
                      "reps": reps, "windows": windows, "window_ms": round(statistics.median(times) * 1e3, 3),
                      "inputs_ms": round(statistics.median(make_times) * 1e3, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
