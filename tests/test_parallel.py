"""Several slots on CPU: real temp repos, real subprocesses, the scripted train stand-in.

Two slots run two experiments at once; decisions go in dispatch order even when a later run finishes first;
a win on a parent that is no longer the best is re-run on the new best (or recorded `stale`)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from autoresearch.cli import app
from autoresearch.config import load_config
from autoresearch.errors import ConfigError, GpuError, LockHeld
from autoresearch.slots import Slot, parse_gpus
from autoresearch.executors.local import LocalExecutor
from autoresearch.gitops import GitRepo
from autoresearch.harness.env import default_cache
from autoresearch.records.ledger import Status, read_results
from autoresearch.records.lock import RepoLock, gpu_lock_path
from autoresearch.views.status import read_status
from autoresearch.session.loop import Loop as ParallelLoop
from autoresearch.proposers.search import StrategyProposer

from test_loop import _isolated, assert_consistent, cfg, make_repo, statuses  # noqa: F401  (autouse fixture)


def window(root: Path, row, tag: str = "t") -> tuple[float, float]:
    """(start, finish) of one run's training: the stand-in's own stamps in its log."""
    log = (root / "runs" / tag / f"{row.exp_id:04d}-{row.commit}" / "train.log").read_text()
    start = float(re.search(r"started (\d+\.\d+)", log).group(1))
    return start, float(re.search(r"finished (\d+\.\d+)", log).group(1))


def test_parse_gpus():
    assert parse_gpus("cpu:2") == [Slot(0, None, "cpu"), Slot(1, None, "cpu")]
    assert [s.gpu for s in parse_gpus("0,3", probe=False)] == [0, 3]
    assert parse_gpus("cpu:2")[1].env == {"CUDA_VISIBLE_DEVICES": ""}
    assert Slot(1, 3).env == {"CUDA_VISIBLE_DEVICES": "3"} and Slot(1, 3).label == "GPU 3"
    assert [s.gpu for s in parse_gpus("0,0", probe=False)] == [0, 0]     # two slots that take turns on GPU 0
    assert [s.gpu for s in parse_gpus("0,0,0", probe=False)] == [0, 0, 0]   # three: one trains, two get ready
    for bad, msg in (("0,0,0,0", "three times at most"), ("gpu", "GPU indices"), ("cpu:0", "1 to 64")):
        with pytest.raises(ConfigError, match=msg):
            parse_gpus(bad, probe=False)


def test_an_agent_on_one_gpu_takes_turns_by_default(monkeypatch):
    from autoresearch.slots import turns_on_one_gpu
    assert turns_on_one_gpu({"CUDA_VISIBLE_DEVICES": "3"}) == "3,3"
    assert turns_on_one_gpu({"CUDA_VISIBLE_DEVICES": "0,1"}) is None
    assert turns_on_one_gpu({"CUDA_VISIBLE_DEVICES": ""}) is None
    monkeypatch.setattr("autoresearch.slots.visible_gpus", lambda: [0])
    assert turns_on_one_gpu({}) == "0,0"
    monkeypatch.setattr("autoresearch.slots.visible_gpus", lambda: [0, 1])
    assert turns_on_one_gpu({}) is None


def test_gpus_not_on_this_machine(monkeypatch):
    monkeypatch.setattr("autoresearch.slots.visible_gpus", lambda: [0])
    with pytest.raises(GpuError, match="GPU 1 is not on this machine.*cpu:N"):
        parse_gpus("1")
    monkeypatch.setattr("autoresearch.slots.visible_gpus", lambda: [])
    with pytest.raises(GpuError, match="lists no GPU"):
        parse_gpus("all")


def test_config_keys(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("gpus: [0, 1]\nstale_policy: record\n")
    c = load_config(f)
    assert c.gpus == "0,1" and c.stale_policy == "record"
    f.write_text("stale_policy: merge\n")
    with pytest.raises(ConfigError, match="stale_policy .* must be rerun or record"):
        load_config(f)
    with pytest.raises(ConfigError, match="--gpus|gpus"):
        load_config(None, {"gpus": "zero"})


@pytest.mark.e2e
def test_two_slots_run_at_once_and_status_shows_both(tmp_path):
    root = make_repo(tmp_path)
    seen: list[str] = []            # `ar status` once both slots were training

    def watch():
        while not done.is_set():
            slots = (read_status(root).get("status") or {}).get("slots") or []
            if sum(1 for s in slots if s["experiment"] and s["experiment"]["phase"] == "training" and s["step"]) == 2:
                seen.append(CliRunner().invoke(app, ["status", "--repo", str(root)], terminal_width=200).output)
                return
            time.sleep(0.1)

    done = threading.Event()
    # 3-s windows: two start-ups on a loaded CPU may differ by a second or more, and the windows must overlap
    with ParallelLoop(cfg(gpus="cpu:2", time_budget=3.0), root, "t") as lp:
        lp.enqueue_knobs({"TOTAL_BATCH_SIZE": 2**18})
        lp.enqueue_knobs({"LR_MULT": 1.5})
        t = threading.Thread(target=watch)
        t.start()
        s = lp.run()
        done.set()
        t.join()
    assert statuses(root) == ["keep", "keep", "discard"], s
    rows = assert_consistent(root)
    (a0, a1), (b0, b1) = window(root, rows[1]), window(root, rows[2])
    assert a0 < b1 and b0 < a1, "the two experiments did not overlap in time"
    assert min(a1, b1) - max(a0, b0) > 1.0
    assert seen, "never saw both slots training"
    assert "cpu slot 0: experiment 000" in seen[0] and "cpu slot 1: experiment 000" in seen[0] and "step" in seen[0]
    wt = root / "runs" / "t" / "worktrees"
    assert sorted(p.name for p in wt.iterdir()) == ["slot-0", "slot-1"]
    assert GitRepo(root).dirty_paths() == [] and not GitRepo(root).untracked()
    log = (root / "runs" / "t" / f"0002-{rows[1].commit}" / "train.log").read_text()
    assert "CUDA_VISIBLE_DEVICES=''" in log          # a CPU slot sees no GPU
    assert rows[2].parent == rows[0].commit          # both proposals started from the baseline


@pytest.mark.e2e
def test_decisions_in_dispatch_order_and_stale_win_rerun(tmp_path):
    # A (dispatched first) finishes last and wins; B (finished first) beats A too, but its parent is the
    # baseline: recorded stale and re-run on top of A, where it wins again.
    root = make_repo(tmp_path)
    events = []
    with ParallelLoop(cfg(gpus="cpu:2"), root, "t", on_event=lambda e: events.append(e)) as lp:
        lp.enqueue_knobs({"TOTAL_BATCH_SIZE": 2**18, "START_DELAY": 2.5}, description="A")
        lp.enqueue_knobs({"TOTAL_BATCH_SIZE": 2**17}, description="B")
        lp.run()
    rows = assert_consistent(root)
    assert [(r.exp_id, r.description, r.status.value) for r in rows] == [
        (1, "baseline", "keep"), (2, "A", "keep"), (3, "B", "stale"), (4, "B", "keep")]
    assert window(root, rows[2])[1] < window(root, rows[1])[1], "B should have finished before A"
    assert "no longer the best" in rows[2].reason and "experiment 0004" in rows[2].reason
    assert rows[3].parent == rows[1].commit and rows[2].val_bpb == pytest.approx(rows[3].val_bpb, abs=1e-5)
    assert rows[3].val_bpb < rows[1].val_bpb - 0.02
    results = [e.row.exp_id for e in events if e.kind == "result"]
    assert results == [1, 2, 3, 4]
    knobs = GitRepo(root).file_at(GitRepo(root).head_sha(), "train.py")
    assert "TOTAL_BATCH_SIZE = 2**17" in knobs and "START_DELAY = 2.5" in knobs


@pytest.mark.e2e
@pytest.mark.slow
def test_an_agents_stale_win_is_replayed_on_the_new_best_and_recorded(tmp_path):
    """An agent's win on a stale parent: its diff is applied on top of the new best (the lines both changed
    take the replayed side), run, and recorded with a result (it was once recorded `rejected` instead)."""
    import json
    import shlex
    import sys

    from autoresearch.proposers.agent import AgentProposer
    from test_loop import AGENTS
    root = make_repo(tmp_path)
    # 2 (slow) wins first; 3 (fast) beats it from the baseline; 4 goes into 3's freed slot and loses, slowly
    # enough to still be running when 2 settles, so the freed slot takes the replay (not a 5th agent proposal)
    edits = {"2": {"TOTAL_BATCH_SIZE": "2**18", "START_DELAY": "2.5"}, "3": {"TOTAL_BATCH_SIZE": "2**17"},
             "4": {"LR_MULT": "1.5", "START_DELAY": "6"}}
    agent = " ".join(shlex.quote(a) for a in (sys.executable, str(AGENTS / "by_experiment.py"), json.dumps(edits),
                                              "{prompt_file}"))
    with ParallelLoop(cfg(gpus="cpu:2"), root, "t", AgentProposer(agent, timeout=30)) as lp:
        lp.run(max_experiments=5)
    rows = assert_consistent(root)
    # 4 starts 6 s late on a 0.5-s budget: past the session's startup credit (experiment/clock.py), or, where
    # the credit is loose enough, a plain discard (LR_MULT 1.5 is worse)
    got = [(r.exp_id, r.status.value) for r in rows]
    assert got[3] in ((4, "discard"), (4, "timeout")), [(r.status.value, r.reason) for r in rows]
    assert got[:3] + got[4:] == [(1, "keep"), (2, "keep"), (3, "stale"), (5, "keep")], \
        [(r.status.value, r.reason) for r in rows]
    assert "re-run on top of it as experiment 0005" in rows[2].reason
    assert rows[4].parent == rows[1].commit and rows[4].val_bpb == pytest.approx(rows[2].val_bpb, abs=1e-5)
    text = GitRepo(root).file_at(GitRepo(root).head_sha(), "train.py")
    assert "TOTAL_BATCH_SIZE = 2**17" in text and "START_DELAY = 2.5" in text


@pytest.mark.e2e
def test_stale_policy_record(tmp_path):
    root = make_repo(tmp_path)
    with ParallelLoop(cfg(gpus="cpu:2", stale_policy="record"), root, "t") as lp:
        lp.enqueue_knobs({"TOTAL_BATCH_SIZE": 2**18, "START_DELAY": 2.5}, description="A")
        lp.enqueue_knobs({"TOTAL_BATCH_SIZE": 2**17}, description="B")
        s = lp.run()
    assert statuses(root) == ["keep", "keep", "stale"]
    assert "stale_policy: record" in read_results(root / "runs" / "t" / "results.tsv")[2].reason
    assert s.best.description == "A"
    assert_consistent(root)


@pytest.mark.e2e
def test_failures_and_rejections_in_slots(tmp_path):
    root = make_repo(tmp_path)
    with ParallelLoop(cfg(gpus="cpu:2"), root, "t") as lp:
        lp.enqueue_knobs({"FAIL_MODE": "crash"})
        lp.enqueue_knobs({"FAIL_MODE": "write_tracked"})
        lp.enqueue_knobs({"DEPTH": 9})
        lp.run()
    assert statuses(root) == ["keep", "crash", "discard", "discard"]
    rows = assert_consistent(root)
    assert "scripted crash" in rows[1].reason
    # the run wrote program.md in its own copy of the tree, which is thrown away: no tree of the repo changed
    assert rows[2].val_bpb == pytest.approx(rows[0].val_bpb, abs=1e-5)
    for tree in [root, *(root / "runs" / "t" / "worktrees").iterdir()]:
        assert "changed at run time" not in (tree / "program.md").read_text()


@pytest.mark.e2e
def test_builtin_proposer_does_not_repeat_a_point_in_flight(tmp_path):
    root = make_repo(tmp_path)
    lp = ParallelLoop(cfg(gpus="cpu:3"), root, "t", StrategyProposer())
    s = lp.run(max_experiments=7)
    rows = assert_consistent(root)
    assert s.experiments == 7 and len(rows) == 7
    points = [json.dumps(r.knobs, sort_keys=True) for r in rows]
    assert len(set(points)) == len(points), "two slots tried the same point"


@pytest.mark.e2e
def test_gpu_slots_pin_and_lock(tmp_path):
    root = make_repo(tmp_path)
    held = RepoLock(gpu_lock_path(default_cache(), 1), tag="other", command="ar run --gpus 1", label="on GPU 1")
    held.acquire()
    try:
        with pytest.raises(LockHeld, match="on GPU 1: pid"):
            ParallelLoop(cfg(gpus="cpu:2"), root, "t", executor=LocalExecutor([Slot(0, 0), Slot(1, 1)])).open()
        assert read_status(root)["holder"] is None      # the repo lock was given back too
    finally:
        held.release()
    lp = ParallelLoop(cfg(gpus="cpu:2"), root, "t", executor=LocalExecutor([Slot(0, 0), Slot(1, 1)]))
    with lp:
        lp.enqueue_knobs({"DEPTH": 9})
        lp.enqueue_knobs({"DEPTH": 7})
        with pytest.raises(LockHeld, match="on GPU 0"):
            RepoLock(gpu_lock_path(default_cache(), 0), tag="x", command="x", label="on GPU 0").acquire()
        lp.run()
    logs = {p.parent.name: p.read_text() for p in (root / "runs" / "t").glob("000*/train.log")}
    devices = sorted(re.search(r"CUDA_VISIBLE_DEVICES='(\d)'", t).group(1) for t in logs.values())
    assert devices == ["0", "0", "1"]       # the baseline alone on GPU 0, then one experiment per GPU
    with RepoLock(gpu_lock_path(default_cache(), 0), tag="x", command="x"):
        pass                                 # given back when the loop closed


@pytest.mark.e2e
def test_two_slots_on_one_gpu_take_turns(tmp_path):
    """`--gpus 0,0`: never two training processes on the GPU at once, but the next experiment's proposal and
    workspace overlap a training, and its process starts while the last one is still being evaluated. 3-s
    windows: the next run's launcher (torch's import, 2-4 s on a busy 2-core machine) is ready before the
    training it waits for ends, as it is beside a GPU's longer windows."""
    root = make_repo(tmp_path)
    lp = ParallelLoop(cfg(gpus="cpu:2", time_budget=3.0), root, "t", executor=LocalExecutor([Slot(0, 0), Slot(1, 0)]))
    with lp:
        for lr in (1.5, 0.8, 1.2, 0.9):
            lp.enqueue_knobs({"LR_MULT": lr})
        lp.run()
    rows = assert_consistent(root)
    assert len(rows) == 5
    windows = sorted(window(root, r) for r in rows)
    assert all(a[1] <= b[0] for a, b in zip(windows, windows[1:])), windows      # one training at a time
    timing = [_timing(root, r) for r in sorted(rows, key=lambda r: r.exp_id)]
    pairs = list(zip(timing[1:], timing[2:]))
    assert any(b["prepare"] < a["process_exit"] for a, b in pairs)      # prepared while the other trained
    assert any(b["process_start"] < a["eval_done"] for a, b in pairs)   # started while the other was scored
    assert any(b["spawned"] < a["process_exit"] for a, b in pairs)      # its interpreter and imports even earlier
    for r, t in zip(sorted(rows, key=lambda r: r.exp_id), timing):      # but none of train.py before its turn
        assert window(root, r)[0] >= t["process_start"] - 0.05, (r.exp_id, t)
    with RepoLock(gpu_lock_path(default_cache(), 0), tag="x", command="x"):
        pass                                 # one lock for the shared GPU, given back


