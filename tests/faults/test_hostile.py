"""Hostile or broken proposals: each is kept 0 times, the records and the repo stay whole, nothing outlives
the run. Most of them look like a win to a naive runner (a better printed number, or an improving knob
riding along with the misbehaviour)."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import psutil
import pytest

import autoresearch.harness as harness
import autoresearch.loop as loop_mod
from autoresearch.config import RunConfig
from autoresearch.ledger import Status, read_results
from autoresearch.loop import Loop
from autoresearch.proposers.agent import AgentProposer

from .helpers import History, agent_cmd, audit, make_repo

NOISE = 0.005        # the keep threshold: a change must win by more than this
SEED_NOISE = 0.002   # the stand-in's val_bpb spread across seeds: any seed-only "win" is < 2 * 0.002 < NOISE
WIN = {"TOTAL_BATCH_SIZE": 2**18}   # a real improvement (0.06 val_bpb), ridden along by the misbehaviour

LUCKY_SEED_AGENT = """
import random, re
from pathlib import Path
p = Path("train.py")
t = p.read_text()
noise = lambda s: 2 * random.Random(s).random() - 1
lucky = min(range(2000), key=noise)   # the seed whose noise is the most negative
p.write_text(t.replace("random.Random(seed)", f"random.Random({lucky})"))
print(f"fix the seed to {lucky}")
"""


def cfg(**kw) -> RunConfig:
    base = dict(profile="cpu", time_budget=0.1, startup_allowance=1.5, eval_allowance=0.5, prepare_data=False,
                max_consecutive_crashes=1000, noise=NOISE, max_log_mb=1)
    base.update(kw)
    return RunConfig(**base)


def leftovers(cache: Path, since: float) -> list[psutil.Process]:
    """The sleepers this test's runs started (they carry its AR_CACHE) that are still alive."""
    out = []
    for p in psutil.process_iter(["create_time"]):
        try:
            if (p.info["create_time"] or 0) >= since - 1 and p.environ().get("AR_CACHE") == str(cache) and \
                    p.status() != psutil.STATUS_ZOMBIE and "time.sleep(10000)" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            continue
    return out


