"""Dataloader alone: tokens/s of PackedLoader for a few batch shapes, and how much of the corpus the best-fit
packing keeps. Downloads nothing: a missing dataset is prepared from an offline source (builtin, builtin-site).

    python bench/bench_loader.py                                   # builtin, vocab 8192, B 64 and 128, T 2048
    python bench/bench_loader.py --dataset builtin-site --device cuda --threads 1,2
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from autoresearch.harness import data
from autoresearch.harness.env import default_cache
from autoresearch.harness.loader import PackedLoader, pack_rows


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="builtin", help="builtin or builtin-site (prepared here if missing)")
    ap.add_argument("--cache", type=Path, default=None, help="cache root (default: AR_CACHE or ~/.cache/autoresearch)")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--batch-sizes", type=ints, default=[64, 128])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--threads", type=ints, default=[1], help="assembling threads to try, e.g. 1,2,4")
    ap.add_argument("--seconds", type=float, default=5.0, help="measuring time per row of the table")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    cache = args.cache or default_cache()
    t0 = time.time()
    try:
        tok_dir = data.check_prepared(cache, args.dataset, args.vocab_size)
        prep = "already prepared"
    except data.DataError:
        if args.dataset not in ("builtin", "builtin-site"):
            print(f"{args.dataset} is not prepared and this benchmark downloads nothing; prepare it first")
            return 1
        tok_dir = data.prepare(args.dataset, cache=cache, vocab_size=args.vocab_size, progress=print)
        prep = f"prepared in {time.time() - t0:.0f} s"
    meta = data.load_meta(tok_dir)
    lengths = np.diff(np.load(tok_dir / "train.idx.npy"))
    rows = pack_rows(lengths, args.seq_len + 1)
    kept = len(rows) * (args.seq_len + 1) / lengths.sum()

    print(f"dataset {args.dataset}: {meta['train']['tokens']:,} train tokens in {meta['train']['docs']:,} documents "
          f"(median {int(np.median(lengths))} tokens), vocab {meta['vocab_size']}; {prep}")
    print(f"best-fit packing keeps {kept:.1%} of the train tokens per epoch at T={args.seq_len} (the rest is "
          "cropped tails)")
    print(f"host: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}; torch {torch.__version__}; "
          f"device {args.device}")
    print()
    print(f"{'B':>5} {'T':>6} {'threads':>7} {'batches':>8} {'tokens/s':>14}")
    for threads in args.threads:
        for B in args.batch_sizes:
            with PackedLoader(tok_dir, "train", B, args.seq_len, device=args.device, seed=0, threads=threads) as ld:
                for _ in range(3):  # start-up: thread start, page cache, pinned-memory pool
                    next(ld)
                n, start = 0, time.perf_counter()
                while time.perf_counter() - start < args.seconds:
                    x, y = next(ld)
                    n += 1
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                dt = time.perf_counter() - start
            print(f"{B:>5} {args.seq_len:>6} {threads:>7} {n:>8} {n * B * args.seq_len / dt:>14,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