@pytest.mark.e2e
def test_with_a_head_start_the_next_run_goes_beside_the_last_seconds_of_the_window(tmp_path):
    """`head_start: true` (here on the CPU, where it is charged in CPU seconds; "auto" gives it on a GPU where GPU
    seconds are read): once a start-up has been measured on the GPU, the next run's clock starts ("go") while the
    other run still trains; its first batch waits for the turn, and that wait is not its start-up's. Two windows
    never overlap. The last run burns 6 CPU-s in its start-up (the stand-in's own takes about 1): beside the
    other's window, as after it, the excess comes off its window. Every start-up sleeps 2.5 s (wall, no CPU), as
    a GPU's compile takes seconds: the lead, then, is seconds, more than the up to one step (about 1.5 s here)
    by which a run ends before its window does. 7-s windows: the next run's launcher (torch's import, 2-4 s on a
    busy 2-core machine) is ready one start-up before the other's window ends."""
    root = make_repo(tmp_path, START_DELAY=2.5)
    said: list[str] = []
    lp = ParallelLoop(cfg(gpus="cpu:2", time_budget=7.0, head_start=True, startup_allowance=60.0), root, "t",
                      executor=LocalExecutor([Slot(0, 0), Slot(1, 0)]), on_event=lambda e: said.append(e.message))
    with lp:
        for lr in (1.5, 0.8):
            lp.enqueue_knobs({"LR_MULT": lr})
        lp.enqueue_knobs({"TOTAL_BATCH_SIZE": 2**18, "FAIL_MODE": "burn_start", "BURN_CPU_S": 6.0})
        lp.run()
    rows = sorted(assert_consistent(root), key=lambda r: r.exp_id)
    assert len(rows) == 4
    assert any("(head_start)" in (m or "") for m in said), said       # the session says it at its start
    timing = [_timing(root, r) for r in rows]
    metrics = [json.loads((root / "runs" / "t" / f"{r.exp_id:04d}-{r.commit}" / "metrics.json").read_text())
               for r in rows]
    for a, b in zip(timing, timing[1:]):       # one training at a time: each first batch after the last exit
        assert a["process_exit"] <= b["window_start"], (a, b)
    assert {(t["device"], t["gpu"], t["session"]) for t in timing} == {("cpu", "0", lp.session)}   # gpu_use.py's
    assert timing[1]["head_start"] is None     # beside the baseline it waits for the baseline's training instead
    for i in (2, 3):                           # the next two go early, on the start-ups measured before them
        a, b = timing[i - 1], timing[i]
        assert b["head_start"] is not None, timing
        assert b["process_start"] < a["process_exit"] <= b["window_start"], (a, b)   # go beside it, batch after
        assert a["window_end"] - b["process_start"] > 1.0, (a, b)    # about one start-up (2.5 s) ahead
        waited = b["window_start"] - b["process_start"] - metrics[i]["startup_seconds"]
        assert waited == pytest.approx(b["turn_wait"], abs=0.05), (b, metrics[i])   # the wait is not start-up
    assert metrics[3]["startup_cpu"] > 5.0 and "cut by" in (metrics[3]["window_note"] or ""), metrics[3]
    assert metrics[3]["window_seconds"] < 7.0 - 1.5, metrics[3]
    assert "cut by" in rows[3].reason, rows[3].reason