@pytest.mark.slow
def test_hostile_proposals_are_never_kept(tmp_path, monkeypatch, table):
    t0 = time.time()
    cache = tmp_path / "cache"
    root = make_repo(tmp_path, STEP_SECONDS=0.02, SEED_NOISE=SEED_NOISE)
    # a copy of the harness stands in for the installed one (the run-time check hashes HARNESS_DIR)
    harness_copy = tmp_path / "harness"
    shutil.copytree(Path(harness.__file__).parent, harness_copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(loop_mod, "HARNESS_DIR", harness_copy)
    data_file = cache / "builtin" / "tok-2048" / "val.bin"
    data_file.parent.mkdir(parents=True)
    data_file.write_bytes(b"\0" * 4096)
    evaluator = harness_copy / "evaluate.py"
    evaluator_text, data_bytes = evaluator.read_text(), data_file.read_bytes()

    c = cfg()
    hist = History()
    cases: list[tuple[str, int, str]] = []    # (fault, exp_id, what the reason must mention)
    stops: list[str] = []

    Loop(c, root, "t", None).run()            # the baseline
    base_prepare = (root / "prepare.py").read_text()

    def agent(fault: str, cmd: str, expect: str) -> None:
        loop = Loop(c, root, "t", AgentProposer(cmd, timeout=20))
        s = loop.run(max_experiments=1)
        cases.append((fault, read_results(s.results)[-1].exp_id, expect))

    agent("edits a protected file (prepare.py)", agent_cmd("protected.py"), "prepare.py")
    agent("syntax error", agent_cmd("syntax.py"), "does not parse")
    agent("changes the budget (AR_TIME_BUDGET in train.py)", agent_cmd("budget.py", "env"), "AR_TIME_BUDGET")
    agent("changes the budget (trains past it)", agent_cmd("budget.py", "sleep"), "")
    agent("prints a fake val_bpb", agent_cmd("fake_bpb.py"), "not confirmed by the evaluator")
    agent("deletes runs/ (at proposal time)", agent_cmd("delete_runs.py"), "under runs/")
    agent("writes into .git (at proposal time)", agent_cmd("git_tamper.py"), ".git/hooks/post-commit")
    lucky = tmp_path / "lucky.py"
    lucky.write_text(LUCKY_SEED_AGENT)
    agent("changes the seed only (a lucky seed in train.py)", f"{sys.executable} {lucky}", "")

    # the harness or the data changed under a run: that run is a crash, and the loop stops (nothing after it
    # could be trusted until they are restored)
    hist.observe(root, "t")
    for fault, target, expect in (("edits the evaluator at run time", evaluator, "harness"),
                                  ("edits the data at run time", data_file, "val.bin")):
        with Loop(c, root, "t", None) as loop:
            spec = loop.enqueue_knobs({"FAIL_MODE": "tamper", "TAMPER_PATH": str(target), **WIN}, description=fault)
            loop.enqueue_knobs(WIN, description="not run: the loop stopped")
            s = loop.run()
        cases.append((fault, spec.id, expect))
        if not (s.failed and expect in s.stop_reason and s.experiments == 1):
            stops.append(f"{fault}: {s.stop_reason}")
        with Loop(c, root, "t", None) as loop:   # drop the spec the stop left in the queue
            loop.queue.done(spec.id + 1, "skipped")

    at_run = [  # (fault, knobs, what the reason must mention)
        ("deletes/truncates runs/ at run time", {"FAIL_MODE": "wipe_runs", **WIN}, "under runs/"),
        ("writes into .git at run time", {"FAIL_MODE": "git_tamper", **WIN}, ".git/"),
        ("infinite loop before the first step", {"FAIL_MODE": "hang", **WIN}, "no result after"),
        ("hang after training", {"FAIL_MODE": "hang_after", **WIN}, "no result after"),
        ("NaN loss", {"FAIL_MODE": "nan", **WIN}, "nan"),
        ("out of memory", {"FAIL_MODE": "oom", **WIN}, "exit code"),
        ("crash with a traceback", {"FAIL_MODE": "crash", **WIN}, "exit code"),
        ("background processes outliving the run", {"FAIL_MODE": "spawn"}, ""),
        ("a daemon that leaves the process group", {"FAIL_MODE": "daemon"}, ""),
        ("floods 200 MB of output", {"FAIL_MODE": "flood", "FLOOD_MB": 200}, ""),
    ]
    hist.observe(root, "t")
    with Loop(c, root, "t", None) as loop:
        specs = [(f, loop.enqueue_knobs(k, description=f), e) for f, k, e in at_run]
        seeds = [loop.enqueue_knobs({}, seed=s, description=f"seed {s} only") for s in (1, 2, 3, 4, 5)]
        loop.run()
    cases += [(f, s.id, e) for f, s, e in specs]
    cases += [(f"changes the seed only (runner seed {s.payload['seed']})", s.id, "") for s in seeds]
    time.sleep(0.3)
    alive = leftovers(cache, t0)
    for p in alive:
        p.kill()

    rows = {r.exp_id: r for r in read_results(root / "runs" / "t" / "results.tsv")}
    counts = audit(root, "t", hist, NOISE)
    problems = list(counts.notes) + stops
    for fault, exp_id, expect in cases:
        r = rows.get(exp_id)
        lost = int(r is None)
        kept = int(r is not None and r.status is Status.KEEP)
        wrong = lost or (expect and expect not in r.reason)
        if lost or kept or wrong:
            problems.append(f"{fault}: {None if r is None else (r.status.value, r.reason)}")
        bad = 0
        if fault.startswith("background") or fault.startswith("a daemon"):
            bad = len(alive)
        if fault.startswith("floods"):
            log = next((root / "runs" / "t").glob(f"{exp_id:04d}-*/train.log"))
            bad = int(log.stat().st_size > 2**20 + 2**16)
            problems += [f"log of {log.stat().st_size} bytes"] * bad
        table.add(f"hostile: {fault}", 1, lost, 0, kept, bad)
    # the run-time tampering is undone where it can be (.git, runs/) and reported where it cannot
    assert (root / "prepare.py").read_text() == base_prepare
    assert not (root / ".git" / "hooks" / "post-commit").exists()
    assert (root / ".git" / "HEAD").read_text().strip() == "ref: refs/heads/autoresearch/t"
    assert evaluator.read_text() != evaluator_text and data_file.read_bytes() != data_bytes  # they did change
    # an honest win is still kept afterwards
    with Loop(c, root, "t", None) as loop:
        loop.enqueue_knobs(WIN, description="honest win")
        loop.run()
    assert read_results(root / "runs" / "t" / "results.tsv")[-1].status is Status.KEEP
    problems += audit(root, "t", hist, NOISE).notes
    assert not alive, [p.pid for p in alive]
    assert not problems, "\n".join(problems)
    assert counts.lost == counts.duplicated == counts.wrongly_kept == counts.inconsistent == 0
