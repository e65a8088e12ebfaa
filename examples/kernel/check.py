"""The correctness gate: kernel.py against the float64 reference on random shapes, dtypes and value scales,
drawn from fresh OS entropy on every run, so a candidate cannot be tuned to the shapes it has seen. Exit 0
when every case matches; otherwise 1, with the first case that does not on the last line."""

import random
import sys

import harness
import inputs
import reference

CASES = {"cuda": 16, "cpu": 6}
MAX_V = {"cuda": 70000, "cpu": 3000}      # up to a large vocabulary on a GPU; small on CPU, where CI runs this


def main() -> int:
    dev = harness.device()
    rng = random.Random(harness.fresh_seeds(1)[0])
    dtypes = ["float32", "bfloat16", "float16"]
    cases = [(1, 1, "float32"), (3, 2049, rng.choice(dtypes))]           # the edges: one column; a block + 1
    while len(cases) < CASES[dev]:
        cases.append((rng.randint(1, 300), rng.randint(2, MAX_V[dev]), rng.choice(dtypes)))
    worker = harness.Worker(dev)
    try:
        for n, v, dtype in cases:
            seeds = harness.fresh_seeds(2)
            try:
                outs = worker.run(seeds, n, v, dtype)
            except harness.CandidateError as e:
                print(f"FAIL: n={n} v={v} {dtype}: {e}")
                return 1
            for seed, out in zip(seeds, outs):
                x, t, cap = inputs.make(seed, n, v, dtype, dev)
                ok, err = reference.close(out, reference.softcap_ce(x, t, cap).cpu())
                if not ok:
                    print(f"FAIL: n={n} v={v} {dtype} seed={seed}: max error {err:.3g} against the reference")
                    return 1
        print(f"gate passed: {len(cases)} cases on {dev}")
        return 0
    finally:
        worker.close()


if __name__ == "__main__":
    sys.exit(main())