@pytest.mark.e2e
def test_three_slots_on_one_gpu_take_turns_beside_a_slot_on_another(tmp_path):
    """`--gpus 0,0,0,1` (parsed without a probe): four slots, three on GPU 0; on each GPU one training at a time,
    while the two GPUs train side by side."""
    slots = parse_gpus("0,0,0,1", probe=False)
    assert [(s.index, s.gpu) for s in slots] == [(0, 0), (1, 0), (2, 0), (3, 1)]
    root = make_repo(tmp_path)
    lp = ParallelLoop(cfg(gpus="cpu:4", time_budget=1.0), root, "t", executor=LocalExecutor(slots))
    with lp:
        for lr in (1.5, 0.8, 1.2, 0.9):
            lp.enqueue_knobs({"LR_MULT": lr})
        lp.run()
    rows = assert_consistent(root)
    assert len(rows) == 5
    per_gpu: dict[str, list] = {}
    for r in rows:
        log = (root / "runs" / "t" / f"{r.exp_id:04d}-{r.commit}" / "train.log").read_text()
        gpu = re.search(r"CUDA_VISIBLE_DEVICES='(\d)'", log).group(1)
        per_gpu.setdefault(gpu, []).append(window(root, r))
    assert set(per_gpu) == {"0", "1"}, per_gpu
    for gpu, ws in per_gpu.items():
        ws.sort()
        assert all(a[1] <= b[0] for a, b in zip(ws, ws[1:])), (gpu, ws)         # one training per GPU at a time
    assert any(a[0] < b[1] and b[0] < a[1] for a in per_gpu["0"] for b in per_gpu["1"]), per_gpu  # side by side


