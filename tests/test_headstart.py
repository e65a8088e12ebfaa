"""The head start (experiment/headstart.py, executors/local.GpuTurn): when the next run on a shared GPU may start
beside the running window's last seconds, as tables; the turn's order with a run that started early, with real
threads. The loop with it on the CPU: tests/test_parallel.py."""

from __future__ import annotations

import threading
import time

import pytest

from autoresearch.executors.local import GpuTurn
from autoresearch.experiment import headstart
from autoresearch.harness import gputime

from fixtures.nvml import NvmlStandIn

pytestmark = pytest.mark.fast
GiB = 2**30


@pytest.mark.parametrize("mode, device, expect", [
    ("auto", "cuda", True), ("auto", "cpu", False),     # on the CPU the neighbour's window would share the cores
    (True, "cpu", True), (True, "cuda", True), (False, "cuda", False),
])
def test_what_the_setting_asks_for(mode, device, expect):
    assert headstart.asked(mode, device) is expect


A, B = False, True      # a start-up alone on the GPU; beside a training window (a head start)


@pytest.mark.parametrize("startups, expect", [
    ([], None),                                          # no start-up seen on this GPU yet: no head start
    ([(4.0, A)], 4.0 * headstart.BESIDE_FACTOR),         # alone only: one beside a window takes longer
    ([(3.0, A), (9.0, A), (5.0, A)], 5.0 * headstart.BESIDE_FACTOR),   # the median of the last three
    ([(41.8, A), (7.6, A), (11.0, B)], 11.0),            # once one ran beside a window, those are what count
    ([(1.0, B), (2.0, B), (50.0, B), (3.0, B), (4.0, B), (2.0, A)], 4.0),   # a cold compile among them moves nothing
    ([(40.0, B), (38.0, B), (41.0, B)], headstart.LEAD_CAP),   # never more than the cap ahead
    ([(-1.0, A)], None),
])
def test_the_lead_is_the_recent_start_up_where_the_next_one_will_run_capped(startups, expect):
    assert headstart.lead(startups) == pytest.approx(expect) if expect is not None else \
        headstart.lead(startups) is None


@pytest.mark.parametrize("now, end, lead, expect", [
    (100.0, None, 5.0, False),           # the holder's window has not opened: its end is unknown
    (100.0, 110.0, None, False),         # no start-up measured yet
    (100.0, 110.0, 5.0, False),          # more than one start-up left
    (105.0, 110.0, 5.0, True),
    (112.0, 110.0, 5.0, True),           # past its end (the holder is saving): go
])
def test_a_run_is_due_one_start_up_before_the_window_ends(now, end, lead, expect):
    assert headstart.due(now, end, lead) is expect


@pytest.mark.parametrize("free, total, held, cap, expect", [
    (52 * GiB, 80 * GiB, 28 * GiB, None, True),      # an H100 at 2**19: room for another 28 GiB + the evaluator
    (36 * GiB, 80 * GiB, 28 * GiB, None, False),     # the evaluator's workers already took some
    (115 * GiB, 141 * GiB, 26 * GiB, None, True),    # an H200
    (14 * GiB, 32 * GiB, 15 * GiB, None, False),     # an RTX 5090 at 2**19: a second window does not fit
    (52 * GiB, 80 * GiB, 15 * GiB, 32 * GiB, False),  # the same, emulated on an H100 (AR_GPU_MEMORY_GB=32)
    (70 * GiB, 80 * GiB, 3 * GiB, 32 * GiB, True),   # a small model fits the emulated card twice
])
def test_a_head_start_needs_the_memory_of_another_window_and_the_evaluator(free, total, held, cap, expect):
    assert headstart.fits(free, total, held, cap) is expect


def _in_thread(fn):
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


def test_a_run_that_started_early_keeps_its_place_before_one_that_waits():
    turn, a, b, c = GpuTurn(threading.Event()), "a", "b", "c"
    assert turn.take(a) == "turn"
    turn.opened(a, 123.0, lambda: {1})
    assert turn.window_end == 123.0
    assert turn.take(b, early=lambda: True) == "early"
    tc, got_c = _in_thread(lambda: turn.take(c, early=lambda: True))   # only one run goes early at a time
    tc.join(0.5)
    assert tc.is_alive()
    turn.give_back(a)
    tc.join(0.5)
    assert tc.is_alive() and turn.holder is None               # the GPU is free, but it is b's next
    assert turn.take(b) == "turn" and turn.window_end is None  # b's first batch: the turn is b's at once
    turn.give_back(b)
    tc.join(2)
    assert got_c == ["turn"]


