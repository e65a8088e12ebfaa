"""The scheduler's dispatch and settle order, its limits and a resume, against a scripted executor: real git
repos and the real Loop, queue and ledger, but no training process. Each slot's run returns a val_bpb from its
knobs, and finishes when the test says so, so the order of finishing is the test's, never the machine's."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import pytest

from autoresearch.records.events import read as read_events
from autoresearch.executors.local import LocalExecutor
from autoresearch.experiment import settle
from autoresearch.experiment.evaluate import Verdict
from autoresearch.experiment.execute import TrainOutcome
from autoresearch.experiment.trial import Trial
from autoresearch.records.ledger import read_results
from autoresearch.process import RunResult
from autoresearch.session.loop import Loop
from autoresearch.slots import Slot

from test_loop import _isolated, assert_consistent, cfg, make_repo  # noqa: F401  (autouse fixture)

pytestmark = pytest.mark.e2e

WAIT = 60.0       # the most a scripted run waits for the test to let it finish (a hang, not a timing)


def bowl(knobs: dict) -> float:
    """val_bpb of a knob setting: lower the nearer TOTAL_BATCH_SIZE is to 2**17."""
    size = knobs.get("TOTAL_BATCH_SIZE", 2**19)
    return 3.0 + 0.1 * abs(size.bit_length() - 18)


class Scripted(LocalExecutor):
    """`n` slots on this machine (each its own worktree, as with --gpus cpu:n) whose training is a script:
    `gates[exp_id]` (when given) must be set before that experiment's run ends."""

    name = "scripted"

    def __init__(self, n: int, gates: dict[int, threading.Event] | None = None):
        super().__init__([Slot(i, None, "cpu") for i in range(n)])
        self.gates = gates or {}
        self.dispatched: list[tuple[int, int]] = []      # (exp_id, slot) as runs started
        self.finished: list[int] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self._lock = threading.Lock()

    def train(self, loop, ctx, x, budget: float, seed: int):
        with self._lock:
            self.dispatched.append((x.spec.id, ctx.slot.index))
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        gate = self.gates.get(x.spec.id)
        try:
            if gate is not None:
                assert gate.wait(WAIT), f"experiment {x.spec.id} was never let finish"
            log = x.exp_dir / "train.log"
            log.write_text("scripted run\n")
            result = RunResult(0, False, None, budget, log, False)
            val = bowl(x.knobs)
            outcome = TrainOutcome(result, 0.1, budget, 0.05, None, False, window=budget)
            settle.take(loop, x, Trial(outcome, Verdict(val, None, None, {"val_bpb": val}, None), True, None, None))
            return result, None
        finally:
            with self._lock:
                self.in_flight -= 1
                self.finished.append(x.spec.id)


def loop(root, ex, **kw) -> Loop:
    return Loop(cfg(noise=0.01, **kw), root, "t", executor=ex)


def test_one_slot_runs_the_queue_in_order(tmp_path):
    root = make_repo(tmp_path)
    ex = Scripted(1)
    with loop(root, ex) as lp:
        for size in (2**18, 2**20, 2**17, 2**16):
            lp.enqueue_knobs({"TOTAL_BATCH_SIZE": size})
        lp.run()
    rows = assert_consistent(root)
    assert [r.exp_id for r in rows] == [1, 2, 3, 4, 5] == [i for i, _ in ex.dispatched]
    assert [r.status.value for r in rows] == ["keep", "keep", "discard", "keep", "discard"]
    assert ex.most_in_flight == 1


