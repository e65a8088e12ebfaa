"""Hooks that fail, hang or are killed: the loop goes on, and every event's hooks fire exactly once."""

from __future__ import annotations

import json
import time
from collections import Counter

from autoresearch.config import RunConfig
from autoresearch.session.loop import Loop

from .helpers import EVAL_TOKENS, History, audit, hook_firings, make_repo
import pytest

pytestmark = pytest.mark.e2e

EVENTS = ("run_started", "run_finished", "kept", "reverted", "crashed")
BROKEN = {"fails": "echo failing; exit 3", "hangs": "sleep 30", "is killed": "kill -9 $$"}


def test_failing_hanging_and_killed_hooks(tmp_path, table):
    root = make_repo(tmp_path, STEP_SECONDS=0.02)
    log = tmp_path / "events.txt"
    count = f'echo "$AR_EVENT $AR_EXP_ID" >> {log}'
    # every event has the counting hook, then the three broken ones
    hooks = {e: [count, *BROKEN.values()] for e in EVENTS}
    c = RunConfig(profile="cpu", time_budget=0.1, startup_allowance=10, eval_allowance=30, prepare_data=False,
                  max_consecutive_crashes=100, hooks=hooks, hook_timeout=0.3, eval_tokens=EVAL_TOKENS)
    warnings = []
    t0 = time.monotonic()
    with Loop(c, root, "t", None, on_event=lambda e: warnings.append(e.message) if e.kind == "warn" else None) as lp:
        lp.enqueue_knobs({"TOTAL_BATCH_SIZE": 2**18})   # kept
        lp.enqueue_knobs({"LR_MULT": 3.0})              # reverted
        lp.enqueue_knobs({"FAIL_MODE": "nan"})          # crashed
        s = lp.run()
    elapsed = time.monotonic() - t0
    Loop(c, root, "t", None).run()                      # a resume fires nothing again
    expect = Counter()
    for exp, outcome in ((1, "kept"), (2, "kept"), (3, "reverted"), (4, "crashed")):
        for e in ("run_started", "run_finished", outcome):
            expect[f"{e} {exp}"] = 1
    got = Counter(log.read_text().splitlines())
    fired = Counter(hook_firings(root / "runs" / "t" / "hooks.jsonl"))
    n = sum(expect.values())
    lost = sum(max(0, expect[k] - got[k]) for k in expect)
    dup = sum(max(0, v - expect[k]) for k, v in got.items()) + sum(v - 1 for v in fired.values())
    counts = audit(root, "t", History(), c.noise_threshold(root / "runs" / "t")[0])
    for kind in BROKEN:
        table.add(f"hook {kind} (every event)", n, lost, dup, 0, counts.inconsistent)
    assert s.stop_reason == "the queue is empty" and s.experiments == 4
    assert got == expect, got
    assert all(v == 1 for v in fired.values()) and len(fired) == 4 * n
    assert sum("failed with exit code 3" in w for w in warnings) == n
    assert sum("timed out" in w for w in warnings) == n
    assert sum("killed by SIGKILL" in w for w in warnings) == n
    # a hanging hook costs its timeout, no more: each of its ends (the journal's own time) and the whole session
    # (12 hooks that ran their 30 s would take 360 s) on a loaded CPU
    hung = [e["seconds"] for e in map(json.loads, (root / "runs/t/hooks.jsonl").read_text().splitlines())
            if e["cmd"] == BROKEN["hangs"] and e["phase"] == "end"]
    assert len(hung) == n and max(hung) < 0.3 + 3, hung
    assert elapsed < 120
    assert not counts.notes
