"""A session's stop rules (limits.py) as tables: each row a tally of recorded results and what it says. The
--max-hours rule runs on a clock the test moves; nothing waits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from autoresearch.records.ledger import Status
from autoresearch.session.limits import Limits, Stop

from fixtures.clocks import ManualClock


def loop(max_crashes: int = 3, halted: str | None = None, said: list | None = None):
    return SimpleNamespace(cfg=SimpleNamespace(max_usd=None, max_consecutive_crashes=max_crashes), halted=halted,
                           proposer=None, tag="t", say=lambda *a: said.append(a) if said is not None else None,
                           exp_dir_of=lambda row: f"runs/t/{row.exp_id:04d}", ledger=None)


def row(status: Status, exp_id: int = 2, reason: str = "why"):
    return SimpleNamespace(status=status, exp_id=exp_id, reason=reason, agent_usd=None)


K, D, C, T, R = Status.KEEP, Status.DISCARD, Status.CRASH, Status.TIMEOUT, Status.REJECTED


@pytest.mark.parametrize("results, max_crashes, stops, phrase", [
    ([K, D, D, K], 3, None, None),
    ([C, C], 3, None, None),
    ([C, T, R], 3, 3, "3 crashed, timed-out or rejected experiments in a row"),
    ([C, C, D, C, C], 3, None, None),          # a counted result in between resets the run of failures
    ([C, C, K, C, T, C], 3, 6, "in a row"),
    ([C], 1, 1, "--max-consecutive-crashes 1"),
    ([Status.INTERRUPTED, Status.STALE, C], 2, None, None),   # neither failure nor success: no reset, no count
])
def test_failures_in_a_row(results, max_crashes, stops, phrase):
    lim = Limits(loop(max_crashes), None, None)
    for i, status in enumerate(results, 1):
        if stops == i:
            with pytest.raises(Stop) as e:
                lim.count("propose", row(status))
            assert phrase in str(e.value) and e.value.failed
            return
        lim.count("propose", row(status))
    assert stops is None and lim.n == len(results) and lim.kept == results.count(K)


@pytest.mark.parametrize("status, stops", [(K, False), (D, True), (C, True), (T, True)])
def test_a_baseline_that_did_not_run_cleanly_stops_the_session(status, stops):
    lim = Limits(loop(), None, None)
    if stops:
        with pytest.raises(Stop, match="the baseline did not run cleanly"):
            lim.count("baseline", row(status, exp_id=1))
    else:
        lim.count("baseline", row(status, exp_id=1))


def test_a_halt_stops_the_session_at_the_next_row():
    lim = Limits(loop(halted="the data changed"), None, None)
    with pytest.raises(Stop, match="the data changed; restore them"):
        lim.count("propose", row(K))


@pytest.mark.parametrize("done, in_flight, max_experiments, room", [
    (0, 0, None, True), (3, 0, 4, True), (3, 1, 4, False), (4, 0, 4, False), (0, 2, 2, False),
])
def test_max_experiments_leaves_room_for_what_is_in_flight(done, in_flight, max_experiments, room):
    lim = Limits(loop(), max_experiments, None)
    lim.n = done
    said = lim.no_room(in_flight)
    assert (said == "") == room
    if not room:
        assert said == f"reached --max-experiments {max_experiments}"


def test_max_hours_is_on_the_sessions_clock():
    clock = ManualClock()
    lim = Limits(loop(), None, 0.5, clock=clock)
    assert lim.no_room(0) == ""
    clock.advance(0.5 * 3600 - 1)
    assert lim.no_room(1) == ""
    clock.advance(1)
    assert lim.no_room(0) == "reached --max-hours 0.5"