def test_the_baseline_trains_alone_then_slots_fill_in_queue_order_and_settle_in_dispatch_order(tmp_path,
                                                                                                monkeypatch):
    """Two slots: the baseline trains alone while 2 is prepared beside it and waits for its decision; then 2 and 3
    at once; 3 finishes first but is recorded after 2; 4 takes 3's slot as soon as it is free."""
    root = make_repo(tmp_path)
    gates = {i: threading.Event() for i in (1, 2, 3, 4)}
    ex = Scripted(2, gates)
    order: list[int] = []
    alone: list[bool] = []
    waiting = threading.Event()                 # the scheduler has dispatched what it may and waits on its flights
    real_wait = cf.wait
    monkeypatch.setattr(cf, "wait", lambda *a, **k: (waiting.set(), real_wait(*a, **k))[1])

    def conductor():
        _wait_until(lambda: waiting.is_set() and ex.dispatched == [(1, 0)] and _phase(root, 2) == "waiting")
        alone.append(ex.dispatched == [(1, 0)] and not lp.queue.is_started(3))   # 2 committed, not run; 3 not yet
        gates[1].set()                                       # the baseline
        _wait_until(lambda: {2, 3} <= {i for i, _ in ex.dispatched})
        assert 1 in ex.finished and len(ex.dispatched) == 3  # nothing went beside the baseline
        gates[3].set()
        _wait_until(lambda: 3 in ex.finished)
        order.append(len(read_results(root / "runs" / "t" / "results.tsv")))   # 3 done, 2 not: only the baseline
        gates[2].set()
        gates[4].set()

    t = threading.Thread(target=conductor)
    with loop(root, ex, gpus="cpu:2") as lp:
        for size in (2**18, 2**17, 2**16):
            lp.enqueue_knobs({"TOTAL_BATCH_SIZE": size})
        t.start()
        lp.run()
    t.join()
    rows = assert_consistent(root)
    assert alone == [True] and order == [1]
    assert [r.exp_id for r in rows] == [1, 2, 3, 4, 5]
    # dispatched in queue order: as the scheduler started them (its events); the slots' own threads may begin
    # two runs dispatched together in either order on a busy CPU
    started = [e["exp_id"] for e in read_events(root / "runs" / "t" / "events.jsonl")
               if e["type"] == "experiment_started"]
    assert started == [1, 2, 3, 4, 5] and sorted(i for i, _ in ex.dispatched) == started
    assert ex.finished.index(3) < ex.finished.index(2)
    assert ex.most_in_flight == 2
    # 2 (2**18) and 3 (2**17) both beat the baseline from the same parent: 3 is settled after 2 was kept, so its
    # win is stale and runs again on top of the new best as experiment 5, where it is kept; 4 (2**16, dispatched
    # into 3's slot) only ties the new best
    assert [r.status.value for r in rows] == ["keep", "keep", "stale", "discard", "keep"]
    assert rows[4].knobs["TOTAL_BATCH_SIZE"] == 2**17 and "re-run on top of it as experiment 0005" in rows[2].reason


@pytest.mark.parametrize("queued, max_experiments, slots, ran", [
    (4, 3, 1, 3),         # the baseline + 2 of the queue
    (4, 3, 2, 3),         # in flight counts: never a 4th dispatched beside the 3rd
    (1, 5, 2, 2),         # the queue runs out first
])
def test_max_experiments_counts_what_is_in_flight(tmp_path, queued, max_experiments, slots, ran):
    root = make_repo(tmp_path)
    ex = Scripted(slots)
    with loop(root, ex, gpus=f"cpu:{slots}") as lp:
        for i in range(queued):
            lp.enqueue_knobs({"LR_MULT": 1.0 + 0.5 * (i + 1)})
        s = lp.run(max_experiments=max_experiments)
    assert len(ex.dispatched) == ran == s.experiments == len(assert_consistent(root))


def test_a_resumed_session_runs_what_is_left_in_queue_order(tmp_path):
    root = make_repo(tmp_path)
    first = Scripted(1)
    with loop(root, first) as lp:
        for i in range(4):
            lp.enqueue_knobs({"LR_MULT": 1.0 + 0.5 * (i + 1)})
        lp.run(max_experiments=3)
    assert [i for i, _ in first.dispatched] == [1, 2, 3]
    second = Scripted(1)
    with loop(root, second) as lp:
        lp.run()
    assert [i for i, _ in second.dispatched] == [4, 5]
    assert [r.exp_id for r in assert_consistent(root)] == [1, 2, 3, 4, 5]


def _phase(root, exp_id: int) -> str | None:
    """The last phase the event log gives experiment exp_id."""
    phases = [e["phase"] for e in read_events(root / "runs" / "t" / "events.jsonl")
              if e["type"] == "phase" and e["exp_id"] == exp_id]
    return phases[-1] if phases else None


def test_a_run_prepared_beside_a_baseline_that_is_not_kept_never_runs_and_is_queued_again(tmp_path):
    """The baseline fails (its slot fails) while 2 waits beside it: 2 never trains, is recorded `interrupted`
    with the reason, the session stops on the baseline, and 2 is queued to run again at the next session."""
    root = make_repo(tmp_path)
    ex = Scripted(2)
    real = ex.train

    def train(loop, ctx, x, budget, seed):
        if x.spec.kind == "baseline":
            _wait_until(lambda: _phase(root, 2) == "waiting")      # 2 prepared and committed, waiting
            raise RuntimeError("the baseline's run failed")
        return real(loop, ctx, x, budget, seed)

    ex.train = train
    with loop(root, ex, gpus="cpu:2") as lp:
        lp.enqueue_knobs({"TOTAL_BATCH_SIZE": 2**18})
        s = lp.run()
        pending = [(sp.kind, sp.payload.get("again_of")) for sp in lp.queue.pending()]
    rows = read_results(root / "runs" / "t" / "results.tsv")
    assert [r.status.value for r in rows] == ["crash", "interrupted"], [r.reason for r in rows]
    assert ex.dispatched == [] and s.failed and "baseline" in s.stop_reason
    assert "the baseline it waited for was not kept" in rows[1].reason and rows[1].commit
    assert pending == [("knobs", 2)]       # 2's knob edit again, at the next session (after its baseline)