def _timing(root: Path, row, tag: str = "t") -> dict:
    return json.loads((root / "runs" / tag / f"{row.exp_id:04d}-{row.commit}" / "timing.json").read_text())


@pytest.mark.e2e
def test_beside_the_baseline_the_next_run_starts_once_it_has_trained_on_the_credit_it_left(tmp_path):
    """`--gpus 0,0`: the run prepared beside the baseline starts its launcher while the baseline trains and takes
    the GPU as soon as the baseline has trained cleanly, while the baseline is being scored, not after its
    decision. Its clock is still the baseline's: a start-up that burns 6 CPU-s before its first batch (the
    stand-in's own takes about 1) has the excess taken off its window, as it would after the decision."""
    root = make_repo(tmp_path)
    lp = ParallelLoop(cfg(gpus="cpu:2", time_budget=4.0, startup_allowance=60.0), root, "t",
                      executor=LocalExecutor([Slot(0, 0), Slot(1, 0)]))
    with lp:
        lp.enqueue_knobs({"TOTAL_BATCH_SIZE": 2**18, "FAIL_MODE": "burn_start", "BURN_CPU_S": 6.0})
        lp.run()
    rows = assert_consistent(root)
    assert [r.status.value for r in rows] == ["keep", "discard"], [r.reason for r in rows]
    base, cand = _timing(root, rows[0]), _timing(root, rows[1])
    assert cand["spawned"] < base["process_exit"], (cand, base)          # its launcher, while the baseline trained
    assert base["process_exit"] <= cand["process_start"] < base["eval_done"], (cand, base)   # its clock: meanwhile
    metrics = json.loads((root / "runs" / "t" / f"0002-{rows[1].commit}" / "metrics.json").read_text())
    assert metrics["startup_cpu"] > 5.0 and "cut by" in (metrics["window_note"] or ""), metrics
    assert metrics["window_seconds"] < 4.0 - 1.5, metrics                # the excess off its window
    assert "cut by" in rows[1].reason, rows[1].reason


