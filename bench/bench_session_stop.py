"""How long a session takes to stop after its last result: the trusted evaluator and its model fork server
(both with torch imported) shut down, every worker reaped.

One-experiment sessions of tests/fixtures/tiny_train.py (real torch training and evaluation on a small corpus cut
from the standard library), repeated; prints the median of the time from the experiment's settle event to the
end of `with Loop(...)`. Run it from two checkouts to compare (PYTHONPATH=<checkout>).

    python bench/bench_session_stop.py [--sessions 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from autoresearch.config import RunConfig
from autoresearch.harness import data
from autoresearch.harness.env import resolve_profile
from autoresearch.session.loop import Loop

TINY_TRAIN = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "tiny_train.py"


def corpus(cache: Path) -> None:
    src = cache.parent / "text"
    src.mkdir(parents=True)
    n = total = 0
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        for piece in data.split_long(f.read_text(errors="replace"), 2000):
            (src / f"doc_{n:05d}.txt").write_text(piece)
            n, total = n + 1, total + len(piece)
        if total >= 300_000:
            break
    data.prepare("files", cache=cache, vocab_size=resolve_profile("cpu").vocab_size, name="builtin", path=src)


def session(root: Path, i: int) -> float:
    repo = root / f"repo{i}"
    repo.mkdir()
    shutil.copy(TINY_TRAIN, repo / "train.py")
    (repo / "program.md").write_text("# program\n")
    (repo / ".gitignore").write_text("runs/\n")
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "start"]):
        subprocess.run(["git", "-c", "user.name=b", "-c", "user.email=b@b", *args], cwd=repo, check=True)
    cfg = RunConfig(profile="cpu", time_budget=10, startup_allowance=60, eval_allowance=60, eval_tokens=2048,
                    holdout_tokens=0, noise=0.01, max_log_mb=1)
    with Loop(cfg, repo, "t", None) as loop:
        loop.run(max_experiments=1)
    end = time.time()
    events = [json.loads(line) for line in (repo / "runs" / "t" / "events.jsonl").read_text().splitlines()]
    settled = [e["t"] for e in events if e["type"] == "experiment_settled"]
    return end - settled[-1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cache = root / "cache"
        corpus(cache)
        os.environ["AR_CACHE"] = str(cache)
        times = [session(root, i) for i in range(args.sessions)]
    print(f"stop after the last result: median {statistics.median(times):.3f} s, min {min(times):.3f}, "
          f"max {max(times):.3f} over {len(times)} sessions ({sys.version.split()[0]})")


if __name__ == "__main__":
    main()
