"""What runs again at the next session, and what does not: an experiment cut off by a stop (Ctrl-C, then
SIGTERM) or failed outside its proposal (the training data changed under it, the evaluator killed) runs again,
once; a proposal's own crash does not; a baseline killed again and again is run again, never given up for a
proposal. Real Loops on temp git repos with the scripted train stand-in."""

from __future__ import annotations

import os
import shutil
import signal

import pytest

from autoresearch.records.ledger import Status, read_results

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def _isolated(monkeypatch):
    for var in ("AR_PROFILE", "AR_TIME_BUDGET", "AR_SEED", "AR_DATASET", "AR_TOK_DIR", "AR_CHECKPOINT_DIR"):
        monkeypatch.delenv(var, raising=False)


def _on_step_of(exp_id: int, act):
    """An on_event that calls act() once, at the first training step of experiment exp_id."""
    done: list[bool] = []

    def on_event(e):
        if e.kind == "step" and e.spec is not None and e.spec.id == exp_id and not done:
            done.append(True)
            act()
    return on_event


def test_a_run_whose_data_changed_under_it_runs_again_at_the_next_session(tmp_path, tiny_dataset, monkeypatch):
    """Item 2, the data's case: the training data changes while experiment 2 trains (a file touched: the fingerprint
    holds size, times and inode), so the run is a crash and the session halts; it is not the proposal's doing, so
    the next `ar run` runs that proposal again, once."""
    from autoresearch.session.loop import Loop
    from test_loop import assert_consistent, cfg, make_repo
    cache = tmp_path / "cache"              # a copy of the shared dataset: this test changes it
    cache.mkdir()
    shutil.copytree(tiny_dataset.cache / tiny_dataset.name, cache / "builtin")
    monkeypatch.setenv("AR_CACHE", str(cache))
    train_bin = cache / "builtin" / tiny_dataset.tok_dir.relative_to(tiny_dataset.cache / tiny_dataset.name) / "train.bin"
    root = make_repo(tmp_path)
    said: list[str] = []
    hook = _on_step_of(2, lambda: os.utime(train_bin))
    with Loop(cfg(noise=0.002), root, "t", None, on_event=lambda e: (said.append(e.message), hook(e))) as lp:
        lp.enqueue_knobs({"LR_MULT": 1.5})
        first = lp.run()
    rows = assert_consistent(root)
    assert [r.status for r in rows] == [Status.KEEP, Status.CRASH] and first.failed, [r.reason for r in rows]
    assert "training data" in rows[1].reason and "changed" in rows[1].reason, rows[1].reason
    assert any("0002" in m and "outside the proposal" in m and "runs again as experiment 0003" in m
               for m in said), said
    with Loop(cfg(noise=0.002), root, "t", None) as lp:     # the next session: its own fingerprint of the data
        lp.run()
    rows = assert_consistent(root)
    assert len(rows) == 3 and rows[2].knobs["LR_MULT"] == 1.5 and rows[2].status is not Status.CRASH, rows
    assert "again: 0002" in rows[2].description, rows[2].description


def test_an_experiment_cut_off_by_a_stop_runs_again_once_at_the_next_session(tmp_path, prepared_cache):
    from autoresearch.proposers.search import StrategyProposer
    from autoresearch.session.loop import Loop
    from test_loop import assert_consistent, cfg, make_repo

    root = make_repo(tmp_path)
    c = cfg(noise=0.002)
    said: list[str] = []
    stop = lambda sig: _on_step_of(2, lambda: os.kill(os.getpid(), sig))   # noqa: E731  Ctrl-C, then SIGTERM
    s = Loop(c, root, "t", StrategyProposer(), on_event=lambda e: (said.append(e.message),
                                                                    stop(signal.SIGINT)(e))).run(max_experiments=4)
    assert s.interrupted
    rows = read_results(s.results)
    assert [r.status for r in rows] == [Status.KEEP, Status.INTERRUPTED], rows
    cut = rows[1]
    assert any("experiment 0002" in m and "runs again" in m for m in said), said
    said.clear()
    hook = _on_step_of(3, lambda: os.kill(os.getpid(), signal.SIGTERM))
    s = Loop(c, root, "t", StrategyProposer(), on_event=lambda e: (said.append(e.message), hook(e))).run(
        max_experiments=1)                                                            # the same commit again ...
    again = read_results(s.results)[2]
    assert again.commit == cut.commit and again.status is Status.INTERRUPTED, again   # ... cut off once more
    assert any("experiment 0003 (the re-run of 0002)" in m and "not run again" in m for m in said), said
    s = Loop(c, root, "t", StrategyProposer()).run(max_experiments=1)
    rows = assert_consistent(root)
    assert len(rows) == 4 and rows[3].commit != cut.commit and rows[3].status in (Status.KEEP, Status.DISCARD), rows


def test_a_crash_outside_the_proposal_runs_again_once(tmp_path, prepared_cache):
    import psutil
    from autoresearch.session.loop import Loop
    from test_loop import assert_consistent, cfg, make_repo

    def kill_the_evaluator():
        for p in psutil.Process().children(recursive=True):
            try:
                if "autoresearch.harness.evaluator" in " ".join(p.cmdline()):
                    os.killpg(p.pid, signal.SIGKILL)
            except (psutil.Error, OSError):
                pass

    root = make_repo(tmp_path)
    said: list[str] = []
    hook = _on_step_of(2, kill_the_evaluator)
    with Loop(cfg(noise=0.002), root, "t", None, on_event=lambda e: (said.append(e.message), hook(e))) as lp:
        lp.enqueue_knobs({"LR_MULT": 1.5})
        lp.run()
    rows = assert_consistent(root)
    assert [r.status for r in rows[:2]] == [Status.KEEP, Status.CRASH], rows
    assert "evaluation failed" in rows[1].reason, rows[1].reason
    assert len(rows) == 3 and rows[2].knobs["LR_MULT"] == 1.5 and rows[2].status is Status.DISCARD, rows
    assert any("0002" in m and "outside the proposal" in m and "runs again as experiment 0003" in m
               for m in said), said
    # a proposal's own crash is not run again
    with Loop(cfg(noise=0.002), root, "t", None) as lp:
        lp.enqueue_knobs({"FAIL_MODE": "crash"})
        lp.run()
    rows = assert_consistent(root)
    assert len(rows) == 4 and rows[3].status is Status.CRASH, rows


def test_the_baseline_is_never_given_up(tmp_path, prepared_cache):
    """kill -9 during the baseline, again and again: the next session runs it again, never a proposal in its
    place (which would be `first result: … is the baseline`)."""
    from autoresearch.proposers.search import StrategyProposer
    from autoresearch.records.queue import ExperimentQueue
    from autoresearch.session.loop import MAX_STARTS, Loop
    from test_loop import assert_consistent, cfg, make_repo

    root = make_repo(tmp_path)
    q = ExperimentQueue(root / "runs" / "t" / "queue.jsonl")
    spec = q.add("baseline", {})
    for _ in range(MAX_STARTS):                         # started, and ar killed with it, MAX_STARTS times
        q.start(spec.id)
    said: list[str] = []
    s = Loop(cfg(noise=0.002), root, "t", StrategyProposer(), on_event=lambda e: said.append(e.message)).run(
        max_experiments=2)
    rows = assert_consistent(root)
    assert len(rows) == 2 and rows[0].status is Status.KEEP, rows
    assert rows[0].description == "baseline" and rows[0].exp_id == spec.id, rows
    assert "first result" not in rows[1].reason and not s.failed, rows[1].reason
    assert any("the baseline" in m and "runs again" in m for m in said), said
