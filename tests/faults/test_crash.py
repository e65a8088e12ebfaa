"""Crash consistency: SIGKILL `ar run` at every phase of an experiment, resume, count the damage.

Kill points come from autoresearch.faults (AR_FAULT=<point>:<n> kills ar the n-th time the point is
reached). The trials form one chain on one repo: each killed `ar run` is followed by a resume (Loop.open,
which is what the next `ar run` does first), the audit, and the next trial's `ar run`. Every point is killed
at each of its n once (22 kills, in rounds: the first n of every point, then the second, ...). The first
round starts `python -m autoresearch run` for real; the others fork this already-imported interpreter.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest

from autoresearch.config import load_config
from autoresearch.records.ledger import read_results
from autoresearch.session.loop import Loop
from autoresearch.records.queue import ExperimentQueue

from .helpers import History, agent_cmd, ar_proc, audit, fork_ar, hook_firings, make_repo, write_cfg

pytestmark = pytest.mark.e2e

# point -> the n of AR_FAULT=<point>:<n> to cycle through (a point reached several times per experiment
# gets larger n, so the kill lands on different experiments and kinds of result)
PHASES = {
    "agent": (1,),                   # during the proposal: the agent has printed, maybe edited
    "propose": (1,),                 # the proposal is in the tree, not checked or committed
    "reject": (1,),                  # reverting a rejected proposal
    "commit": (1, 2),                # between the commit and the run
    "hook": (1, 3),                  # while a hook runs
    "train": (1, 3),                 # mid-run (at a step line)
    "parse": (1,),                   # after the run, while parsing
    "decide": (1, 2),                # decided, before the reset to the best
    "revert": (1,),                  # after the reset, before the row is written
    "append.results": (1, 2),        # half a row written to results.tsv
    "recorded": (1,),                # the row is written, the spec not yet marked done
    "append.queue": (1, 3, 5),       # half an event written to queue.jsonl (added, started, done)
    "done": (1,),                    # the spec is done, its hooks not fired
    "append.hooks": (1, 3),          # half a line written to hooks.jsonl
    "resume": (1,),                  # during the resume itself
}
# round r kills every point that has an r-th n at it: 22 kills in all (each kill starts ar and the trusted
# evaluator again, ~6 s on 2 cores); a second n where the point is reached on different kinds of result
ROUNDS = [[(phase, ns[r]) for phase, ns in PHASES.items() if r < len(ns)] for r in range(max(map(len, PHASES.values())))]
KILLS = sum(map(len, ROUNDS))
REAL_ROUNDS = 1        # rounds started as `python -m autoresearch run`
TAG = "t"


@pytest.mark.slow
def test_sigkill_at_every_phase_then_resume(tmp_path, table):
    root = make_repo(tmp_path, DEPTH=400, STEP_SECONDS=0.02)
    events = tmp_path / "events.txt"
    hooks = {e: [f'echo "$AR_EVENT $AR_EXP_ID" >> {events}']
             for e in ("run_started", "run_finished", "kept", "reverted", "crashed")}
    conf = write_cfg(tmp_path / "run.yaml", agent=agent_cmd("cycle_agent.py"), hooks=hooks, hook_timeout=5)
    cfg = load_config(conf)
    args = ("run", "--repo", str(root), "--tag", TAG, "--config", str(conf), "--max-experiments", "12")  # room to reach each point past repeats
    hist = History()
    per_phase = {p: [0, 0, 0, 0, 0] for p in PHASES}
    notes: list[str] = []
    not_killed = []
    t0 = time.monotonic()
    for r, kills in enumerate(ROUNDS):
        for phase, n in kills:
            fault = f"{phase}:{n}"
            log = tmp_path / f"ar-{phase}-{n}.log"
            if r < REAL_ROUNDS:
                p = ar_proc(*args, cwd=tmp_path, env={"AR_FAULT": fault})
                out, err = p.communicate(timeout=60)
                rc = p.returncode
                log.write_text(out + err)
            else:
                rc = fork_ar(*args, fault=fault, log=log)
            if rc != -9:
                not_killed.append((fault, rc, log.read_text()[-600:]))
                continue
            hist.observe(root, TAG)          # what the killed run left recorded
            with Loop(cfg, root, TAG, None):  # the resume a next `ar run` starts with
                pass
            c = audit(root, TAG, hist, cfg.noise_threshold(root / "runs" / TAG)[0])
            row = per_phase[phase]
            row[0] += 1
            for i, v in enumerate((c.lost, c.duplicated, c.wrongly_kept, c.inconsistent), 1):
                row[i] += v
            notes += [f"{fault}: {n}" for n in c.notes]
    # finish without a fault; then nothing half-written may remain, and no hook fired twice
    assert fork_ar(*args[:-1], "3", log=tmp_path / "ar.log") == 0
    final = audit(root, TAG, hist, cfg.noise_threshold(root / "runs" / TAG)[0])
    notes += [f"final: {n}" for n in final.notes]
    read_results(root / "runs" / TAG / "results.tsv")                      # strict: raises on a bad line
    torn_queue = []
    ExperimentQueue(root / "runs" / TAG / "queue.jsonl", warn=torn_queue.append)
    fired = Counter(hook_firings(root / "runs" / TAG / "hooks.jsonl"))
    echoed = Counter(events.read_text().splitlines())
    twice = sum(n - 1 for n in fired.values()) + sum(n - 1 for n in echoed.values())
    rows = read_results(root / "runs" / TAG / "results.tsv")
    statuses = Counter(r.status.value for r in rows)
    for phase, vals in per_phase.items():
        table.add(f"SIGKILL ar run: {phase}", *vals)
    table.add("SIGKILL ar run: final resume", 1, final.lost, final.duplicated + twice, final.wrongly_kept,
              final.inconsistent + len(torn_queue))
    print(f"\n{sum(v[0] for v in per_phase.values())} kills in {time.monotonic() - t0:.0f}s; "
          f"{len(rows)} results {dict(statuses)}; hooks fired {sum(fired.values())}")
    assert not not_killed, f"fault points not reached: {not_killed}"
    assert sum(v[0] for v in per_phase.values()) == KILLS == 23
    assert not notes, "\n".join(notes[:20])
    assert twice == 0 and not torn_queue
    assert {"keep", "discard", "crash", "rejected"} <= set(statuses)
