"""runs/<tag>/events.jsonl: the fold as a pure function, the file on disk (a cut last line, a flood of steps),
and the views that fold it — `ar status` and `ar serve` — over a real loop, and after a kill -9 of it."""

from __future__ import annotations

import json
import os
import signal
from types import SimpleNamespace

import psutil
from typer.testing import CliRunner

from autoresearch.cli import app
from autoresearch.records.events import KILLED, EventLog, against_lock, compact, fold, read
from autoresearch.experiment.metrics import StepPoint
from autoresearch.views.status import read_status

from test_loop import _isolated, ar, make_repo, wait_for, write_cfg  # noqa: F401  (autouse fixture)
from test_serve import Served

from fixtures.clocks import ManualClock
import pytest

SLOTS = [{"slot": 0, "label": "GPU 0", "gpu": 0, "kind": "gpu"}, {"slot": 1, "label": "GPU 1", "gpu": 1, "kind": "gpu"}]


def ev(t, type, **fields):
    return {"t": t, "type": type, **fields}


def step(t, exp_id, n):
    return ev(t, "step", exp_id=exp_id, step=n, pct=float(n), loss=4.0 - n / 100, tokens_per_s=1e5, mfu=40.0,
              dt_ms=50, remaining_s=100 - n)


def session(t=0.0, by_slot=False, pid=7):
    return ev(t, "session_started", tag="t", branch="autoresearch/t", profile="cpu", by_slot=by_slot,
              slots=SLOTS if by_slot else [SLOTS[0]], budget=300, noise=0.002, pid=pid, host="h")


# ---------------------------------------------------------------------------------------- fold (pure)

def test_fold_of_nothing():
    st = fold([])
    assert st["state"] is None and st["experiment"] is None and st["step"] is None and st["last"] is None


def test_fold_follows_one_experiment_through_its_phases():
    events = [session(), ev(1, "experiment_started", exp_id=1, kind="propose", slot=0, parent="abc", commit="",
                            description="", budget=None)]
    assert fold(events)["experiment"]["phase"] == "started"
    events += [ev(2, "phase", exp_id=1, phase="proposing"),
               ev(3, "phase", exp_id=1, phase="committing", description="wider MLP"),
               ev(4, "phase", exp_id=1, phase="training", commit="1234567", budget=300), step(5, 1, 10), step(7, 1, 20)]
    st = fold(events)
    assert st["state"] == "running" and st["tag"] == "t" and st["pid"] == 7 and "slots" not in st
    x = st["experiment"]
    assert (x["id"], x["kind"], x["phase"], x["description"], x["commit"], x["time_budget"]) == (
        1, "propose", "training", "wider MLP", "1234567", 300)
    assert st["step"]["step"] == 20 and st["step"]["remaining_s"] == 80 and st["updated"] == 7
    events += [ev(8, "phase", exp_id=1, phase="evaluating"), ev(9, "phase", exp_id=1, phase="settling")]
    assert fold(events)["experiment"]["phase"] == "settling"
    events.append(ev(10, "experiment_settled", exp_id=1, status="keep", value=2.9, reason="better", commit="1234567"))
    st = fold(events)
    assert st["experiment"] is None and st["step"] is None and st["state"] == "running"
    assert st["last"] == {"exp_id": 1, "status": "keep", "value": 2.9, "reason": "better", "commit": "1234567", "t": 10}
    events.append(ev(11, "session_stopped", why="reached --max-experiments 1"))
    st = fold(events)
    assert st["state"] == "stopped" and st["why"] == "reached --max-experiments 1" and st["last"]["exp_id"] == 1