@pytest.mark.e2e
def test_a_run_started_beside_a_baseline_that_is_then_not_kept_is_called_off_and_queued_again(tmp_path):
    """The baseline trains cleanly, so the run beside it starts, but its model then fails at evaluation (after
    8 s): that run is stopped at once (its log says why), recorded `interrupted`, and queued to run again at the
    next session, with nothing measured against a baseline that was not kept."""
    root = make_repo(tmp_path, FAIL_MODE="eval_error", EVAL_DELAY=8.0)
    lp = ParallelLoop(cfg(gpus="cpu:2", time_budget=4.0), root, "t", executor=LocalExecutor([Slot(0, 0), Slot(1, 0)]))
    with lp:
        lp.enqueue_knobs({"LR_MULT": 0.8, "TOTAL_BATCH_SIZE": 2**18}, time_budget=30.0)    # still training at 8 s
        s = lp.run()
        pending = [(sp.kind, sp.payload.get("again_of")) for sp in lp.queue.pending()]
    rows = read_results(root / "runs" / "t" / "results.tsv")
    assert [r.status.value for r in rows] == ["rejected", "interrupted"], [r.reason for r in rows]
    assert "the model failed" in rows[0].reason and s.failed and "baseline" in s.stop_reason
    assert rows[1].reason.startswith("not run to its end: the baseline it waited for was not kept"), rows[1].reason
    log = (root / "runs" / "t" / f"0002-{rows[1].commit}" / "train.log").read_text()
    assert "run stopped (called off: the baseline it ran beside was not kept)" in log, log[-600:]
    assert "| loss " in log.split("[ar] run stopped")[0], log[-600:]          # it had trained before that
    assert pending == [("knobs", 2)]


