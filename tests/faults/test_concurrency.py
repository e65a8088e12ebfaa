"""N copies of `ar run` and `ar sweep` started at once on one repo: exactly one runs, the others exit with
code 3 and a message naming the holder; after kill -9 of the holder, the next one takes over."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from autoresearch.config import load_config
from autoresearch.session.loop import Loop

from .helpers import History, audit, make_repo, poll, reap, spawn_ar, write_cfg

pytestmark = pytest.mark.e2e

SWEEP = """name: c
axes:
  LR_MULT: [1.0, 2.0]
fixed:
  TIME_BUDGET: 4
profile: cpu
order: listed
"""


def start_all(n: int, run_args: tuple, sweep_args: tuple, logs) -> dict[int, str]:
    """n processes at once, alternating `ar run` and `ar sweep`; pid -> log path."""
    pids = {}
    for i in range(n):
        log = logs / f"{time.monotonic_ns()}-{i}.log"
        pids[spawn_ar(*(run_args if i % 2 == 0 else sweep_args), log=log)] = log
    return pids


def settle(pids: dict[int, str], timeout: float = 60.0) -> tuple[list[int], dict[int, int]]:
    """Wait until all but one have exited: (still running, {pid: exit code} of the rest)."""
    codes: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in pids:
            if pid not in codes:
                rc = poll(pid)
                if rc is not None:
                    codes[pid] = rc
        if len(codes) >= len(pids) - 1:
            break
        time.sleep(0.02)
    return [p for p in pids if p not in codes], codes


def judge(pids, running, codes, root) -> tuple[int, int, list[str]]:
    """(extra runners, refusals that are wrong, notes)."""
    notes = []
    holder = json.loads((root / "runs" / ".ar.lock.json").read_text())["pid"] if running else None
    if len(running) != 1 or holder != running[0]:
        notes.append(f"running {running}, lock holder {holder}, exits {codes}")
    wrong = 0
    for pid, rc in codes.items():
        text = open(pids[pid]).read()
        if rc != 3 or f"pid {holder}" not in text or "already running" not in text or "Traceback" in text:
            wrong += 1
            notes.append(f"pid {pid}: rc {rc}: {text[-300:]}")
    return max(0, len(running) - 1) + sum(1 for rc in codes.values() if rc == 0), wrong, notes


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 8])
def test_n_at_once_then_after_kill_9(tmp_path, n, table):
    root = make_repo(tmp_path, STEP_SECONDS=0.02)
    # budgets long enough that the holder is still training when the slowest starter reaches the lock,
    # even on a loaded 2-core machine (else two sequential runs would look like two at once)
    conf = write_cfg(tmp_path / "run.yaml", time_budget=4, proposer="strategy")
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(SWEEP)
    run_args = ("run", "--repo", str(root), "--tag", "t", "--config", str(conf), "--max-experiments", "1")
    sweep_args = ("sweep", str(sweep), "--repo", str(root), "--config", str(conf))
    notes = []
    for phase in ("at once", "at once after kill -9 of the holder"):
        pids = start_all(n, run_args, sweep_args, tmp_path)
        running, codes = settle(pids)
        extra, wrong, more = judge(pids, running, codes, root)
        notes += [f"{phase}: {m}" for m in more]
        if phase == "at once":
            for pid in running:
                os.kill(pid, signal.SIGKILL)
                reap(pid, 10)
        else:
            for pid in running:
                rc = reap(pid, 60)
                if rc != 0:
                    notes.append(f"{phase}: the one that took over exited {rc}: {open(pids[pid]).read()[-500:]}")
                    wrong += 1
        table.add(f"{n} x ar run/sweep {phase}", n, 0, extra, 0, wrong)
    tags = [m.parent.name for m in (root / "runs").glob("*/meta.json")]
    for tag in tags:   # `t` (ar run) and `sweep-c` (ar sweep), whichever ran
        # a tag whose holder was killed -9 and that nobody resumed since still holds its half-made experiment:
        # the promise is about the repo after a resume, which is what the next `ar run`/`ar sweep` does first
        sweep_tag = tag.startswith("sweep-")
        with Loop(load_config(conf), root, tag, None, baseline=not sweep_tag,
                  command="ar sweep" if sweep_tag else "ar run"):
            pass
        c = audit(root, tag, History(), load_config(conf).noise_threshold(root / "runs" / tag)[0])
        table.add(f"{n} x ar run/sweep: repo after both", 1, c.lost, c.duplicated, c.wrongly_kept, c.inconsistent)
        notes += c.notes
    assert tags and not notes, "\n".join(notes)