def test_runs_that_wait_get_the_turn_and_the_head_start_in_the_order_they_asked():
    """Three slots on one GPU: while a holds it, b then c wait; b (first in line) alone may go early, c gets the
    turn only after b, and d, asking last, only after c, whoever wakes first."""
    turn, order = GpuTurn(threading.Event()), []
    assert turn.take("a") == "turn"
    go_early = threading.Event()
    tb, got_b = _in_thread(lambda: turn.take("b", early=go_early.is_set))
    for _ in range(100):
        if turn.line == ["b"]:
            break
        time.sleep(0.01)
    tc, got_c = _in_thread(lambda: turn.take("c", early=lambda: True))   # c would go early, but b is first
    for _ in range(100):
        if turn.line == ["b", "c"]:
            break
        time.sleep(0.01)
    assert turn.line == ["b", "c"] and turn.next is None
    go_early.set()
    tb.join(2)
    assert got_b == ["early"] and turn.next == "b" and tc.is_alive()
    td, got_d = _in_thread(lambda: (turn.take("d"), order.append("d")))
    turn.give_back("a")
    tc.join(0.5)
    assert tc.is_alive() and turn.holder is None               # free, but b's: c and d still wait
    assert turn.take("b") == "turn"
    order.append("b")
    turn.give_back("b")
    tc.join(2)
    assert got_c == ["turn"] and td.is_alive()
    order.append("c")
    turn.give_back("c")
    td.join(2)
    assert order == ["b", "c", "d"] and turn.holder == "d" and turn.line == []


def test_a_run_that_started_early_and_ends_before_its_turn_gives_its_place_up():
    turn, cancel = GpuTurn(threading.Event()), threading.Event()
    assert turn.take("a") == "turn"
    assert turn.take("b", early=lambda: True) == "early"
    tb, got_b = _in_thread(lambda: turn.take("b", cancel=cancel))   # its first batch, waiting
    cancel.set()                                                    # its process is gone: the run closes
    tb.join(2)
    assert got_b == [None] and turn.next is None
    turn.give_back("b")                        # what the run does when it closes: nothing of a's is touched
    assert turn.holder == "a"
    turn.give_back("a")
    assert turn.take("c") == "turn"


def test_no_head_start_is_offered_while_early_says_no_and_none_once_the_session_stops():
    stopping = threading.Event()
    turn = GpuTurn(stopping)
    assert turn.take("a") == "turn"
    asked = []
    tb, got_b = _in_thread(lambda: turn.take("b", early=lambda: asked.append(1) or False))
    tb.join(1.0)
    assert tb.is_alive() and len(asked) >= 2                  # asked again and again while it waits
    stopping.set()
    tb.join(2)
    assert got_b == [None] and turn.next is None and turn.holder == "a"


def test_the_holder_reads_what_the_run_that_started_early_has_used_until_that_run_takes_the_turn():
    turn = GpuTurn(threading.Event())
    assert turn.take("a") == "turn" and turn.lent() == 0.0             # nobody beside it
    turn.started_early("b", lambda: 1.5)
    assert turn.lent() == 0.0                                          # b has not started early: nothing to read
    assert turn.take("b", early=lambda: True) == "early"
    turn.started_early("b", lambda: 1.5)
    assert turn.lent() == 1.5
    turn.give_back("a")
    assert turn.take("b") == "turn" and turn.lent() == 0.0             # b's own window now: nothing lent to it


@pytest.mark.parametrize("extended, said", [(0.0, False), (0.3, False), (1.0, True), (14.9, True)])
def test_a_row_says_when_its_window_got_a_second_or_more_back(extended, said):
    note = headstart.given_back_note(extended)
    assert (note is not None) is said
    if said:
        assert f"{extended:.1f}s past its budget" in note and "training window was" not in note   # not a short one


@pytest.mark.parametrize("head, evals, expect", [
    (0.3, 0.0, (0.3, 0.0)),                          # a warm start-up's warm-up steps
    (0.0, 8.9, (0.0, 8.9)),                          # the last run's evaluation beside the window
    (40.0, 90.0, (headstart.LEAD_CAP, headstart.EVAL_CAP)),   # each capped: a window is never doubled
    (-1.0, -2.0, (0.0, 0.0)),                        # a meter's odd read gives back nothing, takes nothing
])
def test_what_a_window_gets_back_from_each_neighbour(head, evals, expect):
    assert headstart.given_back(head, evals) == pytest.approx(expect)


@pytest.mark.parametrize("head, evals, said", [
    (0.3, 0.0, None), (0.0, 0.6, None),
    (0.3, 8.9, "ran 9.2s past its budget: the GPU seconds used beside it (the next run's head start 0.3s, "
               "the evaluation beside it 8.9s)"),
    (0.0, 8.9, "ran 8.9s past its budget: the GPU seconds used beside it (the evaluation beside it 8.9s)"),
])
def test_a_row_says_which_neighbour_its_seconds_came_back_for(head, evals, said):
    note = headstart.given_back_note(head, evals)
    assert note is None if said is None else said in note