def test_fold_by_slot():
    events = [session(by_slot=True),
              ev(1, "experiment_started", exp_id=1, kind="knobs", slot=0, description="a"),
              ev(1, "experiment_started", exp_id=2, kind="knobs", slot=1, description="b"),
              ev(2, "phase", exp_id=2, phase="training"), step(3, 2, 5) | {"node": "n1"},
              ev(4, "phase", exp_id=1, phase="settling"),
              ev(5, "experiment_started", exp_id=3, kind="knobs", slot=0, description="c")]   # before 1 is settled
    st = fold(events)
    assert "experiment" not in st and [s["label"] for s in st["slots"]] == ["GPU 0", "GPU 1"]
    s0, s1 = st["slots"]
    assert s0["experiment"]["id"] == 3 and s0["step"] is None
    assert s1["experiment"]["phase"] == "training" and s1["step"]["step"] == 5 and s1["node"] == "n1"
    events += [ev(6, "experiment_settled", exp_id=2, status="discard", value=3.0, reason="", commit="x")]
    assert fold(events)["slots"][1]["experiment"] is None


def test_a_new_session_forgets_what_the_last_one_left_in_flight():
    events = [session(pid=7), ev(1, "experiment_started", exp_id=4, kind="propose", slot=0), step(2, 4, 3),
              session(t=10, pid=8)]                                  # killed mid-experiment, then resumed
    st = fold(events)
    assert st["state"] == "running" and st["pid"] == 8 and st["experiment"] is None and st["since"] == 10


def test_garbage_and_unknown_events_are_ignored():
    events = [session(), {"type": "phase"}, {"t": 1, "type": "step", "exp_id": "x"}, ev(2, "surprise", a=1)]
    assert fold(events) == fold([session()])


def test_against_lock():
    st = fold([session(pid=7), ev(1, "experiment_started", exp_id=1, kind="propose", slot=0)])
    holder = {"pid": 7, "host": "h", "tag": "t"}
    assert against_lock(st, holder) is st                                                  # its writer holds it
    assert against_lock(st, {"pid": None, "host": None, "tag": None}) is st                # held, not yet named
    for dead in (None, holder | {"pid": 9}, holder | {"tag": "u"}):     # killed; a new session; another tag's
        out = against_lock(st, dead)
        assert out["state"] == "stopped" and out["why"] == KILLED and out["experiment"] is None
    assert st["state"] == "running"                                                         # a pure function
    slots = fold([session(by_slot=True), ev(1, "experiment_started", exp_id=1, kind="propose", slot=1)])
    assert [s["experiment"] for s in against_lock(slots, None)["slots"]] == [None, None]
    stopped = fold([session(), ev(1, "session_stopped", why="done")])
    assert against_lock(stopped, None) is stopped


def test_compact_keeps_the_fold():
    events = [session(by_slot=True), ev(0.5, "experiment_settled", exp_id=99, status="crash", value=None,
                                        reason="before", commit="")]
    t, exp_id = 1.0, 0
    for exp_id in range(1, 30):
        slot = exp_id % 2
        events += [ev(t, "experiment_started", exp_id=exp_id, kind="propose", slot=slot),
                   ev(t, "phase", exp_id=exp_id, phase="training", description=f"idea {exp_id}")]
        events += [step(t + n / 100, exp_id, n) for n in range(50)]
        if exp_id < 28:
            events.append(ev(t + 1, "experiment_settled", exp_id=exp_id, status="discard", value=3.0, reason="",
                             commit=""))
        t += 2
        if exp_id == 10:
            events += [ev(t, "session_stopped", why="x"), session(t, by_slot=True, pid=8)]
    small = compact(events)
    assert fold(small) == fold(events) and len(small) < 12 and len(events) > 1000
    assert compact(small) == small
    for cut in (1, 5, 200, 700, 1300):                      # at any moment of the night
        assert fold(compact(events[:cut])) == fold(events[:cut])


# ------------------------------------------------------------------------------------------ the file

def _x(exp_id):
    return SimpleNamespace(spec=SimpleNamespace(id=exp_id, kind="propose", payload={}), parent="p", sha="",
                           description="", time_budget=None)


def _p(n):
    return StepPoint(step=n, pct=n / 10, loss=3.0, tokens_per_s=1e5, mfu=None, dt_ms=5, remaining_s=0)


