"""Misbehaving proposals on the trusted-evaluation contract, through the real loop with the scripted stand-in
(tests/fixtures/fake_train.py): broken or rule-breaking proposals at proposal time (scripted agents), and runs
that misbehave at run time (FAIL_MODE knob edits, most riding along with an improving knob so that a naive runner
would keep them). Each ends as `rejected`, `discard`, `crash` or `timeout` with a reason that says why — never
`keep`;
the records, the repo, .git, the package and the data stay whole; nothing outlives its run; and an honest win is
still kept afterwards. (tests/faults/test_hostile.py attacks the evaluation itself with a real model.)"""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

import psutil
import pytest

from autoresearch.config import RunConfig
from autoresearch.harness import sandbox
from autoresearch.records.ledger import Status, read_results
from autoresearch.session.loop import Event, Loop
from autoresearch.proposers.agent import AgentProposer

from .helpers import EVAL_TOKENS, Cycle, History, agent_cmd, audit, make_repo, own_copies

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sandbox.available()[0], reason="needs Landlock: " + sandbox.available()[1])]

NOISE = 0.005        # the keep threshold: a change must win by more than this
SEED_NOISE = 0.002   # the stand-in's val_bpb spread across seeds: a seed-only "win" is < 2 * 0.002 < NOISE
WIN = {"TOTAL_BATCH_SIZE": 2**18}   # a real improvement (~0.18 val_bpb), ridden along by the misbehaviour
HONEST = {"TOTAL_BATCH_SIZE": 2**17}    # better than both the start and WIN: the honest win at the end
REFUSED = ("Permission denied", "the run changed")   # the sandbox refused it, or ar saw it afterwards

LUCKY_SEED_AGENT = """
import random
from pathlib import Path
p = Path("train.py")
noise = lambda s: 2 * random.Random(s).random() - 1
lucky = min(range(2000), key=noise)   # the seed whose noise is the most negative
p.write_text(p.read_text().replace("random.Random(seed)", f"random.Random({lucky})", 1))
print(f"fix the seed to {lucky}")
"""


def cfg(**kw) -> RunConfig:
    base = dict(profile="cpu", time_budget=0.5, startup_allowance=3.0, eval_allowance=10.0, prepare_data=False,
                max_consecutive_crashes=1000, noise=NOISE, max_log_mb=1, eval_tokens=EVAL_TOKENS)
    base.update(kw)
    return RunConfig(**base)


def digest(folder: Path) -> dict[str, str]:
    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file()}


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


@pytest.fixture
def own_data(tmp_path, monkeypatch, tiny_dataset):
    """This test's own copy of the data (as `builtin`) and of the installed package (what the fingerprint
    watches): the run-time tampering aims at these, never at the shared dataset or the checkout."""
    return own_copies(tmp_path, monkeypatch, tiny_dataset, "own-cache")