def test_the_turn_names_the_processes_of_every_evaluator_on_its_gpu_and_a_moved_window_end():
    turn = GpuTurn(threading.Event())
    assert turn.evaluator_pids() == set()
    turn.evaluating(0, lambda: {10, 11})
    turn.evaluating(1, lambda: {20})
    turn.evaluating(1, lambda: {21, 22})             # a slot's server restarted: its new processes, not the old
    assert turn.evaluator_pids() == {10, 11, 21, 22}
    assert turn.take("a") == "turn"
    turn.opened("a", 100.0, lambda: {30})
    turn.moved("b", 150.0)                           # not the holder: no say
    turn.moved("a", 108.5)
    turn.moved("a", 104.0)                           # a window given seconds back is never shortened
    assert turn.window_end == 108.5


def test_only_the_evaluators_reported_gpu_seconds_come_back_not_a_process_that_left_a_proposals_tree():
    """The attack: a proposal double-forks a GPU worker out of its run's tree, so it belongs to no run, and burns
    the GPU while its own window trains, hoping its window is paid for that as for an evaluation beside it. Only
    the evaluators' processes are read; and an evaluator's worker that exits is given back what the driver
    reported, not the wall time to its exit (as a run's exiting helper is charged)."""
    turn = GpuTurn(threading.Event())
    evaluator = {40, 41}                             # the server and a model worker of the other slot
    turn.evaluating(1, lambda: set(evaluator))
    nv = NvmlStandIn()
    meter = gputime.GpuMeter(nv, [0], floor_exits=False)     # as TrainingRun makes the window's
    clock = [100.0]
    meter.now = lambda: clock[0]
    alive = {40, 41, 77}
    meter.alive = lambda pid: pid in alive
    meter.start(turn.evaluator_pids)
    t0 = meter._last[0]
    nv.samples = [(41, t0 + k * 200_000, 100) for k in range(1, 6)] + \
                 [(77, t0 + k * 200_000, 100) for k in range(1, 51)]      # 77: the runaway, 10 s of GPU
    meter.read()
    clock[0] += 20.0                                 # the worker exits 20 s later
    alive.discard(41)
    evaluator.discard(41)
    assert meter.seconds() == pytest.approx(1.0)
    meter.stop()


@pytest.mark.integration
def test_an_evaluator_server_names_its_processes_while_it_runs_and_none_once_stopped(tmp_path):
    from autoresearch.experiment.evaluate import Server
    server = Server(tmp_path / "evaluator.log")
    assert server.pids() == set()
    proc = server.ensure()
    try:
        for _ in range(200):                         # its fork server is forked at its start
            if len(server.pids()) >= 2:
                break
            time.sleep(0.05)
        pids = server.pids()
        assert proc.pid in pids and len(pids) >= 2, (pids, (tmp_path / "evaluator.log").read_text()[-2000:])
    finally:
        server.close()
    assert server.pids() == set()


def test_a_window_gets_back_both_neighbours_seconds_and_the_next_head_start_is_timed_from_its_new_end():
    """TrainingRun.lent, what the feed adds to the holder's window: the head start's GPU seconds (its own meter) and
    the evaluators' (a meter from the window's opening over their processes); the turn's window end moves with it,
    so the next run's head start is timed from the end the window now has."""
    from autoresearch.experiment.execute import TrainingRun
    turn = GpuTurn(threading.Event())
    run = TrainingRun.__new__(TrainingRun)          # the parts lent() reads, without a process
    run.turn, run.taken, run.window_end0, run.given = turn, True, 100.0, (0.0, 0.0)
    assert turn.take(run) == "turn"
    turn.opened(run, 100.0, lambda: {30})
    assert turn.take("next", early=lambda: True) == "early"
    turn.started_early("next", lambda: 0.4)         # the next run's warm-up steps beside the window
    turn.evaluating(1, lambda: {40})                # the other slot's evaluator
    nv = NvmlStandIn()
    run.eval_meter = gputime.GpuMeter(nv, [0], floor_exits=False)
    run.eval_meter.start(turn.evaluator_pids)
    t0 = run.eval_meter._last[0]
    nv.samples = [(40 if k % 2 else 30, t0 + k * 200_000, 100) for k in range(1, 81)]   # each 0.2-s period goes
    # to one process: the evaluator's every other one, the window's own run (30) the rest
    assert run.lent() == pytest.approx(0.4 + 8.0)
    assert run.given == pytest.approx((0.4, 8.0)) and turn.window_end == pytest.approx(108.4)
    run.eval_meter.stop()
