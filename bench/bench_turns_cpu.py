"""Slots taking turns on one device, two against three, on the CPU: where the gaps between training windows go
when an agent's thinking plus an evaluation outlast the other slot's window (docs/scale-out.md).

    python bench/bench_turns_cpu.py [--budget 6] [--agent-s 4] [--experiments 7] [--slots 2,3]

Each series is a real Loop on the CPU (tests/fixtures/fake_train.py, the stand-in train.py; the real evaluator
and sandbox) whose slots all name "GPU 0", so they take turns as on one GPU (executors/local.GpuTurn), with the
scripted agent of bench/agents/slow_agent.py thinking --agent-s seconds, and `head_start: true`. The figures are
views/gpu_use.py's, what `ar report` prints on a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from autoresearch.executors.local import LocalExecutor  # noqa: E402
from autoresearch.harness import data  # noqa: E402
from autoresearch.harness.env import resolve_profile  # noqa: E402
from autoresearch.proposers.agent import AgentProposer  # noqa: E402
from autoresearch.session.loop import Loop  # noqa: E402
from autoresearch.slots import Slot  # noqa: E402
from autoresearch.views import gpu_use  # noqa: E402
from fixtures.corpus import write_stdlib_docs  # noqa: E402
from test_loop import cfg, make_repo  # noqa: E402


def tiny_data(root: Path) -> Path:
    """AR_CACHE with a `builtin` dataset of ~300 KB of the standard library's text (as the tests' fixture)."""
    src = write_stdlib_docs(root / "text")
    cache = root / "cache"
    data.prepare("files", cache=cache, vocab_size=resolve_profile("cpu").vocab_size, name="builtin", path=src)
    return cache


def series(root: Path, slots: int, a) -> dict:
    repo = make_repo(root, f"repo{slots}", START_DELAY=1.5)
    agent = f"{sys.executable} {HERE / 'agents' / 'slow_agent.py'} {a.agent_s} {{prompt_file}}"
    c = cfg(gpus=f"cpu:{slots}", time_budget=a.budget, head_start=True, startup_allowance=60.0, agent=agent)
    with Loop(c, repo, "t", AgentProposer(agent, timeout=120),
              executor=LocalExecutor([Slot(i, 0) for i in range(slots)])) as lp:
        lp.run(max_experiments=a.experiments)
    windows = gpu_use.load(repo / "runs" / "t", device="cpu")
    t0 = min(w.first_batch for w in windows)
    for w in sorted(windows, key=lambda w: w.first_batch):    # seconds from the first batch of the session
        print(f"  {slots} slots: exp {w.exp}: ready {w.ready - t0:6.1f}  first batch {w.first_batch - t0:6.1f}  "
              f"last step {w.last_step - t0:6.1f}", file=sys.stderr)
    (used,) = gpu_use.summarize(windows)
    used["slots"] = slots
    used["stale"] = (repo / "runs" / "t" / "results.tsv").read_text().count("\tstale\t")
    return used


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=6.0)
    ap.add_argument("--agent-s", type=float, default=4.0)
    ap.add_argument("--experiments", type=int, default=7)
    ap.add_argument("--slots", default="2,3")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        os.environ["AR_CACHE"] = str(tiny_data(root))
        for var in ("AR_PROFILE", "AR_TIME_BUDGET", "AR_SEED", "AR_DATASET", "AR_TOK_DIR", "AR_CHECKPOINT_DIR"):
            os.environ.pop(var, None)
        out = [series(root, int(n), a) for n in a.slots.split(",")]
    print(f"budget {a.budget} s, agent {a.agent_s} s, {a.experiments} experiments, head start on")
    print("| slots | windows | busy | gaps, s | median gap, s | of it, lateness (median), s | stale |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for u in out:
        print(f"| {u['slots']} | {u['windows']} | {100 * u['busy']:.1f} % | {', '.join(f'{g:.1f}' for g in u['gaps'])} "
              f"| {statistics.median(u['gaps']):.2f} | {u['median_late']:.2f} | {u['stale']} |")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