@pytest.mark.integration
def test_the_launcher_runs_nothing_of_the_tree_before_go(tmp_path):
    """harness/launcher.py starts in the run's tree but imports nothing from it (-I): a tree that plants its
    own `autoresearch` package is not run; the script runs only after `go`; a closed pipe calls the run off with
    nothing run."""
    import os
    (tmp_path / "autoresearch" / "harness").mkdir(parents=True)
    for f in ("autoresearch/__init__.py", "autoresearch/harness/__init__.py"):
        (tmp_path / f).write_text("print('planted code ran', flush=True)\n")
    (tmp_path / "train.py").write_text("import os, time\nprint('script at', time.time(), 'go')\n")
    for go in (b"go\n", b""):
        r, w = os.pipe()
        proc = subprocess.Popen([sys.executable, "-I", "-B", "-m", "autoresearch.harness.launcher", str(r),
                                 "train.py"], cwd=tmp_path, pass_fds=(r,), stdout=subprocess.PIPE, text=True)
        os.close(r)
        assert proc.stdout.readline() == "[ar] launcher ready\n"     # its trusted start-up is done; nothing ran
        sent = time.time()
        os.write(w, go) if go else None
        os.close(w)
        out = proc.communicate(timeout=120)[0]
        assert proc.returncode == 0 and "planted" not in out, out
        if go:
            m = re.search(r"script at (\S+) go", out)
            assert m and float(m.group(1)) >= sent, out
        else:
            assert out == "", out                           # after its own line, nothing: nothing of the tree ran