def test_a_run_that_ends_at_once_beside_the_baseline_frees_no_room_for_more(tmp_path, monkeypatch):
    """Two slots; the baseline trains while re-runs of a missing commit wait in the queue. The first ends at once
    (its commit is not found) but cannot be recorded before the baseline: its slot takes nothing more, or it would
    churn through the queue (an agent failing fast) while the baseline trains."""
    root = make_repo(tmp_path)
    gate = threading.Event()
    ex = Scripted(2, {1: gate})
    pending_sizes: list[int] = []
    seen: list[list[bool]] = []
    real_wait = cf.wait
    monkeypatch.setattr(cf, "wait", lambda fs, *a, **k: (pending_sizes.append(len(fs)), real_wait(fs, *a, **k))[1])

    def conductor():
        _wait_until(lambda: lp.queue.is_started(2) and pending_sizes[-3:] == [1, 1, 1])   # 2 ended; 3 waits passed
        seen.append([lp.queue.is_started(i) for i in (3, 4, 5)])
        gate.set()

    t = threading.Thread(target=conductor)
    with loop(root, ex, gpus="cpu:2") as lp:
        for i in range(4):
            lp.queue.add("rerun", {"commit": "0" * 40, "seed": i})
        t.start()
        lp.run()
    t.join()
    assert seen == [[False, False, False]]
    rows = assert_consistent(root)
    assert [r.status.value for r in rows] == ["keep"] + ["validation"] * 4, [r.reason for r in rows]


def _wait_until(cond) -> None:
    """Wait for a state of the scheduler (polled), bounded by WAIT: a hang fails, a slow machine does not."""
    deadline = time.monotonic() + WAIT
    while not cond():
        assert time.monotonic() < deadline, "the scheduler never got there"
        time.sleep(0.01)


def test_a_flight_knows_when_it_ended_before_a_waiter_wakes():
    """Ctrl-C's verdict reads when each run ended (an end after the stop: `interrupted`). cf.wait wakes its waiter
    before the future's done-callbacks run, so the end is noted in the slot itself: here a slow callback holds
    the callbacks back, and the waiter still reads the end (read from a done-callback, it read 0 under load and a
    run cut off by Ctrl-C was recorded as a crash)."""
    from autoresearch.session.scheduler import Flight, _timed
    go, hold = threading.Event(), threading.Event()
    flight = Flight(None, None, None)
    with cf.ThreadPoolExecutor(max_workers=1) as pool:
        flight.future = pool.submit(_timed, flight, go.wait, WAIT)
        flight.future.add_done_callback(lambda _f: hold.wait(WAIT))
        before = time.time()
        go.set()
        cf.wait([flight.future])
        ended = flight.finished_at
        hold.set()
    assert ended >= before


@pytest.mark.parametrize("steps, may_start, called_off, decided", [
    ((), True, False, True),                             # no baseline in flight
    (("close",), None, False, False),                    # shut: a run waits
    (("close", "trained"), True, False, False),          # trained cleanly: runs start while it is scored, but
                                                         # one that ends first waits for the decision to weigh it
    (("close", "trained", "kept"), True, False, True),
    (("close", "trained", "not kept"), False, True, True),   # a run that started is called off
    (("close", "not kept"), False, True, True),          # it never trained cleanly: nothing starts
    (("close", "kept"), True, False, True),              # decided without the early word (a Ray slot's baseline)
    (("close", "not kept", "close"), None, False, False),    # the next baseline: shut again, nothing called off
])
def test_the_baseline_gate(steps, may_start, called_off, decided):
    from autoresearch.session.scheduler import BaselineGate
    stopping = threading.Event()
    gate = BaselineGate(stopping)
    for step in steps:
        {"close": gate.close, "trained": gate.trained, "kept": lambda: gate.open(True),
         "not kept": lambda: gate.open(False)}[step]()
    assert gate.called_off() is called_off
    if may_start is not None:
        assert gate.is_open() and gate.wait() is may_start
    if decided:
        assert gate.wait_decided() is True
    else:
        assert not gate.is_open() if may_start is None else gate.is_open()
        stopping.set()                                   # a stop frees what waits: no decision, no start
        assert gate.wait_decided() is False and gate.wait() is False