def test_a_partial_last_line_is_skipped_and_cut_before_the_next(tmp_path):
    f = tmp_path / "events.jsonl"
    whole = json.dumps(session()) + "\n" + json.dumps(ev(1, "experiment_started", exp_id=1, kind="baseline",
                                                          slot=0)) + "\n"
    f.write_text(whole + '{"t":2,"type":"phase","exp_id":1,"pha')       # the writer was killed mid-line
    events = read(f)
    assert [e["type"] for e in events] == ["session_started", "experiment_started"]
    assert fold(events)["experiment"]["phase"] == "started"
    log = EventLog(f)                                                   # the next session cuts it off first
    log.session_started(tag="t", by_slot=False, slots=[])
    lines = f.read_text().splitlines()
    assert len(lines) == 3 and all(json.loads(line) for line in lines) and f.read_text().endswith("\n")
    assert fold(read(f))["experiment"] is None and fold(read(f))["pid"] == os.getpid()


def test_steps_are_throttled_and_the_last_one_is_kept(tmp_path):
    f = tmp_path / "events.jsonl"
    log = EventLog(f)
    log.session_started(tag="t", by_slot=False, slots=[])
    x = _x(1)
    log.started(SimpleNamespace(slot=SimpleNamespace(index=0)), x)
    for n in range(1, 501):
        log.step(x, _p(n))
    log.phase(x, "evaluating")
    types = [e["type"] for e in read(f)]
    assert types == ["session_started", "experiment_started", "step", "step", "phase"]
    assert [e["step"] for e in read(f) if e["type"] == "step"] == [1, 500]


def test_the_throttle_and_the_stamps_are_on_the_logs_clock(tmp_path):
    """A step line a second, a step event every 5 s of the log's clock (moved by the test), the last one flushed
    before the phase that ends the run; every event stamped with that clock's time."""
    clock = ManualClock(wall=5000.0)
    f = tmp_path / "events.jsonl"
    log = EventLog(f, step_every=5.0, clock=clock)
    log.session_started(tag="t", by_slot=False, slots=[])
    x = _x(1)
    log.started(SimpleNamespace(slot=SimpleNamespace(index=0)), x)
    for n in range(1, 21):
        log.step(x, _p(n))
        clock.advance(1.0)
    log.phase(x, "evaluating")
    events = read(f)
    assert [e["step"] for e in events if e["type"] == "step"] == [1, 6, 11, 16, 20]
    assert [e["t"] for e in events if e["type"] == "step"][:4] == [5000.0, 5005.0, 5010.0, 5015.0]
    assert events[-1]["t"] == 5020.0


def test_a_flood_of_steps_stays_bounded(tmp_path):
    f = tmp_path / "events.jsonl"
    cap = 32 * 1024
    log = EventLog(f, step_every=0, max_bytes=cap)
    ctx = SimpleNamespace(slot=SimpleNamespace(index=0))
    log.session_started(tag="t", by_slot=False, slots=[SLOTS[0]])
    sizes = []
    for exp_id in range(1, 41):
        x = _x(exp_id)
        log.started(ctx, x)
        log.phase(x, "training", description=f"idea {exp_id}", budget=300)
        for n in range(1, 301):
            log.step(x, _p(n))
            sizes.append(f.stat().st_size)
        if exp_id < 40:
            log.settled(x, SimpleNamespace(status=SimpleNamespace(value="discard"), val_bpb=3.0, reason="worse",
                                           commit=f"{exp_id:07x}"))
    assert len(sizes) == 12_000 and max(sizes) <= cap + 1024      # ~1.2 MB written through a 32 KB file
    st = fold(read(f))
    assert st["experiment"]["id"] == 40 and st["experiment"]["description"] == "idea 40"
    assert st["step"]["step"] == 300 and st["last"]["exp_id"] == 39 and st["state"] == "running"
    assert not list(tmp_path.glob("*.tmp"))       # compaction replaced the file whole, nothing left beside it


# ------------------------------------------------------------------------------- a real loop, its views