@pytest.mark.e2e
@pytest.mark.slow
def test_cli_run_and_sweep_with_gpus(tmp_path):
    root = make_repo(tmp_path)
    conf = tmp_path / "run.yaml"
    conf.write_text("profile: cpu\nprepare_data: false\ntime_budget: 0.5\nstartup_allowance: 10\neval_tokens: 2048\n")
    r = CliRunner().invoke(app, ["run", "--repo", str(root), "--tag", "t", "--gpus", "cpu:2", "--max-experiments",
                                 "3", "--config", str(conf)], terminal_width=200)
    assert r.exit_code == 0, r.output
    assert "2 slots (cpu slot 0, cpu slot 1)" in r.output
    assert len(statuses(root)) == 3
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("name: two\naxes:\n  DEPTH: [7, 9]\n  LR_MULT: [1.0, 1.5]\norder: listed\n")
    r = CliRunner().invoke(app, ["sweep", str(sweep), "--repo", str(root), "--config", str(conf), "--gpus", "cpu:2"],
                           terminal_width=200)
    assert r.exit_code == 0, r.output
    rows = read_results(root / "runs" / "sweep-two" / "results.tsv")
    assert len(rows) >= 4 and {r.status for r in rows} <= {Status.KEEP, Status.DISCARD, Status.STALE}
    r = CliRunner().invoke(app, ["run", "--repo", str(root), "--tag", "u", "--gpus", "0,0,0,0"], terminal_width=200)
    assert r.exit_code != 0 and "listed three times at most" in str(r.exception)


def _ar_run(root: Path, conf: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "autoresearch", "run", "--repo", str(root), "--tag", "t", "--gpus",
                             "cpu:2", "--config", str(conf), *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _wait_both_training(root: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        slots = (read_status(root).get("status") or {}).get("slots") or []
        if sum(1 for s in slots if s["experiment"] and s["step"]) == 2:
            return
        time.sleep(0.1)
    raise AssertionError("the two slots never trained at once")


def _train_procs(root: Path) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline", "cwd"]):
        try:
            if "train.py" in (p.info["cmdline"] or []) and str(root) in (p.info["cwd"] or ""):
                out.append(p)
        except psutil.Error:
            pass
    return out


@pytest.mark.e2e
@pytest.mark.slow
def test_ctrl_c_and_kill_9_with_two_slots(tmp_path):
    root = make_repo(tmp_path)
    conf = tmp_path / "run.yaml"
    conf.write_text("profile: cpu\nprepare_data: false\ntime_budget: 4\nstartup_allowance: 10\neval_tokens: 2048\n")
    proc = _ar_run(root, conf)
    _wait_both_training(root, proc)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert statuses(root)[-2:] == ["interrupted", "interrupted"], out
    assert_consistent(root)
    assert not _train_procs(root)

    proc = _ar_run(root, conf, "--max-experiments", "4")
    _wait_both_training(root, proc)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while _train_procs(root) and time.monotonic() < deadline:     # PR_SET_PDEATHSIG takes them down
        time.sleep(0.1)
    assert not _train_procs(root)
    before = len(statuses(root))
    lp = ParallelLoop(cfg(gpus="cpu:2", time_budget=4.0), root, "t", StrategyProposer())   # the tag's budget
    lp.run(max_experiments=2)
    assert len(statuses(root)) == before + 2
    assert_consistent(root)