@pytest.mark.e2e
def test_misbehaving_proposals_are_never_kept(tmp_path, own_data, table):
    cache, pkg, tok = own_data
    t0 = time.time()
    root = make_repo(tmp_path, SEED_NOISE=SEED_NOISE)
    lucky = tmp_path / "lucky.py"
    lucky.write_text(LUCKY_SEED_AGENT)
    evaluator, val = pkg / "harness" / "evaluator.py", tok / "val.bin"
    outside = tmp_path / "outside.txt"          # a file beside the repo: the sandboxed run may not write it
    outside.write_text("untouched\n")
    git_dir = root / ".git"
    results = root / "runs" / "t" / "results.tsv"

    # fault -> (agent command, statuses it may end as, what the reason must say (any of))
    agents = {
        "edits a protected file (prepare.py)": (agent_cmd("protected.py"), {"rejected"}, ("prepare.py",)),
        "syntax error": (agent_cmd("syntax.py"), {"rejected"}, ("does not parse",)),
        "names the budget variable (AR_TIME_BUDGET in train.py)": (agent_cmd("budget.py", "env"), {"rejected"},
                                                                   ("AR_TIME_BUDGET",)),
        "deletes runs/ (at proposal time)": (agent_cmd("delete_runs.py"), {"rejected"}, ("under runs/",)),
        "writes into .git (at proposal time)": (agent_cmd("git_tamper.py"), {"rejected"},
                                                (".git/hooks/post-commit",)),
        "changes the seed only (a lucky seed in train.py)": (f"{sys.executable} {lucky} {{prompt_file}}",
                                                             {"discard"}, ("",)),
    }
    # fault -> (knobs, statuses, reason (any of))
    at_run = {
        "appends to runs/<tag>/results.tsv at run time": ({"FAIL_MODE": "tamper", "TAMPER_PATH": str(results), **WIN},
                                                         {"crash"}, REFUSED),
        "writes a file beside the repo at run time": ({"FAIL_MODE": "tamper", "TAMPER_PATH": str(outside), **WIN},
                                                      {"crash"}, REFUSED),
        "writes into .git at run time": ({"FAIL_MODE": "git_tamper", **WIN}, {"crash"}, REFUSED),
        "edits the evaluator at run time": ({"FAIL_MODE": "tamper", "TAMPER_PATH": str(evaluator), **WIN},
                                            {"crash"}, REFUSED),
        "edits the data at run time": ({"FAIL_MODE": "tamper", "TAMPER_PATH": str(val), **WIN}, {"crash"}, REFUSED),
        "writes program.md in its own workspace": ({"FAIL_MODE": "write_tracked"}, {"discard"}, ("",)),
        "infinite loop before the first step": ({"FAIL_MODE": "hang", **WIN}, {"timeout"}, ("no checkpoint after",)),
        "hang after training": ({"FAIL_MODE": "hang_after", **WIN}, {"timeout"}, ("no checkpoint after",)),
        "trains past the budget": ({"FAIL_MODE": "overtime", **WIN}, {"timeout"},    # ar's clock, or its hard limit
                                   ("past the budget", "no checkpoint after")),
        "NaN loss": ({"FAIL_MODE": "nan", **WIN}, {"crash"}, ("loss is nan",)),
        "out of memory": ({"FAIL_MODE": "oom", **WIN}, {"crash"}, ("out of memory",)),
        "crash with a traceback": ({"FAIL_MODE": "crash", **WIN}, {"crash"}, ("scripted crash",)),
        "exits without a checkpoint": ({"FAIL_MODE": "no_checkpoint", **WIN}, {"crash"}, ("without saving a checkpoint",)),
        "NaN logits": ({"FAIL_MODE": "nan_logits", **WIN}, {"rejected", "crash"}, ("not finite",)),
        "deletes/truncates runs/ at run time": ({"FAIL_MODE": "wipe_runs", **WIN}, {"crash"}, REFUSED),
        "background processes outliving the run": ({"FAIL_MODE": "spawn"}, {"discard"}, ("",)),
        "a daemon that leaves the process group": ({"FAIL_MODE": "daemon"}, {"discard"}, ("",)),
        "floods 200 MB of output": ({"FAIL_MODE": "flood", "FLOOD_MB": 200}, {"discard", "timeout"}, ("",)),
    }
    seeds = (1, 2, 3, 4, 5)

    hist = History()
    cases: dict[str, int] = {}         # fault -> exp_id
    seen: dict[int, int] = {}             # exp_id -> its sleepers seen alive at its first step (the check sees them)
    outlived: dict[int, list[int]] = {}   # exp_id -> pids of its sleepers still alive once it was recorded
    watch: set[int] = set()

    def on_event(e: Event) -> None:
        if e.kind == "step" and e.spec is not None and e.spec.id in watch and e.spec.id not in seen:
            seen[e.spec.id] = len(leftovers(cache, t0))
        if e.kind == "result" and e.spec is not None and e.spec.id in watch:
            alive = leftovers(cache, t0)
            for _ in range(10):     # a killed process may take a moment to be reaped
                if not alive:
                    break
                time.sleep(0.05)
                alive = leftovers(cache, t0)
            outlived[e.spec.id] = [p.pid for p in alive]
            for p in alive:
                p.kill()

    proposer = Cycle(AgentProposer(cmd, timeout=30) for cmd, _, _ in agents.values())
    package_before, data_before = digest(pkg), digest(tok)
    with Loop(cfg(), root, "t", proposer, on_event=on_event) as loop:
        loop.run(max_experiments=1)                                    # the baseline
        rows = read_results(root / "runs" / "t" / "results.tsv")
        assert [r.status for r in rows] == [Status.KEEP], [(r.status, r.reason) for r in rows]
        baseline = rows[0].val_bpb
        base_files = {p: (root / p).read_bytes() for p in ("prepare.py", "program.md", ".gitignore")}
        for fault in agents:                                           # proposal time: one agent each
            loop.run(max_experiments=1)
            cases[fault] = read_results(root / "runs" / "t" / "results.tsv")[-1].exp_id
        hist.observe(root, "t")

        git_before = {p: (git_dir / p).read_bytes() for p in ("HEAD", "config")}
        hooks_before = sorted(f.name for f in (git_dir / "hooks").iterdir())
        for fault, (knobs, _, _) in at_run.items():                   # run time: knob edits, one session
            spec = loop.enqueue_knobs(knobs, description=fault)
            cases[fault] = spec.id
            if "outliving" in fault or "daemon" in fault:
                watch.add(spec.id)
        for s in seeds:
            cases[f"changes the seed only (runner seed {s})"] = loop.enqueue_knobs({}, seed=s,
                                                                                   description=f"seed {s} only").id
        n = len(at_run) + len(seeds)
        summary = loop.run(max_experiments=n)
        assert summary.experiments == n and not summary.failed, summary.stop_reason
        assert loop.halted is None, loop.halted
        hist.observe(root, "t")

        loop.enqueue_knobs(HONEST, description="honest win")              # afterwards: an honest win is kept
        loop.run(max_experiments=1)
    honest = read_results(root / "runs" / "t" / "results.tsv")[-1]

    rows = {r.exp_id: r for r in read_results(root / "runs" / "t" / "results.tsv")}
    expect = {f: (s, why) for f, (_, s, why) in (*agents.items(), *at_run.items())}
    expect.update({f: ({"discard"}, ("",)) for f in cases if "runner seed" in f})
    problems: list[str] = []
    # what must be whole afterwards, and the case it belongs to
    hooks_now = sorted(f.name for f in (git_dir / "hooks").iterdir())
    damage = {
        "writes into .git at run time": [f".git/{p} changed" for p, b in git_before.items()
                                         if (git_dir / p).read_bytes() != b] +
                                        [f".git/hooks: {hooks_now} != {hooks_before}"] * (hooks_now != hooks_before),
        "writes into .git (at proposal time)": [".git/hooks/post-commit left"] * ("post-commit" in hooks_now),
        "edits the evaluator at run time": ["the package copy changed"] * (digest(pkg) != package_before),
        "edits the data at run time": ["the data copy changed"] * (digest(tok) != data_before),
        "writes a file beside the repo at run time": ["outside.txt changed"] * (outside.read_text() != "untouched\n"),
        "edits a protected file (prepare.py)": ["prepare.py changed"] * ((root / "prepare.py").read_bytes() !=
                                                                         base_files["prepare.py"]),
        "writes program.md in its own workspace": ["program.md changed"] * ((root / "program.md").read_bytes() !=
                                                                            base_files["program.md"]),
    }
    counts = audit(root, "t", hist, NOISE)
    print()
    for fault, exp_id in cases.items():
        r = rows.get(exp_id)
        allowed, says = expect[fault]
        lost = int(r is None)
        kept = int(r is not None and r.status is Status.KEEP and "keep" not in allowed)   # wrongly kept
        print(f"{fault:58} {'LOST' if r is None else r.status.value:9} {'' if r is None else r.reason[:160]}")
        if lost or r.status.value not in allowed or not any(s in r.reason for s in says):
            problems.append(f"{fault}: {None if r is None else (r.status.value, r.reason)}")
        bad = list(damage.get(fault, []))
        if exp_id in watch:
            bad += [f"pid {p} outlived the run" for p in outlived.get(exp_id, ["(not checked)"])]
            bad += ["no sleeper seen during the run (the check would miss one)"] * (not seen.get(exp_id))
        if r is not None and (r.val_bpb is None) != (r.status is not Status.DISCARD):
            bad.append(f"val_bpb {r.val_bpb} on a {r.status.value}")     # a failed run is never scored
        if r is not None and r.status is Status.DISCARD and fault in at_run and "TOTAL_BATCH_SIZE" not in \
                at_run[fault][0] and r.val_bpb != pytest.approx(baseline, abs=1e-5):     # no WIN ridden along
            bad.append(f"val_bpb {r.val_bpb} != the baseline's {baseline}: what it did around training changed "
                       "the model")
        if fault.startswith("floods") and r is not None:
            log = next((root / "runs" / "t").glob(f"{exp_id:04d}-*/train.log"))
            size = log.stat().st_size
            bad += [f"train.log of {size} bytes, over the cap of 1 MB"] * (size > 2**20 + 2**16)
        problems += [f"{fault}: {b}" for b in bad]
        table.add(f"misbehaving: {fault}", 1, lost, 0, kept, int(bool(bad)))
    table.add("misbehaving: an honest win afterwards", 1, 0, 0, 0, int(honest.status is not Status.KEEP))
    table.add("misbehaving: repo after all", 1, counts.lost, counts.duplicated, counts.wrongly_kept,
              counts.inconsistent)
    # nothing the runs did reached the repo, .git or the records
    assert (git_dir / "HEAD").read_text().strip() == "ref: refs/heads/autoresearch/t"
    assert not (root / "runs" / ".work").exists() or not any((root / "runs" / ".work").glob("t-0*"))
    assert honest.status is Status.KEEP and honest.description == "honest win", (honest.status, honest.reason)
    assert not problems, "\n".join(problems)
    assert not counts.notes, counts.notes
    assert not leftovers(cache, t0)