@pytest.mark.e2e
def test_a_real_loop_writes_its_events_in_order_and_status_folds_them(tmp_path):
    root = make_repo(tmp_path)
    conf = write_cfg(tmp_path, time_budget=3)
    p = ar("run", "--repo", str(root), "--tag", "t", "--config", str(conf), "--max-experiments", "2", cwd=tmp_path)
    try:
        def training_2():
            st = read_status(root)["status"]
            x = st["experiment"] or {}
            return x.get("id") == 2 and x["phase"] == "training" and st["step"] and st["state"] == "running"
        wait_for(training_2, timeout=60, what="experiment 2 training")
        out = CliRunner().invoke(app, ["status", "--repo", str(root)], terminal_width=200).output
        assert f"running: pid {p.pid}" in out and "now: experiment 0002, a proposal, is training: strategy:" in out, out
        assert "step" in out and "best: " in out and "1 keep" in out
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    finally:
        if p.poll() is None:
            p.kill()
    events = read(root / "runs/t/events.jsonl")
    assert not (root / "runs/t/status.json").exists()                  # one source: no snapshot beside it
    assert events[0]["type"] == "session_started" and events[0]["pid"] == p.pid and events[0]["by_slot"] is False
    assert events[-1] == events[-1] | {"type": "session_stopped", "why": "reached --max-experiments 2"}
    assert [e["t"] for e in events] == sorted(e["t"] for e in events)
    for exp_id, phases in ((1, ["training", "evaluating", "settling"]),
                           (2, ["proposing", "committing", "training", "evaluating", "settling"])):
        mine = [e for e in events if e.get("exp_id") == exp_id]
        assert mine[0]["type"] == "experiment_started" and mine[-1]["type"] == "experiment_settled"
        assert [e["phase"] for e in mine if e["type"] == "phase"] == phases
        kinds = [e["type"] if e["type"] != "phase" else e["phase"] for e in mine]
        assert "step" in kinds[kinds.index("training"):kinds.index("evaluating")]        # steps while training
        assert "step" not in kinds[kinds.index("evaluating"):]
    out = CliRunner().invoke(app, ["status", "--repo", str(root)], terminal_width=200).output
    assert "no ar loop is running" in out and "last tag: t, last stop: reached --max-experiments 2" in out, out
    assert "now: idle" in out
    doc = json.loads(CliRunner().invoke(app, ["status", "--json", "--repo", str(root)]).output)
    assert doc["running"] is False and doc["status"]["state"] == "stopped" and doc["status"]["last"]["exp_id"] == 2


@pytest.mark.e2e
def test_kill_9_status_and_the_dashboard_say_not_running(tmp_path):
    root = make_repo(tmp_path)
    conf = write_cfg(tmp_path, time_budget=5)
    p = ar("run", "--repo", str(root), "--tag", "t", "--config", str(conf), "--max-experiments", "3", cwd=tmp_path)
    server = None
    try:
        wait_for(lambda: (read_status(root)["status"]["step"] or {}).get("step", 0) > 1, timeout=60,
                 what="the baseline training")
        server = Served("--repo", str(root), "--tag", "t", cwd=tmp_path)
        st = json.loads(server.get("/api/state")[2])["status"]
        assert st["state"] == "running" and st["experiment"]["id"] == 1 and st["pid"] == p.pid
        children = psutil.Process(p.pid).children(recursive=True)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        psutil.wait_procs(children, timeout=10)
        doc = json.loads(CliRunner().invoke(app, ["status", "--json", "--repo", str(root)]).output)
        assert doc["running"] is False and doc["status"]["state"] == "stopped" and doc["status"]["why"] == KILLED
        assert doc["status"]["experiment"] is None
        out = CliRunner().invoke(app, ["status", "--repo", str(root)], terminal_width=200).output
        assert "no ar loop is running" in out and "killed mid-session" in out and "now: idle" in out, out
        assert fold(read(root / "runs/t/events.jsonl"))["state"] == "running"       # the file alone would lie
        wait_for(lambda: json.loads(server.get("/api/state")[2])["status"]["state"] == "stopped", timeout=30,
                 what="the dashboard to see the kill")
        st = json.loads(server.get("/api/state")[2])["status"]
        assert st["why"] == KILLED and st["experiment"] is None
    finally:
        if p.poll() is None:
            p.kill()
        if server is not None:
            server.stop()
